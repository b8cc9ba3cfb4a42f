"""Preemption signals and failures in any hook end every rank of a real job, never a hang.

Each case launches ``preempt_script.py`` the way a user runs a script (Lightning's script
launcher starts the other ranks), injects one fault at a chosen rank, step and place, and waits
for every rank's result file. The wait is bounded (the job's ``step_timeout`` is 30 s; the bound
is a few of those plus start-up): a rank that has not answered by then is a hang, and the test
fails naming it. Nothing asserts on durations otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.distributed

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "preempt_script.py"
BOUND = 240.0  # start-up (~10 s per process on 2 cores) + a few step_timeouts (30 s)


def run_job(tmp: Path, schedule: str, world: int, fault: str, rank: int, step: int,
            where: str, resume: bool = False, state_dict_type: str = "full") -> list[dict]:
    """Launch the job, wait (bounded) for every rank's result; the results in rank order."""
    tmp.mkdir(parents=True, exist_ok=True)
    for old in tmp.glob("rank*.json"):
        old.unlink()
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS="1")
    env.pop("GSCHED_TEST_LAUNCHER", None)
    if resume:
        env["RESUME"] = "1"
    else:
        env.pop("RESUME", None)
    with open(tmp / "log.txt", "w") as log:
        launcher = subprocess.Popen(
            [sys.executable, str(SCRIPT), str(tmp), schedule, str(world), fault, str(rank),
             str(step), where, state_dict_type], env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + BOUND
    files = [tmp / f"rank{r}.json" for r in range(world)]
    while not all(f.exists() for f in files) and time.monotonic() < deadline:
        time.sleep(0.5)
    missing = [r for r, f in enumerate(files) if not f.exists()]
    if missing:  # a hang: stop every rank we started, then fail naming the ones stuck
        for pid_file in tmp.glob("pid*"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        launcher.kill()
        log_tail = (tmp / "log.txt").read_text()[-3000:]
        pytest.fail(f"ranks {missing} did not end within {BOUND:g} s (a hang):\n{log_tail}")
    launcher.wait(timeout=60)
    time.sleep(0.5)  # the result files are written just before each process exits
    return [json.loads(f.read_text()) for f in files]


PREEMPTIONS = [
    # (schedule, world, fault, rank, step, where)
    ("1f1b", 2, "sigterm", 1, 3, "loss"),  # last rank, inside the schedule's last stage
    ("1f1b", 2, "sigterm-launcher", 0, 1, "capture"),  # the launcher, before self(...)
    ("fslpp", 4, "sigterm", 3, 2, "validation"),  # during validation, on the last rank
    ("fslpp", 4, "sigusr1", 0, 3, "batch_start"),  # SIGUSR1 on rank 0 between steps
]


@pytest.mark.parametrize("schedule, world, fault, rank, step, where", PREEMPTIONS,
                         ids=["-".join(map(str, case)) for case in PREEMPTIONS])
def test_preemption_signal_stops_every_rank_after_the_same_step(
        tmp_path: Path, schedule: str, world: int, fault: str, rank: int, step: int,
        where: str) -> None:
    results = run_job(tmp_path, schedule, world, fault, rank, step, where)
    for r in results:
        assert r["outcome"] == "SIGTERMException", r
    stops = {r["step"] for r in results}
    assert len(stops) == 1, results  # the same boundary on every rank
    (stop,) = stops
    assert stop >= step  # the step running when the signal came was finished
    log = (tmp_path / "log.txt").read_text()
    name = "SIGUSR1" if fault == "sigusr1" else "SIGTERM"
    for r in range(world):
        assert f"rank {r}: preemption notice ({name} on rank" in log, log[-3000:]
    # ModelCheckpoint(save_on_exception=True, save_last=True) saved that step on the way out
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == stop


FAILURES = [
    # rank 0 after self(...): only where the whole step runs (the sanity check's first batch
    # probes the model on every rank); in a pipelined validation step that code runs on the
    # last stage's ranks only, so rank 0 fails before self(...) in the next case
    ("fslpp", 4, "raise", 0, 0, "validation"),
    ("fslpp", 4, "raise", 0, 2, "validation_capture"),
    ("fslpp", 4, "raise", 3, 2, "validation"),
    ("1f1b", 2, "raise", 0, 1, "batch_end"),
    ("1f1b", 2, "raise", 1, 1, "data"),
]


@pytest.mark.parametrize("schedule, world, fault, rank, step, where", FAILURES,
                         ids=["-".join(map(str, case)) for case in FAILURES])
def test_exception_in_a_hook_on_one_rank_stops_every_rank_naming_it(
        tmp_path: Path, schedule: str, world: int, fault: str, rank: int, step: int,
        where: str) -> None:
    results = run_job(tmp_path, schedule, world, fault, rank, step, where)
    for r in results:
        assert r["outcome"] not in ("finished", "SIGTERMException"), r
    failing = results[rank]
    assert failing["outcome"] == "ValueError" or f"rank {rank} failed" in failing["message"], \
        failing
    for r in results:
        if r["rank"] != rank and r["outcome"] != "ValueError":
            assert r["outcome"] == "RuntimeFault", r
            assert f"rank {rank} failed" in r["message"], r["message"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The uninterrupted job's final weights per (schedule, world), run once for the module
    (the checkpoint format does not change the training, so the cases share it)."""
    runs: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def weights(schedule: str, world: int) -> dict[str, torch.Tensor]:
        if (schedule, world) not in runs:
            out = tmp_path_factory.mktemp(f"whole-{schedule}-{world}")
            whole = run_job(out, schedule, world, "none", 0, 0, "loss")
            assert [r["outcome"] for r in whole] == ["finished"] * world, whole
            runs[schedule, world] = torch.load(out / "final.pt", map_location="cpu")
        return runs[schedule, world]

    return weights


RESUMES = [
    # (schedule, world, state_dict_type)
    ("1f1b", 2, "full"),
    ("1f1b", 2, "sharded"),
    ("fslpp", 2, "full"),
    ("fslpp", 2, "sharded"),
]


@pytest.mark.parametrize("schedule, world, state_dict_type", RESUMES,
                         ids=["-".join(map(str, case)) for case in RESUMES])
def test_resume_after_preemption_equals_the_uninterrupted_run(
        tmp_path: Path, uninterrupted: Any, schedule: str, world: int,
        state_dict_type: str) -> None:
    """SIGTERM on the last rank in step 3 of 6, ``ckpt_path="last"``, train to the end: the
    final weights are the uninterrupted job's. The job's loader is resumable (see
    preempt_script.FaultyLoader), so the resumed steps see the batches the uninterrupted job
    saw at those steps; the one-batch-per-step data makes a wrong batch change the weights."""
    want = uninterrupted(schedule, world)
    last = world - 1
    stopped = run_job(tmp_path, schedule, world, "sigterm", last, 3, "loss",
                      state_dict_type=state_dict_type)
    assert [r["outcome"] for r in stopped] == ["SIGTERMException"] * world, stopped
    assert stopped[last]["injected"], stopped
    stop = stopped[0]["step"]
    assert 3 <= stop < 6 and not (tmp_path / "final.pt").exists()
    saved = tmp_path / "ckpt" / "last.ckpt"
    assert saved.is_dir() == (state_dict_type == "sharded"), saved
    resumed = run_job(tmp_path, schedule, world, "none", 0, 0, "loss", resume=True,
                      state_dict_type=state_dict_type)
    assert [(r["outcome"], r["step"]) for r in resumed] == [("finished", 6)] * world, resumed
    got = torch.load(tmp_path / "final.pt", map_location="cpu")
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=0, msg=key)
    log = (tmp_path / "log.txt").read_text()
    assert "Restoring states from the checkpoint path" in log, log[-3000:]
    assert "dataloader is not resumable" not in log  # Lightning's warning for a plain loader
