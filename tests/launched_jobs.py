"""Wait for every rank of a launched job (a user's ``python script.py``) to write its result.

Shared by the fault tests that launch a real script (``test_lightning_faults.py``,
``test_fabric_faults.py``): rank 0 is the launcher (Lightning's and Fabric's script launcher
re-run the script for the other ranks), each rank writes ``OUT/rank<r>.json`` as it ends and
``OUT/pid<r>`` as it starts. The wait is bounded: a rank without a result by then is a hang,
and the test fails naming it (after killing every rank it started).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.fault_trials import stop_job


def wait_for_ranks(launcher: subprocess.Popen, out: Path, world: int, bound: float) -> list[dict]:
    """Every rank's result in rank order, or a test failure naming the ranks without one.
    ``out/log.txt`` holds the job's output (quoted in the failure)."""
    deadline = time.monotonic() + bound
    files = [out / f"rank{r}.json" for r in range(world)]
    launcher_gone = float("inf")  # rank 0 is the launcher: once it is gone, give the rest 10 s
    while (not all(f.exists() for f in files) and time.monotonic() < deadline
           and time.monotonic() < launcher_gone + 10.0):
        if launcher.poll() is not None:
            launcher_gone = min(launcher_gone, time.monotonic())
        time.sleep(0.1)
    missing = [r for r, f in enumerate(files) if not f.exists()]
    if missing and launcher.poll() is not None and not (out / "rank0.json").exists():
        pytest.fail(f"rank 0 (the launcher) ended with code {launcher.returncode} without "
                    f"writing its result; ranks {missing} have none:\n"
                    + (out / "log.txt").read_text()[-3000:])
    if missing:  # a hang: stop every rank we started, then fail naming the ones stuck
        stop_job(out, launcher)
        log_tail = (out / "log.txt").read_text()[-3000:]
        pytest.fail(f"ranks {missing} did not end within {bound:g} s (a hang):\n{log_tail}")
    launcher.wait(timeout=60)
    # each script writes its result whole, by a rename (preempt_script.py)
    return [json.loads(f.read_text()) for f in files]
