"""planner_speed: how long ``plan()`` takes at W=64, S=64, B=256 for every library schedule, and
how that grows to W=256.

The issue's goal: "planner_speed < 1 s for every library schedule at W=64, S=64, B=256 on this
machine, with the scaling table extended to W=256 (jobs 524,288) showing near-linear growth".
What is timed is the full ``plan()`` call exactly as a user (the CLI, the Lightning strategy)
makes it: argument checks, placement table, priorities, activation cap (``cap='auto'`` runs
several whole simulations), simulation, lowering, the verifying dry run (``verify=True``, the
default, which the strategy uses) and the metrics. The per-phase split in ``extra["phases"]``
shows what each part costs.

Phases are timed inside the real call: the names ``plan._build`` looks up (``PlacementTable``,
``priority_ranks``, ``auto_cap_timeline``, ``simulate``, ``lower``, ``dry_run``, ``measure``) are
wrapped for the duration of the measurement, so the split can never drift from what ``plan()``
does. A phase called from inside another (the cap bisection runs ``simulate`` several times)
counts towards the outer one; "other" is the rest of the call (argument resolution, freeing the
previous plan, the garbage collector's one pass over the new objects when it is re-enabled).

Every schedule of the library is planned at the headline size with its default R (what a user
gets without choosing one) and at S=64, or at the nearest S its placement accepts (zbv's V needs
S = 2W = 128, so it plans 3 x 128 x 256 = 98,304 jobs where 1f1b plans 32,768); the row
reports the slowest one, and the per-schedule table lists them all. Jobs are S x B x phases
(F, B; and W for the split-backward zero-bubble schedules). The scaling table grows W with S=W
and B=4W up to W=256 (524,288 jobs; in the quick run too, measured once), then B at W=S=16;
it prints wall seconds and CPU microseconds per job, which stay flat when growth is linear.

Times are medians over a few repeats. Wall time is what the goal is about; CPU time of this
process (``time.process_time``) is recorded beside it because the machine is shared: when other
processes compete for the cores, wall time grows and CPU time much less.

The second row, ``planner_scale_1024`` (:func:`run_scale`), is issue 26's goal for one rank at
scale: every library schedule at W=1024 with its default S, B, R plans in < 5 s and < 1 GB.
Each schedule runs in a fresh process (so its peak RSS, ``os.wait4``'s ``ru_maxrss``, is that
plan's alone): ``plan(name, workers=1024)`` and then ONE rank's program (``ranks[W // 2]``,
what a rank of a running job lowers: lazy plans lower nothing else), each timed there; a
schedule past its timeout is stopped and recorded as timed out. The quick run times the
schedules that plan by symmetry (seconds each); the full run all of them (the pipelines
simulate 4-12 million jobs: minutes, at the time of writing).

Run ``python -m benchmarks.bench_planner [--quick] [--plot PATH] [--scale]``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

from benchmarks.bench_planner_scale import time_command
from benchmarks.common import Result, median
from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule.library import LIBRARY
from lightning_gsched.schedule.plan import plan

# the module, not the function the package re-exports under the same name
_PLAN_MODULE = importlib.import_module("lightning_gsched.schedule.plan")

_SYMMETRY_MODULE = importlib.import_module("lightning_gsched.schedule.symmetry")

HEADLINE = {"W": 64, "S": 64, "B": 256}
GOAL_S = 1.0
# label -> (module, name) looked up at call time by plan._build and by the simulator it makes
# (symmetry.make_simulator: the priorities and the simulation, by symmetry or in full)
PHASES = {
    "placement_table": ((_PLAN_MODULE, "PlacementTable"),),
    # ranks for a simulation job by job, or the keys of a pipeline's sweep (sweep.py)
    "priorities": ((_SYMMETRY_MODULE, "priority_ranks"), (_SYMMETRY_MODULE, "order_keys")),
    # the bisection, including the chosen cap's simulation
    "auto_cap": ((_PLAN_MODULE, "auto_cap_timeline"),),
    "simulate": ((_SYMMETRY_MODULE, "simulate"), (_SYMMETRY_MODULE, "simulate_sweep")),
    "lower": ((_PLAN_MODULE, "lower"),),
    "dry_run": ((_PLAN_MODULE, "dry_run"),),
    "measure": ((_PLAN_MODULE, "measure"),),
}
SCALING_SCHEDULES = ("fslpp", "1f1b")


def phases_of(schedule: str) -> int:
    """Jobs per (stage, microbatch): F and B, plus W when the schedule splits the backward."""
    return 3 if LIBRARY[schedule].split_backward else 2


def jobs_of(S: int, B: int, phases: int = 2) -> int:
    """Jobs the simulator places: one per (stage, microbatch, phase)."""
    return phases * S * B


def headline_stages(schedule: str, W: int, S: int, B: int) -> int:
    """``S``, or the nearest larger stage count the schedule's placement accepts at W and B."""
    spec = LIBRARY[schedule]
    for candidate in (S, 2 * S, 4 * S):
        R = spec.default_R(W) if spec.default_R is not None else 1
        try:
            spec.make_placement(W, candidate, R).check(candidate, B)
        except ScheduleConfigError:
            continue
        return candidate
    return S


@contextmanager
def phase_timers() -> Iterator[tuple[dict[str, float], dict[str, int]]]:
    """Wrap the phases ``plan._build`` calls.

    Yields ({phase: seconds}, {phase: calls}), filled in as they run; calls count nested ones too
    (``calls["simulate"]`` is the number of simulations, those of the cap bisection included).
    """
    times: dict[str, float] = {label: 0.0 for label in PHASES}
    calls: dict[str, int] = {label: 0 for label in PHASES}
    depth = [0]
    originals = {(module, name): getattr(module, name)
                 for targets in PHASES.values() for module, name in targets}

    def wrap(label: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            calls[label] += 1
            if depth[0]:  # nested (simulate inside auto_cap): counted by the outer phase
                return fn(*args, **kwargs)
            depth[0] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[label] += time.perf_counter() - start
                depth[0] -= 1

        return timed

    try:
        for label, targets in PHASES.items():
            for module, name in targets:
                setattr(module, name, wrap(label, originals[(module, name)]))
        yield times, calls
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)


def time_plan(schedule: str, W: int, S: int, B: int, repeats: int,
              R: int | None = None) -> dict[str, Any]:
    """Median wall and CPU seconds of ``plan(schedule, ...)``, and the median of each phase.

    ``{"valid": False, "error": ...}`` when the library rejects the size for this schedule.
    """
    walls: list[float] = []
    cpus: list[float] = []
    phases: list[dict[str, float]] = []
    simulations = 0
    for _ in range(repeats):
        gc.collect()  # start every repeat from the same heap, not the previous plan's garbage
        with phase_timers() as (times, calls):
            wall0, cpu0 = time.perf_counter(), time.process_time()
            try:
                result = plan(schedule, workers=W, stages=S, microbatches=B, R=R)
            except ScheduleConfigError as exc:
                return {"schedule": schedule, "W": W, "S": S, "B": B, "valid": False,
                        "error": str(exc)}
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        walls.append(wall)
        cpus.append(cpu)
        times = dict(times)
        times["other"] = max(0.0, wall - sum(times.values()))
        phases.append(times)
        simulations = calls["simulate"]
        del result  # free its 10^5 objects outside the timed region
    phase_medians = {label: median([p[label] for p in phases]) for label in phases[0]}
    jobs = jobs_of(S, B, phases_of(schedule))
    return {
        "schedule": schedule, "W": W, "S": S, "B": B, "valid": True, "jobs": jobs,
        "cpu_us_per_job": round(1e6 * median(cpus) / jobs, 2),
        "seconds": median(walls), "cpu_seconds": median(cpus), "repeats": repeats,
        "min_seconds": min(walls), "samples": [round(w, 4) for w in walls],
        "phases": {k: round(v, 4) for k, v in phase_medians.items()},
        "simulations": simulations,
    }


def _warm_up() -> None:
    """Import everything and run each code path once at a tiny size."""
    for name in LIBRARY:
        try:
            plan(name, workers=4, stages=4, microbatches=8)
        except ScheduleConfigError:
            pass


def _repeats(jobs: int, quick: bool) -> int:
    """Fewer repeats for big sizes: about a second of planning per point in full mode."""
    if quick:
        return 1 if jobs >= 8192 else 3
    if jobs >= 65536:
        return 1
    if jobs >= 16384:
        return 2
    if jobs >= 4096:
        return 3
    return 5


def scaling_points(quick: bool) -> list[tuple[str, str, int, int, int]]:
    """(series, schedule, W, S, B): W grows with S=W, B=4W; then B grows at W=S=16.

    The W=64 point of the first series is the headline size (measured there, not again). The
    quick run goes to W=256 too (524,288 jobs: about 11 s of planning for both schedules, once
    each), so every ``make bench`` shows whether the growth stays linear.
    """
    points = []
    for W in (8, 16, 32, 64, 128, 256):
        for name in SCALING_SCHEDULES:
            points.append(("W", name, W, W, 4 * W))
    for B in ((16, 64, 256) if quick else (16, 64, 256, 1024)):
        for name in SCALING_SCHEDULES:
            points.append(("B", name, 16, 16, B))
    return points


def run(quick: bool) -> list[Result]:
    _warm_up()
    W, S, B = HEADLINE["W"], HEADLINE["S"], HEADLINE["B"]
    headline_repeats = 1 if quick else 3
    per_schedule: dict[str, dict[str, Any]] = {}
    for name in LIBRARY:
        per_schedule[name] = time_plan(name, W, headline_stages(name, W, S, B), B,
                                       headline_repeats)
    valid = {n: r for n, r in per_schedule.items() if r["valid"]}
    slowest = max(valid, key=lambda n: valid[n]["seconds"])
    worst = valid[slowest]

    rows: list[dict[str, Any]] = []
    for series, name, w, s, b in scaling_points(quick):
        if (w, s, b) == (W, S, B):
            timed = per_schedule[name]
        else:
            timed = time_plan(name, w, s, b, _repeats(jobs_of(s, b), quick))
        if not timed["valid"]:
            continue
        rows.append({"series": series, "schedule": name, "W": w, "S": s, "B": b,
                     "seconds": round(timed["seconds"], 4),
                     "cpu_seconds": round(timed["cpu_seconds"], 4), "jobs": timed["jobs"],
                     "cpu_us_per_job": timed["cpu_us_per_job"], "repeats": timed["repeats"]})

    met = worst["seconds"] < GOAL_S
    missed = [n for n, r in valid.items() if r["seconds"] >= GOAL_S]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    cap_part = (f" (cap='auto' phase {worst['phases']['auto_cap']:.2f} s wall: "
                f"{worst['simulations']} simulations)" if worst["phases"]["auto_cap"] else "")
    at_headline = [r["seconds"] for r in valid.values() if r["S"] == S]
    notes = (
        f"full plan() (verify=True: dry run and metrics included), default R, W={W}, B={B}, "
        f"S={S} or the nearest valid; slowest of {len(valid)} library schedules: {slowest} "
        f"(S={worst['S']}, {worst['jobs']} jobs) {worst['seconds']:.2f} s wall / "
        f"{worst['cpu_seconds']:.2f} s CPU{cap_part}"
        + (f"; at S={S}: {min(at_headline):.2f}-{max(at_headline):.2f} s" if at_headline else "")
        + (f"; at or over 1 s: {', '.join(missed)}" if missed else "")
        + f"; median of {headline_repeats}"
        + (f"; load average {load:.1f} on {os.cpu_count()} cores" if load is not None else "")
        + f"; goal {'met' if met else 'missed'}"
    )
    extra = {
        "schedule": slowest,
        "cpu_s": round(worst["cpu_seconds"], 4),
        "includes": "argument checks, placement table, priorities, cap (auto: bisection over "
                    "whole simulations), simulate, lower, dry_run (verification), measure "
                    "(metrics)",
        "phases": worst["phases"],
        "simulations": worst["simulations"],
        "per_schedule": per_schedule,
        "load_average": load,
        "scaling": rows,
    }
    return [Result("planner_speed", round(worst["seconds"], 4), GOAL_S, goal="< 1 s",
                   notes=notes, extra=extra)]


def per_schedule_markdown(per_schedule: dict[str, dict[str, Any]]) -> str:
    """One line per library schedule at the headline size: wall and CPU time, CPU time per job
    (comparable across schedules of different job counts) and the phases (wall)."""
    labels = list(PHASES) + ["other"]
    head = ("| schedule | S | jobs | wall (s) | CPU (s) | CPU us/job | simulations | "
            + " | ".join(labels) + " |")
    lines = [head, "|" + "---|" * (7 + len(labels))]
    for name, r in per_schedule.items():
        if not r["valid"]:
            continue
        lines.append(f"| {name} | {r['S']} | {r['jobs']} | {r['seconds']:.3f} | "
                     f"{r['cpu_seconds']:.3f} | {r['cpu_us_per_job']:.1f} | {r['simulations']} | "
                     + " | ".join(f"{r['phases'][k]:.3f}" for k in labels) + " |")
    return "\n".join(lines)


def scaling_markdown(rows: list[dict[str, Any]]) -> str:
    """The scaling table as markdown: one line per (series, W, S, B), per schedule its wall
    seconds and CPU microseconds per job (flat when the growth is linear; CPU time because a
    shared machine stretches wall time by whatever else runs)."""
    schedules = list(dict.fromkeys(r["schedule"] for r in rows))
    sizes = list(dict.fromkeys((r.get("series", ""), r["W"], r["S"], r["B"]) for r in rows))
    cell = {(r.get("series", ""), r["W"], r["S"], r["B"], r["schedule"]): r for r in rows}
    head = ("| grows | W | S | B | jobs (F+B) | "
            + " | ".join(f"{n} wall (s) | {n} CPU (us/job)" for n in schedules) + " |")
    lines = [head, "|" + "---|" * (5 + 2 * len(schedules))]
    for series, W, S, B in sizes:
        values = []
        for name in schedules:
            r = cell.get((series, W, S, B, name))
            values.append(f"{r['seconds']:.3f} | {1e6 * r['cpu_seconds'] / r['jobs']:.1f}" if r
                          else "- | -")
        label = {"W": "W (S=W, B=4W)", "B": "B (W=S=16)"}.get(series, series)
        lines.append(f"| {label} | {W} | {S} | {B} | {jobs_of(S, B)} | " + " | ".join(values)
                     + " |")
    return "\n".join(lines)


def plot_scaling(rows: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """Planner time against jobs (2*S*B), log-log, one line per schedule and series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["schedule"], r.get("series", "")), []).append(r)
    colours = {}
    for (name, series), points in groups.items():
        points.sort(key=lambda r: r["jobs"])
        colour = colours.setdefault(name, f"C{len(colours)}")
        label = name + {"W": " (W grows, S=W, B=4W)", "B": " (B grows, W=S=16)"}.get(series, "")
        ax.plot([r["jobs"] for r in points], [r["seconds"] for r in points], color=colour,
                marker="o" if series != "B" else "s", linestyle="-" if series != "B" else "--",
                label=label)
    ax.axhline(GOAL_S, color="grey", linewidth=0.8, linestyle=":")
    ax.axvline(jobs_of(HEADLINE["S"], HEADLINE["B"]), color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("jobs (S x B x phases)")
    ax.set_ylabel("plan() wall time (s)")
    ax.set_title("Planner time (simulate, lower, verify, measure)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", linewidth=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ planner_scale_1024

SCALE_W = 1024
SCALE_GOAL_S, SCALE_GOAL_MB = 5.0, 1024  # the "< 5 s and < 1 GB"
SCALE_TIMEOUT_S = 150.0  # per schedule: a pipeline past it is recorded as timed out
# the child: plan() and one rank's program, each timed there; one JSON line on stdout
SCALE_CODE = """
import json, sys, time
from lightning_gsched.schedule import plan
name, W, G, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
start = time.perf_counter()
result = plan(name, workers=W, data_parallel_size=G, data_parallel=mode)
planned = time.perf_counter()
program = result.programs.ranks[W // 2]
lowered = time.perf_counter()
print(json.dumps({"plan_s": planned - start, "rank_s": lowered - planned, "S": result.stages,
                  "B": result.micro, "R": result.R, "jobs": len(result.timeline.start),
                  "rank_actions": len(program)}))
"""


def measure_scale(name: str, W: int = SCALE_W, timeout: float = SCALE_TIMEOUT_S,
                  replicas: int = 1, mode: str = "replicate") -> dict[str, Any]:
    """One schedule's row: ``plan(name, workers=W)`` and rank ``W // 2``'s program in a fresh
    process; its seconds (plan + rank, timed in the child; ``process_s``: the whole process,
    interpreter start included), peak MB (the child's ``ru_maxrss``), jobs, and ``passed``
    against :data:`SCALE_GOAL_S` / :data:`SCALE_GOAL_MB` (False when timed out or failed).
    ``replicas``/``mode``: the plan's ``data_parallel_size`` and ``data_parallel``."""
    run = time_command([name, "-w", str(W), "--dp", str(replicas)], timeout,
                       [sys.executable, "-c", SCALE_CODE, name, str(W), str(replicas), mode],
                       capture=True)
    label = name if replicas == 1 else f"{name} {W // replicas}x{replicas} {mode}"
    row: dict[str, Any] = {"schedule": label, "W": W, "process_s": run["seconds"],
                           "peak_mb": round(run["peak_kb"] / 1024, 1),
                           "timed_out": run["timed_out"], "exit": run["exit"]}
    if run["timed_out"] or run["exit"] != 0:
        last = (run["stderr"].strip().splitlines() or ["no output"])[-1]  # the exception
        reason = f"timed out after {timeout:g} s" if run["timed_out"] else last[:200]
        return {**row, "seconds": None, "passed": False, "error": reason}
    child = json.loads(run["output"].strip().splitlines()[-1])
    # the row's total is the sum of the parts it shows (rounding each, then the sum: a sum of
    # unrounded parts could read 0.002 beside parts of 0.001 and 0.000)
    plan_s, rank_s = round(child["plan_s"], 3), round(child["rank_s"], 3)
    seconds = round(plan_s + rank_s, 3)
    passed = seconds < SCALE_GOAL_S and row["peak_mb"] < SCALE_GOAL_MB
    return {**row, **child, "plan_s": plan_s, "rank_s": rank_s, "seconds": seconds,
            "passed": passed}


def run_scale(quick: bool) -> list[Result]:
    """The ``planner_scale_1024`` row: :func:`measure_scale` for every library schedule (the
    quick run too: seconds each); ours is the slowest completed schedule's seconds, against 5 s."""
    rows = [measure_scale(name) for name in LIBRARY]
    done = [r for r in rows if r["seconds"] is not None]
    slowest = max(done, key=lambda r: r["seconds"]) if done else None
    passed = [r["schedule"] for r in rows if r["passed"]]
    missed = [f"{r['schedule']} ({r.get('error') or _scale_cell(r)})" for r in rows
              if not r["passed"]]
    notes = (f"plan(NAME, workers={SCALE_W}) (default S, B, R; verify=True) + rank "
             f"{SCALE_W // 2}'s program, each schedule its own process; within < "
             f"{SCALE_GOAL_S:g} s and < 1 GB: {', '.join(passed) or 'none'}"
             + (f"; not: {', '.join(missed)}" if missed else "")
             + (f"; slowest {slowest['schedule']} {_scale_cell(slowest)}" if slowest else ""))
    return [Result("planner_scale_1024", slowest["seconds"] if slowest else None,
                   SCALE_GOAL_S, goal="< 5 s, < 1 GB", notes=notes,
                   extra={"W": SCALE_W, "timeout_s": SCALE_TIMEOUT_S, "per_schedule": rows})]


SCALE_REPLICAS = 64  # W=1024 as P=16 pipeline ranks x G=64 replicas (issue 32's "Scale")


def run_scale_data_parallel(quick: bool) -> list[Result]:
    """The ``planner_scale_1024_dp`` row: every library pipeline at W=1024 as P=16 x G=64
    (``replicate``; the full run adds ``shard``), :func:`measure_scale` each, against 5 s and
    1 GB. One replica is planned and renamed (schedule/data_parallel.py), so a plan costs one
    16-worker plan plus the renaming and the proof, and each rank lowers only its program."""
    from lightning_gsched.schedule.data_parallel import takes_data_parallel

    modes = ("replicate",) if quick else ("replicate", "shard")
    rows = [measure_scale(name, replicas=SCALE_REPLICAS, mode=mode)
            for mode in modes for name in takes_data_parallel()]
    goal_rows = [r for r in rows if r["schedule"].endswith("replicate")]
    done = [r for r in goal_rows if r["seconds"] is not None]
    slowest = max(done, key=lambda r: r["seconds"]) if done else None
    missed = [f"{r['schedule']} ({r.get('error') or _scale_cell(r)})" for r in rows
              if not r["passed"]]
    notes = (f"plan(NAME, workers={SCALE_W}, data_parallel_size={SCALE_REPLICAS}) + rank "
             f"{SCALE_W // 2}'s program, each its own process; goal on replicate rows"
             + (f"; not within < {SCALE_GOAL_S:g} s and < 1 GB: {', '.join(missed)}"
                if missed else "; every row within < 5 s and < 1 GB")
             + (f"; slowest replicate {slowest['schedule']} {_scale_cell(slowest)}"
                if slowest else ""))
    return [Result("planner_scale_1024_dp", slowest["seconds"] if slowest else None,
                   SCALE_GOAL_S, goal="< 5 s, < 1 GB", notes=notes,
                   extra={"W": SCALE_W, "timeout_s": SCALE_TIMEOUT_S, "per_schedule": rows})]


def _scale_cell(row: dict[str, Any]) -> str:
    return f"{row['seconds']} s, {row['peak_mb']:.0f} MB"


def scale_markdown(rows: list[dict[str, Any]]) -> str:
    """The per-schedule table of ``planner_scale_1024``: S, B, R, jobs, plan and one-rank
    seconds, peak MB and whether the schedule meets the goal."""
    lines = ["| schedule | S | B | R | jobs | plan (s) | one rank (s) | total (s) | process (s) "
             "| peak MB | < 5 s, < 1 GB |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["seconds"] is None:
            lines.append(f"| {r['schedule']} | | | | | | | | {r['process_s']} | "
                         f"{r['peak_mb']:.0f} | no: {str(r['error']).replace('|', '/')} |")
            continue
        lines.append(f"| {r['schedule']} | {r['S']} | {r['B']} | {r['R'] or '-'} | {r['jobs']} "
                     f"| {r['plan_s']} | {r['rank_s']} | {r['seconds']} | {r['process_s']} | "
                     f"{r['peak_mb']:.0f} | {'yes' if r['passed'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats (~30 s)")
    parser.add_argument("--plot", metavar="PATH", help="also draw the scaling plot (PNG)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--scale", action="store_true",
                        help=f"the planner_scale_1024 row instead (W={SCALE_W}, a process each)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.scale:
        scale = run_scale(args.quick)[0]
        print(json.dumps(scale.as_json(), indent=1) if args.json else scale.notes)
        print(scale_markdown(scale.extra["per_schedule"]))
        print(f"\n(benchmark took {time.perf_counter() - start:.1f} s)")
        return
    results = run(args.quick)
    for res in results:
        if args.json:
            print(json.dumps(res.as_json(), indent=1))
        else:
            print(f"{res.name}: ours {res.ours_s:.3f} s, anchor {res.anchor_s:.3f} s, "
                  f"ratio {res.ratio:.2f}, goal {res.goal}")
            print(f"  {res.notes}")
            print(f"  phases ({res.extra['schedule']}): {res.extra['phases']}")
        print()
        print(per_schedule_markdown(res.extra["per_schedule"]))
        print()
        print(scaling_markdown(res.extra["scaling"]))
        if args.plot:
            plot_scaling(res.extra["scaling"], args.plot)
            print(f"\nplot written to {args.plot}")
    print(f"\n(benchmark took {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
