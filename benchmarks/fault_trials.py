"""SIGTERM trials: does every rank of a real job stop at the same step, whatever the moment?

Each trial launches ``tests/preempt_script.py`` (Lightning's script launcher starts the other
ranks) with one SIGTERM at a chosen rank, step and point (``sigterm-launcher``: the chosen
rank signals rank 0, the launcher). The moments are drawn (seeded) from every rank, steps 0-4
of 6 and the script's points; a point the job never reaches at that rank and step (e.g. the
loss on a rank without the last stage) sends nothing, so a trial counts only when the script
reports the signal sent (``injected``), and drawing goes on until N trials have delivered one.
Each trial is bounded (``--timeout``): a rank without a result by then is a hang.

``1f1b+tp2``: the same at W=4 as P=2 pipeline workers x T=2 tensor-parallel ranks (a signal
may land while a worker's two ranks are inside a row-wise layer's all-reduce).

``fabric-1f1b``: the same trials for a user's own Fabric loop (``tests/fabric_preempt_script.py``,
1f1b at W=2, 6 steps): SIGTERM to the rank itself or to rank 0 (the launcher) before
``strategy.step``, inside the loss function or after ``optimizer.step``; the agreed stop is
``fabric.strategy.preempted`` after the same step on every rank, then a checkpoint and leaving
the loop (the script's ``outcome`` is ``preempted``).

Per configuration it prints: trials delivered (and tried), trials where every rank ended with
the agreed stop (``SIGTERMException``, no hang), trials where every rank stopped after the same
step, the range of stop step - signalled step, and the min/max wall time of a trial (launch to
the last rank's result; start-up included).

    python -m benchmarks.fault_trials [--trials 10] [--timeout 180] [--seed 0] [--only 1f1b+tp2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "preempt_script.py"
FABRIC_SCRIPT = ROOT / "tests" / "fabric_preempt_script.py"  # 1f1b, W=2, a user's own loop
FABRIC = "fabric-1f1b"
# "1f1b+tp2": 1f1b over P=2 workers of T=2 tensor-parallel ranks (W=4; the script's plan)
CONFIGS = [("1f1b", 2), ("fslpp", 4), ("1f1b+tp2", 4), (FABRIC, 2)]
POINTS = ["batch_start", "capture", "loss", "batch_end", "data"]
EVAL_POINTS = ["validation", "validation_capture", "save"]  # reached at steps 2 and 4 only
FABRIC_POINTS = ["before_step", "loss", "after_step"]


def moments(world: int, seed: int, fabric: bool = False) -> list[tuple[str, int, int, str]]:
    """Every (fault, rank, step, point), in a seeded random order."""
    def points(step: int) -> list[str]:
        if fabric:
            return FABRIC_POINTS
        return POINTS + (EVAL_POINTS if step in (2, 4) else [])

    found = [(fault, rank, step, where)
             for fault in ("sigterm", "sigterm-launcher") for rank in range(world)
             for step in range(5) for where in points(step)]
    random.Random(seed).shuffle(found)
    return found


def _command(out: Path, schedule: str, world: int, moment: tuple[str, int, int, str]
             ) -> list[str]:
    fault, rank, step, where = moment
    if schedule == FABRIC:
        return [sys.executable, str(FABRIC_SCRIPT), str(out), str(rank), str(step), where, fault]
    return [sys.executable, str(SCRIPT), str(out), schedule, str(world), fault, str(rank),
            str(step), where]


def outcome(schedule: str, moment: tuple[str, int, int, str], result: dict[str, Any]
            ) -> tuple[bool, int, int]:
    """(the rank ended with the agreed stop, the step it stopped at, that step - the steps done
    when the signal was sent). Fabric's loop counts steps done; after_step signals one later."""
    if schedule == FABRIC:
        signalled = moment[2] + (moment[3] == "after_step")
        return result["outcome"] == "preempted", result["steps"], result["steps"] - signalled
    return result["outcome"] == "SIGTERMException", result["step"], result["step"] - moment[2]


def trial(out: Path, schedule: str, world: int, moment: tuple[str, int, int, str],
          timeout: float) -> tuple[list[dict[str, Any]] | None, float]:
    """One launched job; (every rank's result, or None on a hang; wall seconds)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("GSCHED_TEST_LAUNCHER", None)
    env.pop("RESUME", None)
    start = time.monotonic()
    with open(out / "log.txt", "w") as log:
        launcher = subprocess.Popen(_command(out, schedule, world, moment), env=env,
                                    stdout=log, stderr=subprocess.STDOUT)
    files = [out / f"rank{r}.json" for r in range(world)]
    while not all(f.exists() for f in files) and time.monotonic() - start < timeout:
        time.sleep(0.2)
    wall = time.monotonic() - start
    if not all(f.exists() for f in files):
        stop_job(out, launcher)
        launcher.wait()
        return None, wall
    launcher.wait(timeout=60)
    time.sleep(0.3)  # the result files are written just before each process exits
    return [json.loads(f.read_text()) for f in files], wall


def stop_job(out: Path, launcher: subprocess.Popen[bytes]) -> None:
    """Kill every rank of a launched job (each wrote ``out/pid<r>`` as it started) and its
    launcher: what a hang leaves behind (also tests/launched_jobs.py)."""
    for pid_file in out.glob("pid*"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    launcher.kill()


def run(schedule: str, world: int, trials: int, timeout: float, seed: int) -> dict[str, Any]:
    delivered, tried, agreed, same_step, walls, lags = 0, 0, 0, 0, [], []
    for moment in moments(world, seed, fabric=schedule == FABRIC):
        if delivered == trials:
            break
        tried += 1
        with tempfile.TemporaryDirectory(prefix="fault_trial_") as tmp:
            results, wall = trial(Path(tmp), schedule, world, moment, timeout)
        sent = results is None or any(r.get("injected") for r in results)
        ends = None if results is None else [outcome(schedule, moment, r) for r in results]
        print(f"  {schedule} W={world} {moment}: "
              + ("hang" if results is None else
                 " ".join(f"{r['outcome']}@{end[1]}"
                          for r, end in zip(results, ends or [], strict=True)))
              + f" {wall:.1f} s" + ("" if sent else " (not delivered)"), flush=True)
        if not sent:
            continue
        delivered += 1
        walls.append(wall)
        if ends is not None:
            agreed += all(stopped for stopped, _, _ in ends)
            same_step += len({at for _, at, _ in ends}) == 1
            lags += [lag for _, _, lag in ends]
    return dict(schedule=schedule, world=world, delivered=delivered, tried=tried,
                agreed_stop=agreed, same_step=same_step,
                lags=(min(lags, default=0), max(lags, default=0)),
                wall_min=min(walls, default=0.0), wall_max=max(walls, default=0.0))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10, help="delivered trials per config")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per trial")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", choices=[c for c, _ in CONFIGS], default=None)
    args = parser.parse_args(argv)
    rows = [run(schedule, world, args.trials, args.timeout, args.seed)
            for schedule, world in CONFIGS if not args.only or schedule in args.only]
    for row in rows:
        print(f"{row['schedule']} W={row['world']}: delivered {row['delivered']} "
              f"(of {row['tried']} tried), every rank stopped (no hang) {row['agreed_stop']}"
              f"/{row['delivered']}, same stop step {row['same_step']}/{row['delivered']}, "
              f"stop - signalled step {row['lags'][0]}..{row['lags'][1]}, "
              f"wall {row['wall_min']:.1f}-{row['wall_max']:.1f} s")


if __name__ == "__main__":
    main()
