"""Wait for every rank of a launched job (a user's ``python script.py``) to write its result.

Shared by the fault tests that launch a real script (``test_lightning_faults.py``,
``test_fabric_faults.py``): rank 0 is the launcher (Lightning's and Fabric's script launcher
re-run the script for the other ranks), each rank writes ``OUT/rank<r>.json`` as it ends and
``OUT/pid<r>`` as it starts. The wait is bounded: a rank without a result by then is a hang,
and the test fails naming it (after killing every rank it started).
"""

from __future__ import annotations

import inspect
import json
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

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


class JobsAhead:
    """Launched jobs started ahead of the tests that read them, ``width`` at a time, in the
    order they were started (the order the tests will ask for them).

    Why: a launched job spends most of its wall time starting up (each rank's interpreter
    imports torch and Lightning, ~4 s on the 2-core machine, and rank 0 starts the others only
    after its own import), with one core idle meanwhile. Two jobs at a time take ~55% of the
    time of one after another (measured: four W=2 fault jobs in 19.9 s against 9.1 s each).
    Each job still runs in processes of its own, under the same bound; only its start is early.
    A job's failure (a hang, a missing result) is raised by :meth:`result` in its own test.
    """

    def __init__(self, width: int = 2) -> None:
        self._pool = ThreadPoolExecutor(max_workers=width)
        self._jobs: dict[tuple[str, tuple], tuple[Path, Future[Any]]] = {}

    def start(self, label: str, run: Callable[[Path, tuple], Any], cases: Sequence[tuple],
              folder: Callable[[tuple], Path]) -> None:
        """Queue ``run(folder(case), case)`` for each case, read back by ``result(label, case)``."""
        for case in cases:
            out = folder(case)
            self._jobs[label, case] = (out, self._pool.submit(run, out, case))

    def result(self, label: str, case: tuple) -> tuple[Path, Any]:
        """The case's folder and what its ``run`` returned (waiting for it to end)."""
        if (label, case) not in self._jobs:
            raise KeyError(f"{label} {case} was not started ahead: the cases come from the "
                           "collected tests (selected_cases)")
        out, future = self._jobs[label, case]
        return out, future.result()

    def close(self) -> None:
        """Wait for every started job (each bounded by its own wait), then end the threads."""
        self._pool.shutdown(wait=True)


def selected_cases(request: pytest.FixtureRequest, test: Callable[..., Any]) -> list[tuple]:
    """The parameter tuples of ``test``'s collected (selected) cases, in the order they run,
    each in its ``parametrize`` order, so a ``-k`` run starts only the jobs it will read."""
    cases = []
    for item in request.session.items:
        if isinstance(item, pytest.Function) and item.function is test:
            params = item.callspec.params if hasattr(item, "callspec") else {}
            names = [name for name in inspect.signature(test).parameters if name in params]
            cases.append(tuple(params[name] for name in names))
    return cases
