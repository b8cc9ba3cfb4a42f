"""A preemption notice in a Fabric loop stops every rank after the same step, never a hang.

Launches ``fabric_preempt_script.py`` the way a user runs a Fabric script (Fabric's script
launcher starts rank 1) and sends SIGTERM to the last stage's rank from inside its loss code in
step 3 of 6, while rank 0 is in the step's traffic. Every rank must see
``fabric.strategy.preempted`` after the same step, save one checkpoint of that step (a
collective) and leave its loop; a further ``step`` raises ``PreemptedError`` on every rank. The
wait is bounded (the job's ``step_timeout`` is 30 s): a rank without a result is a hang, named.
The same launch then checks an uncaught error in the user's loop on rank 1 (see the script).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launched_jobs import wait_for_ranks

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "fabric_preempt_script.py"
BOUND = 180.0  # start-up (~10 s per process on 2 cores) + a few step_timeouts (30 s)
SIGNAL_RANK, SIGNAL_STEP = 1, 2  # loop index 2: the third step


@pytest.mark.distributed
def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS="1")
    with open(tmp_path / "log.txt", "w") as log:
        launcher = subprocess.Popen(
            [sys.executable, str(SCRIPT), str(tmp_path), str(SIGNAL_RANK), str(SIGNAL_STEP), "loss",
             "sigterm", "uncaught"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
    results = wait_for_ranks(launcher, tmp_path, 2, BOUND)
    assert launcher.returncode == 0, (tmp_path / "log.txt").read_text()[-3000:]
    for r in results:
        assert r["outcome"] == "preempted", r
    assert {r["steps"] for r in results} == {SIGNAL_STEP + 1}  # the signalled step, finished
    for r in results:
        assert r["notice"].startswith(
            f"rank {r['rank']}: preemption notice (SIGTERM on rank {SIGNAL_RANK}) agreed by "
            f"every rank in step {SIGNAL_STEP + 1}"), r
        assert "fabric.strategy.step was called after it" in r["after"], r
    log = (tmp_path / "log.txt").read_text()
    for rank in range(2):
        assert f"rank {rank}: preemption notice (SIGTERM on rank {SIGNAL_RANK})" in log, log
    # then rank 1 ends by an uncaught error of the user's loop: rank 0, in a barrier, stops
    # naming it, and lives past Lightning's child observer (its exit code, 0, is the launcher's)
    after = json.loads((tmp_path / "after0.json").read_text())["message"]
    assert after is not None and after.startswith("RuntimeFault: rank 0 stopped in a barrier"), after
    assert "rank 1 ended by an uncaught ValueError: a bug in the user's loop on rank 1" in after
    assert "ValueError: a bug in the user's loop on rank 1" in log  # rank 1's traceback
    saved = torch.load(tmp_path / "ckpt.pt", map_location="cpu", weights_only=False)
    assert saved["step"] == SIGNAL_STEP + 1
    assert set(saved["model"]) == {f"layers.{i}.{p}" for i in range(4)
                                   for p in ("weight", "bias")}


def test_the_handler_records_chains_and_is_put_back() -> None:
    """In one process: SIGTERM is recorded (the process lives), a program's own SIGTERM handler
    still runs, a program's own SIGUSR1 handler stays in charge, and uninstall puts both back;
    the ranks' notices agree once, naming each signal and rank."""
    from lightning_gsched.engine import PreemptionNotice

    seen: list[int] = []

    def own(signum: int, frame: object) -> None:
        seen.append(signum)

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    notice = PreemptionNotice()
    try:
        signal.signal(signal.SIGTERM, own)
        signal.signal(signal.SIGUSR1, own)
        notice.install()
        assert signal.getsignal(signal.SIGUSR1) is own
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert notice.pending == signal.SIGTERM and seen == [signal.SIGTERM, signal.SIGUSR1]
        notice.uninstall()
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        notice.uninstall()
        for signum, handler in before.items():
            signal.signal(signum, handler)
    assert not notice.agree([0, 0], "step 1") and not notice.agreed
    assert notice.agree([0, int(signal.SIGTERM)], "step 2")
    assert not notice.agree([int(signal.SIGUSR1), 0], "step 3")  # the first agreement stays
    assert notice.describe(0, "stop.") == (
        "rank 0: preemption notice (SIGTERM on rank 1) agreed by every rank in step 2; stop.")
