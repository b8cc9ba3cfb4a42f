"""Preemption signals and failures in any hook end every rank of a real job, never a hang.

Each case launches ``preempt_script.py`` the way a user runs a script (Lightning's script
launcher starts the other ranks), injects one fault at a chosen rank, step and place, and waits
for every rank's result file. The wait is bounded (the job's ``step_timeout`` is 30 s; the bound
is a few of those plus start-up): a rank that has not answered by then is a hang, and the test
fails naming it. Nothing asserts on durations otherwise. The one-job cases are started two at a
time ahead of their tests (``ahead``, launched_jobs.JobsAhead): most of a job's wall time is its
ranks' start-up, one after another.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator, cast

import pytest
import torch

from launched_jobs import JobsAhead, selected_cases, wait_for_ranks

pytestmark = pytest.mark.distributed

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "preempt_script.py"
BOUND = 240.0  # start-up (~10 s per process on 2 cores) + a few step_timeouts (30 s)


def run_job(tmp: Path, schedule: str, world: int, fault: str, rank: int, step: int,
            where: str, resume: bool = False, state_dict_type: str = "full",
            rank0_after: float = 0.0) -> list[dict]:
    """Launch the job, wait (bounded) for every rank's result; the results in rank order.
    ``rank0_after``: seconds rank 0's script spends after ``fit`` ends before it writes."""
    tmp.mkdir(parents=True, exist_ok=True)
    for old in tmp.glob("rank*.json"):
        old.unlink()
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS="1")
    env.pop("GSCHED_TEST_LAUNCHER", None)
    env["GSCHED_TEST_RANK0_AFTER"] = str(rank0_after)
    if resume:
        env["RESUME"] = "1"
    else:
        env.pop("RESUME", None)
    with open(tmp / "log.txt", "w") as log:
        launcher = subprocess.Popen(
            [sys.executable, str(SCRIPT), str(tmp), schedule, str(world), fault, str(rank),
             str(step), where, state_dict_type], env=env, stdout=log, stderr=subprocess.STDOUT)
    return wait_for_ranks(launcher, tmp, world, BOUND)


@pytest.fixture(scope="module")
def jobs() -> Iterator[JobsAhead]:
    """This module's launched jobs, two at a time (launched_jobs.JobsAhead)."""
    pool = JobsAhead(width=2)
    yield pool
    pool.close()


def one_job(out: Path, case: tuple) -> list[dict]:
    """A preemption's or a failure's job: ``case`` starts (schedule, world, fault, rank,
    step, where)."""
    schedule, world, fault, rank, step, where = case[:6]
    return run_job(out, schedule, world, fault, rank, step, where,
                   rank0_after=6.0 if case[:6] in OUTLIVED else 0.0)


@pytest.fixture(scope="module")
def ahead(request: pytest.FixtureRequest, jobs: JobsAhead,
          tmp_path_factory: pytest.TempPathFactory) -> JobsAhead:
    """The selected preemption and failure cases, started ahead of their tests."""
    for test in (test_preemption_signal_stops_every_rank_after_the_same_step,
                 test_exception_in_a_hook_on_one_rank_stops_every_rank_naming_it):
        jobs.start(test.__name__, one_job, selected_cases(request, test),
                   lambda case: tmp_path_factory.mktemp("-".join(map(str, case[:6]))))
    return jobs


PREEMPTIONS = [
    # (schedule, world, fault, rank, step, where)
    ("1f1b", 2, "sigterm", 1, 3, "loss"),  # last rank, inside the schedule's last stage
    ("1f1b", 2, "sigterm-launcher", 0, 1, "capture"),  # the launcher, before self(...)
    ("fslpp", 4, "sigterm", 3, 2, "validation"),  # during validation, on the last rank
    ("fslpp", 2, "sigusr1", 0, 3, "batch_start"),  # SIGUSR1 on rank 0 between steps
    # in the module's setup hook, before the loop: recorded, agreed at the first step (it
    # killed the rank: Lightning registers its handlers only as the loop starts)
    ("1f1b", 2, "sigterm", 1, 0, "setup"),
]


@pytest.mark.parametrize("schedule, world, fault, rank, step, where", PREEMPTIONS,
                         ids=["-".join(map(str, case)) for case in PREEMPTIONS])
def test_preemption_signal_stops_every_rank_after_the_same_step(
        ahead: JobsAhead, schedule: str, world: int, fault: str, rank: int, step: int,
        where: str) -> None:
    out, results = ahead.result(test_preemption_signal_stops_every_rank_after_the_same_step
                                .__name__, (schedule, world, fault, rank, step, where))
    for r in results:
        assert r["outcome"] == "SIGTERMException", r
    stops = {r["step"] for r in results}
    assert len(stops) == 1, results  # the same boundary on every rank
    (stop,) = stops
    assert stop >= step  # the step running when the signal came was finished
    log = (out / "log.txt").read_text()
    name = "SIGUSR1" if fault == "sigusr1" else "SIGTERM"
    for r in range(world):
        assert f"rank {r}: preemption notice ({name} on rank" in log, log[-3000:]
    # ModelCheckpoint(save_on_exception=True, save_last=True) saved that step on the way out
    saved = torch.load(out / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == stop


FAILURES = [
    # (schedule, world, fault, rank, step, where, the hook every rank's error names)
    # A step's code after self(...) runs on the rank computing the last stage of that
    # microbatch, the code before it on stage 0's rank; only the first batch's probe (and a
    # sanity check's) runs the whole step on every rank. So rank 0 raises after self(...) at
    # step/batch 0 (the probe) and before it later; the last rank after it.
    # (W=2 where W=4 shows nothing more: the suite's time; rank 3 of W=4 below, and W=3's
    # middle rank, show that ranks that are neither stage 0's nor the failing one end too)
    ("fslpp", 2, "raise", 0, 0, "validation", "validation_step"),
    ("fslpp", 4, "raise", 0, 2, "validation_capture", "Faulty.validation_step"),
    # the last rank of a replica (P=2 x G=2): its pipeline peer loses it in the runtime
    # while the other replica's ranks wait in the evaluation gather (a control collective),
    # and every peer must quote the failing rank, not the first peer to notice (the runtime
    # and the control group keep one job-wide notice: 2 runs in 3 named the peer before)
    ("1f1b+dp2", 4, "raise", 3, 2, "validation", "Faulty.validation_step after self(...)"),
    ("1f1b", 2, "raise", 0, 1, "capture", "Faulty.training_step"),
    # (the last rank in training_step after self(...): test_lightning_errors.py)
    ("1f1b", 2, "raise", 0, 1, "batch_end", "Injector.on_train_batch_end"),
    ("1f1b", 2, "raise", 1, 1, "batch_end", "Injector.on_train_batch_end"),
    ("1f1b", 2, "raise", 0, 1, "data", "the dataloader (next batch)"),
    # before the strategy's setup (the module's setup hook, between Lightning's barriers):
    # the peer waits in the barrier, which was the default group's (a bare gloo error)
    ("1f1b", 2, "raise", 1, 0, "setup", "Faulty.setup"),
    ("1f1b", 2, "raise", 1, 1, "data", "the dataloader (next batch)"),
    # trainer.test / trainer.predict (STEP is the batch index; batch 0 builds the pipeline)
    ("1f1b", 2, "raise", 0, 0, "test:loss", "test_step"),
    ("1f1b", 2, "raise", 0, 1, "test:capture", "Faulty.test_step"),
    ("1f1b", 2, "raise", 1, 1, "test:loss", "Faulty.test_step after self(...)"),
    ("1f1b", 2, "raise", 0, 1, "test:batch_end", "Injector.on_test_batch_end"),
    ("1f1b", 2, "raise", 0, 0, "predict:loss", "predict_step"),
    ("1f1b", 2, "raise", 0, 1, "predict:capture", "Faulty.predict_step"),
    ("1f1b", 2, "raise", 1, 2, "predict:data", "the dataloader (next batch)"),
    # tensor-parallel workers (W=4 as P=2 x T=2): rank 3 raises after self(...) while its
    # worker's other rank (2) goes on into the backward, where a row-wise layer's all-reduce
    # waits for rank 3: the failing rank's abort closes the mesh's groups too (checkpoints
    # every 2 steps gather the shards, so one was saved before the raise)
    ("1f1b+tp2", 4, "raise", 3, 3, "loss", "Faulty.training_step after self(...)"),
    # W=3: the middle rank (neither stage 0 nor the last stage) ends too
    ("1f1b", 3, "raise", 2, 1, "predict:loss", "Faulty.predict_step after self(...)"),
]


# Lightning's launcher (rank 0) SIGKILLs itself and every child within 5 s of a child exiting
# non-zero. In this case rank 0's script takes 6 s after ``fit`` before it writes: it still
# writes, because the failed child waits for rank 0's process to end (ControlGroup.outlive_host)
OUTLIVED = {("1f1b", 2, "raise", 1, 1, "batch_end")}


@pytest.mark.parametrize("schedule, world, fault, rank, step, where, hook", FAILURES,
                         ids=["-".join(map(str, case[:6])) for case in FAILURES])
def test_exception_in_a_hook_on_one_rank_stops_every_rank_naming_it(
        ahead: JobsAhead, schedule: str, world: int, fault: str, rank: int, step: int,
        where: str, hook: str) -> None:
    outlived = (schedule, world, fault, rank, step, where) in OUTLIVED
    out, results = ahead.result(
        test_exception_in_a_hook_on_one_rank_stops_every_rank_naming_it.__name__,
        (schedule, world, fault, rank, step, where, hook))
    assert results[rank]["injected"], results[rank]
    if outlived:  # the failed child ended after rank 0 had written
        assert results[rank]["ended"] >= results[0]["ended"], results
    for r in results:
        assert r["outcome"] not in ("finished", "SIGTERMException"), r
    named = f"rank {rank} failed"
    failing = results[rank]
    if failing["outcome"] == "ValueError":  # the user's own exception, re-raised as it was;
        log = (out / "log.txt").read_text()  # the rank prints what the others are told
        assert f"{named} in {hook}" in log, log[-3000:]
    else:
        assert named in failing["message"] and hook in failing["message"], failing
    for r in results:
        if r["rank"] != rank:
            assert r["outcome"] == "RuntimeFault", r
            # stopped by the failure (a closed connection, the notice), not by step_timeout: a
            # failing rank's groups must close their connections (runtime.release_frames)
            assert "nothing arrived within" not in r["message"], r
            assert named in r["message"] and hook in r["message"], r["message"]
    ended = [r["ended"] - failing["injected_at"] for r in results]
    print(f"{where} raised on rank {rank} of {world}: every rank ended "
          f"{min(ended):.1f}-{max(ended):.1f} s after the raise")


def whole_run(out: Path, case: tuple) -> dict[str, torch.Tensor]:
    """The uninterrupted job of ``case`` = (schedule, world): its final weights."""
    schedule, world = case
    whole = run_job(out, schedule, world, "none", 0, 0, "loss")
    assert [r["outcome"] for r in whole] == ["finished"] * world, whole
    return cast(dict[str, torch.Tensor], torch.load(out / "final.pt", map_location="cpu"))


def stop_then_resume(out: Path, case: tuple) -> tuple[list[dict], list[dict]]:
    """``case`` = (schedule, world, state_dict_type): SIGTERM on the last rank in step 3 of 6,
    then the same job again with ``ckpt_path="last"``; both jobs' results."""
    schedule, world, state_dict_type = case
    stopped = run_job(out, schedule, world, "sigterm", world - 1, 3, "loss",
                      state_dict_type=state_dict_type)
    assert [r["outcome"] for r in stopped] == ["SIGTERMException"] * world, stopped
    assert not (out / "final.pt").exists()
    saved = out / "ckpt" / "last.ckpt"
    assert saved.is_dir() == (state_dict_type == "sharded"), saved
    resumed = run_job(out, schedule, world, "none", 0, 0, "loss", resume=True,
                      state_dict_type=state_dict_type)
    return stopped, resumed


WHOLE, RESUMED = "uninterrupted", "stopped and resumed"


@pytest.fixture(scope="module")
def uninterrupted(request: pytest.FixtureRequest, jobs: JobsAhead,
                  tmp_path_factory: pytest.TempPathFactory) -> JobsAhead:
    """The uninterrupted jobs (one per schedule and world: the checkpoint format does not
    change the training, so the cases share it) and the resume cases' job pairs the selected
    tests need, started ahead of them: the uninterrupted ones first."""
    resumes = selected_cases(request, test_resume_after_preemption_equals_the_uninterrupted_run)
    needed = {case[:2] for case in resumes}
    if selected_cases(request, test_torchrun_restart_after_kill9_resumes_from_the_last_checkpoint):
        needed.add(("1f1b", 2))
    jobs.start(WHOLE, whole_run, sorted(needed),
               lambda case: tmp_path_factory.mktemp("whole-{}-{}".format(*case)))
    jobs.start(RESUMED, stop_then_resume, resumes,
               lambda case: tmp_path_factory.mktemp("resume-{}-{}-{}".format(*case)))
    return jobs


RESUMES = [
    # (schedule, world, state_dict_type): each schedule family and each checkpoint kind once
    # (both kinds under both schedules took 74 s of the suite's budget; the kinds' own resume
    # paths are checked across schedules in test_lightning_checkpoint.py)
    ("1f1b", 2, "sharded"),
    ("fslpp", 2, "full"),
]


@pytest.mark.parametrize("schedule, world, state_dict_type", RESUMES,
                         ids=["-".join(map(str, case)) for case in RESUMES])
def test_resume_after_preemption_equals_the_uninterrupted_run(
        uninterrupted: JobsAhead, schedule: str, world: int, state_dict_type: str) -> None:
    """SIGTERM on the last rank in step 3 of 6, ``ckpt_path="last"``, train to the end: the
    final weights are the uninterrupted job's. The job's loader is resumable (see
    preempt_script.FaultyLoader), so the resumed steps see the batches the uninterrupted job
    saw at those steps; the one-batch-per-step data makes a wrong batch change the weights."""
    _, want = uninterrupted.result(WHOLE, (schedule, world))
    out, (stopped, resumed) = uninterrupted.result(RESUMED, (schedule, world, state_dict_type))
    assert stopped[world - 1]["injected"], stopped
    assert 3 <= stopped[0]["step"] < 6, stopped
    assert [(r["outcome"], r["step"]) for r in resumed] == [("finished", 6)] * world, resumed
    got = torch.load(out / "final.pt", map_location="cpu")
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=0, msg=key)
    log = (out / "log.txt").read_text()
    assert "Restoring states from the checkpoint path" in log, log[-3000:]
    assert "dataloader is not resumable" not in log  # Lightning's warning for a plain loader


def run_torchrun(tmp: Path, schedule: str, world: int, rank: int, step: int) -> tuple[int, str]:
    """``torchrun --standalone --nproc-per-node=W --max-restarts=1 preempt_script.py ...`` with
    a kill -9 of ``rank`` at ``step`` on the first attempt; its exit code and log (bounded: a
    torchrun still running after BOUND is a hang, its whole session is killed)."""
    tmp.mkdir(parents=True, exist_ok=True)
    # a store per attempt: torchrun's rendezvous store, shared with the workers by default,
    # keeps the first attempt's keys, and the restarted ranks' process groups can read a dead
    # rank's address from it (pytorch/pytorch#135712; docs/runtime.md, "Faults")
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    for name in ("GSCHED_TEST_LAUNCHER", "RESUME"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={world}", "--max-restarts=1", str(SCRIPT), str(tmp),
               schedule, str(world), "kill9", str(rank), str(step), "batch_start"]
    with open(tmp / "log.txt", "w") as log:
        torchrun = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            code = torchrun.wait(timeout=2 * BOUND)  # two attempts
        except subprocess.TimeoutExpired:
            os.killpg(torchrun.pid, signal.SIGKILL)
            torchrun.wait()
            pytest.fail(f"torchrun did not end within {2 * BOUND:g} s (a hang):\n"
                        + (tmp / "log.txt").read_text()[-3000:])
    return code, (tmp / "log.txt").read_text()


def test_torchrun_restart_after_kill9_resumes_from_the_last_checkpoint(
        tmp_path: Path, uninterrupted: JobsAhead) -> None:
    """kill -9 of the last rank in step 4 of 6 (after the checkpoint of step 2): the other
    rank ends on the lost connection (a RuntimeFault, not a hang), torchrun restarts the group
    once, the restart resumes from ``last.ckpt`` and trains to the end: the final weights are
    the uninterrupted job's (rel 1e-6)."""
    _, want = uninterrupted.result(WHOLE, ("1f1b", 2))
    code, log = run_torchrun(tmp_path, "1f1b", 2, rank=1, step=3)
    assert code == 0, log[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["outcome"], r["step"], r["attempt"]) for r in results] == \
        [("finished", 6, 1)] * 2, results
    assert "Restoring states from the checkpoint path" in log, log[-3000:]
    assert "last.ckpt" in log, log[-3000:]
    # the first attempt: rank 0 stopped with a named fault when rank 1 was killed
    assert "rank 0 stopped" in log and "lost the connection to a peer" in log, log[-3000:]
    # ... naming the killed rank, which could report nothing (runtime/peer_processes.py)
    assert "rank 1 (pid " in log and "has exited without reporting a failure" in log, \
        log[-3000:]
    got = torch.load(tmp_path / "final.pt", map_location="cpu")
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=0, msg=key)
