"""planner_w1024: ``gsched plan NAME -w 1024`` for every library schedule (its default S, B,
R), and the W=100,000 answers, each timed as a user runs it.

Issue 26's goals: every library schedule at W=1024 with its default B plans in < 5 s and
< 1 GB; ``gsched plan`` at W=100,000 answers (a plan or a reason) in < 10 s. Each row is one
``python -m lightning_gsched.cli plan ...`` process (printing included, output discarded):
its wall seconds and its own peak resident set (its VmHWM at exit, the figure
``/usr/bin/time -f %M`` prints: see :data:`WRAPPER`), stopped at a timeout, which the row
then reports. Every run times all eleven schedules (the pipelines' 4-12 million jobs plan in
seconds by their sweep, schedule/sweep.py) and the W=100,000 answers. What one rank does at
start-up (``plan()`` and its own program, no printing) is the ``planner_scale_1024`` row
(bench_planner.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import Result
from lightning_gsched.schedule.library import LIBRARY

GOAL_S, GOAL_KB, ANSWER_S = 5.0, 1 << 20, 10.0
LARGE = (("1f1b", ["-w", "100000", "-b", "1"]), ("fsdp", ["-w", "100000"]),
         ("ddp", ["-w", "100000"]))


# The child's peak RSS is its own high-water mark (/proc/self/status VmHWM, written to stderr
# at exit by WRAPPER), not os.wait4's ru_maxrss: Linux carries the spawning process's
# high-water mark into the child across exec, so every row read at least the runner's RSS
# (600 MB in a run.py run, where a plan of 80 MB was measured by /usr/bin/time).
PEAK_MARK = "gsched-bench-peak-kb:"
WRAPPER = f"""
import atexit, runpy, sys

def _peak():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                sys.stderr.write("\\n{PEAK_MARK}" + line.split()[1] + "\\n")

atexit.register(_peak)
mode, target, *rest = sys.argv[1:]
if mode == "-m":
    sys.argv = [target, *rest]
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    sys.argv = ["-c", *rest]
    exec(compile(target, "<string>", "exec"), {{"__name__": "__main__"}})
"""


def _status_hwm(pid: int) -> int | None:
    """A running process's VmHWM (KB), None once it has exited or where /proc has none."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _own_peak(error: str) -> tuple[str, int | None]:
    """stderr without WRAPPER's line, and the peak (KB) that line reports (None: not reached,
    e.g. a process stopped at its timeout)."""
    kept, peak = [], None
    for line in error.splitlines():
        if line.startswith(PEAK_MARK):
            peak = int(line[len(PEAK_MARK):])
        else:
            kept.append(line)
    return "\n".join(kept).strip(), peak


def time_command(args: list[str], timeout: float, command: list[str] | None = None,
                 capture: bool = False) -> dict[str, Any]:
    """Wall seconds, peak RSS (KB) and exit status of ``gsched plan ARGS`` (or ``command``:
    ``[python, "-m" or "-c", ...]``) in its own process; ``timed_out`` when it ran past
    ``timeout`` (then stopped: its peak is the last one read while it ran, a lower bound).
    ``capture``: its stdout in ``output`` and stderr in ``stderr`` (a few lines at most: the
    pipes are read after it exits), else stdout is discarded."""
    if command is None:
        command = [sys.executable, "-m", "lightning_gsched.cli", "plan", *args]
    start = time.perf_counter()
    process = subprocess.Popen([command[0], "-c", WRAPPER, *command[1:]],
                               stderr=subprocess.PIPE,
                               stdout=subprocess.PIPE if capture else subprocess.DEVNULL)
    timed_out, seen = False, None
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            break
        seen = _status_hwm(process.pid) or seen
        if time.perf_counter() - start > timeout:
            process.kill()
            pid, status, usage = os.wait4(process.pid, 0)
            timed_out = True
            break
        time.sleep(0.02)
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    error, peak = _own_peak(process.stderr.read().decode() if process.stderr else "")
    output = process.stdout.read().decode() if process.stdout else ""
    return {"args": " ".join(args), "seconds": round(time.perf_counter() - start, 2),
            "peak_kb": peak or seen or usage.ru_maxrss, "exit": process.returncode,
            "timed_out": timed_out,
            "answer": "plan" if process.returncode == 0 else error[:160],
            **({"output": output, "stderr": error} if capture else {})}


def run(quick: bool) -> list[Result]:
    timeout = 60.0 if quick else 300.0
    rows = [{"schedule": name, **time_command([name, "-w", "1024"], timeout)} for name in LIBRARY]
    large = [{"schedule": name, **time_command([name, *args], 2 * ANSWER_S)}
             for name, args in LARGE]
    met = [r["schedule"] for r in rows
           if not r["timed_out"] and r["seconds"] < GOAL_S and r["peak_kb"] < GOAL_KB]
    slowest = max(rows, key=lambda r: r["seconds"])
    answered = all(not r["timed_out"] and r["seconds"] < ANSWER_S for r in large)
    notes = (f"gsched plan NAME -w 1024 (default S, B, R) for {len(rows)} schedules: within "
             f"< 5 s and < 1 GB: {', '.join(met) or 'none'}; slowest {slowest['schedule']} "
             f"{slowest['seconds']} s, {slowest['peak_kb'] // 1024} MB"
             + (" (timed out)" if slowest["timed_out"] else "")
             + f"; W=100,000 answers < {ANSWER_S:g} s: {'all' if answered else 'not all'}")
    return [Result("planner_w1024", slowest["seconds"], GOAL_S, goal="< 5 s, < 1 GB",
                   notes=notes, extra={"w1024": rows, "w100000": large})]


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a table: command, seconds, peak MB, answer."""
    lines = ["| gsched plan | seconds | peak MB | answer |", "|---|---:|---:|---|"]
    for r in rows:
        seconds = f"> {r['seconds']}" if r["timed_out"] else f"{r['seconds']}"
        answer = "timed out" if r["timed_out"] else r["answer"].replace("|", "/")
        lines.append(f"| {r['args']} | {seconds} | {r['peak_kb'] // 1024} | {answer} |")
    return "\n".join(lines)


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    for result in run(quick):
        print(result.notes)
        print(markdown(result.extra["w1024"] + result.extra["w100000"]))
