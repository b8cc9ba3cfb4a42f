"""Run every benchmark and print one table: name, ours, anchor, ratio, goal, notes.

    python benchmarks/run.py [--quick] [--json FILE] [--only NAME ...] [--doc docs/benchmarks.md]
                             [--repeat N] [--processes reused|fresh]

Every ratio is ours / anchor, both sides measured in this invocation on this machine with the
same model, data, global batch, dtype and threads (see benchmarks/common.py). ``--doc`` rewrites
the generated part of the results page (between the ``<!-- results -->`` markers) and its plots,
so the page always shows one run's numbers. ``--repeat N`` runs the suite N times and prints
each row's ratio per run with its largest deviation from their median (the reproducibility
check); ``--json`` then writes one list per run, and ``--doc`` shows the first run's table with
the repeat table below it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # `python benchmarks/run.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Result, byte_text, machine_description  # noqa: E402

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _benchmarks() -> dict[str, Callable[[bool], list[Result]]]:
    from benchmarks import (
        bench_auto,
        bench_batch_bytes,
        bench_engine,
        bench_fidelity,
        bench_fsdp,
        bench_lightning,
        bench_memory,
        bench_pipeline,
        bench_planner,
        bench_planner_scale,
        bench_pp_dp,
        bench_process_memory,
        bench_tp,
        bench_tp_messages,
        bench_tune,
    )

    return {
        "ddp_vs_lightning": lambda q: [bench_lightning.ddp_vs_lightning(q)],
        "pipeline_vs_torch": bench_pipeline.run,
        "pipeline_engine_vs_torch": bench_engine.run,
        "fsdp_vs_torch": bench_fsdp.run,
        # W=4 = 2 pipelines x 2 replicas against torch pipelining x DDP / replicate / FSDP2
        # (quick: the 1f1b and shard rows; zb-h1 in the full run)
        "pp_dp_vs_torch": bench_pp_dp.run,
        "single_process_overhead": lambda q: [bench_lightning.single_process_overhead(q)],
        # W=2 as one worker of T=2: GeneralParallel's tensor-parallel stages against Lightning's
        # ModelParallelStrategy with the same plan; time ratio, peak bytes per rank in extra
        "tp_vs_lightning_model_parallel": bench_tp.run,
        # W=4 as P=2 x T=2: one stage-boundary message worker 0 -> worker 1, per TP rank
        # (ours) against once + a broadcast inside worker 1 (anchor); one row per size
        "tp_messages": bench_tp_messages.run,
        "fidelity": bench_fidelity.run,
        "memory": bench_memory.run,
        # the bytes model at P=2 x G=2, W=4, both modes (quick: 1f1b; full: also zb-h1)
        "memory_pp_dp": bench_memory.run_pp_dp,
        # the bytes model with tensor parallelism at P=2 x T=2, W=4 (quick: 1f1b; full: also zbv)
        "memory_tp": bench_memory.run_tp,
        # the same with sequence parallelism (quick and full: 1f1b)
        "memory_sp": bench_memory.run_sp,
        # full run only (several minutes, GiB of RAM): RSS of deferred fits on W=4 processes;
        # large_model also skips itself with less than 16 GiB available
        "memory_process": lambda q: [] if q else bench_process_memory.run_small(q),
        "large_model": lambda q: [] if q else bench_process_memory.run_large(q),
        "fsdp_process_vs_fsdp2": lambda q: [] if q else bench_process_memory.run_vs_fsdp2(q),
        "tune": bench_tune.run,
        # full run only (~20 torch configurations fitted at W=4): GeneralParallel("auto") under
        # a memory budget against the fastest torch option that fits it, W=4 and W=2
        "auto_vs_best_torch": lambda q: [] if q else bench_auto.run(q),
        "planner_speed": bench_planner.run,
        # plan() + one rank's program at W=1024 per library schedule (quick: the symmetric
        # ones), each its own process: seconds, peak MB against < 5 s, < 1 GB
        "planner_scale_1024": bench_planner.run_scale,
        # the same at W=1024 as 16 pipeline ranks x 64 replicas (issue 32; quick: replicate)
        "planner_scale_1024_dp": bench_planner.run_scale_data_parallel,
        # gsched plan at W=1024 (each library schedule) and the W=100,000 answers
        "planner_w1024": bench_planner_scale.run,
        # W=4 as 1f1b 2 x 2: batch bytes each rank receives per step vs the rows it reads
        "batch_bytes_per_rank": bench_batch_bytes.run,
    }


def _fmt_time(seconds: float | None, unit: str = "seconds") -> str:
    if seconds is None:
        return "-"
    if unit == "bytes":
        return byte_text(seconds)
    if seconds < 1e-3:  # a message's time (tp_messages): 0.1 ms steps would hide it
        return f"{seconds * 1e6:.0f} us"
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _cpu_cell(r: Result) -> str:
    if r.ours_cpu_s is None or r.anchor_cpu_s is None or r.cpu_ratio is None:
        return "-"
    if max(r.ours_cpu_s, r.anchor_cpu_s) < 1e-2:  # per message: whole ms would hide it
        return f"{r.cpu_ratio:.3f} ({r.ours_cpu_s * 1e6:.0f}/{r.anchor_cpu_s * 1e6:.0f} us)"
    return f"{r.cpu_ratio:.3f} ({r.ours_cpu_s * 1e3:.0f}/{r.anchor_cpu_s * 1e3:.0f} ms)"


def _spread_cell(r: Result) -> str:
    lo_hi = r.spread
    return "-" if lo_hi is None else f"{lo_hi[0]:.3f}-{lo_hi[1]:.3f}"


def table(results: list[Result], markdown: bool = False) -> str:
    """The results table; ``spread``: min-max of the per-round ratios, ``cpu``: the CPU ratio
    (median over rounds) with both sides' CPU ms per step summed over all ranks."""
    header = ["name", "ours", "anchor", "ratio", "spread", "cpu ratio (ours/anchor)", "goal",
              "notes"]
    rows = [[r.name, _fmt_time(r.ours_s, r.unit), _fmt_time(r.anchor_s, r.unit),
             "-" if r.ratio is None else f"{r.ratio:.3f}", _spread_cell(r), _cpu_cell(r),
             r.goal, r.notes] for r in results]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(header[:-1])]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header[:-1], widths, strict=True)) + "  notes"]
    lines.append("  ".join("-" * w for w in widths) + "  -----")
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True))
                     + "  " + row[-1])
    return "\n".join(lines)


def repeat_table(runs: list[list[Result]], markdown: bool = False) -> str:
    """Each row's ratio in every repeat of the suite, their median and the largest deviation.

    The deviation is max |ratio - median| / median over the repeats: "reproducible within
    ±3%" means this column stays at or below 3%. Rows missing from a repeat (failed) show "-".
    """
    names = list(dict.fromkeys(r.name for run in runs for r in run))
    header = ["name", *(f"run {i + 1}" for i in range(len(runs))), "median", "max dev",
              "spreads"]
    lines = []
    for name in names:
        ratios = [next((r.ratio for r in run if r.name == name), None) for run in runs]
        spreads = [next((_spread_cell(r) for r in run if r.name == name), "-") for run in runs]
        got = [x for x in ratios if x is not None]
        mid = statistics.median(got) if got else None
        dev = max(abs(x - mid) / mid for x in got) if got and mid else None
        lines.append([name, *("-" if x is None else f"{x:.3f}" for x in ratios),
                      "-" if mid is None else f"{mid:.3f}",
                      "-" if dev is None else f"{dev:.1%}", ", ".join(spreads)])
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(out + ["| " + " | ".join(row) + " |" for row in lines])
    widths = [max(len(h), *(len(row[i]) for row in lines)) if lines else len(h)
              for i, h in enumerate(header)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
                     for row in [header, ["-" * w for w in widths], *lines])


def efficiency_rows(results: list[Result]) -> list[dict[str, Any]]:
    """The fidelity rows' ``extra`` (what the efficiency breakdown reads), in table order."""
    return [r.extra for r in results
            if r.name.startswith("fidelity[") and r.extra.get("measured_s") is not None]


def run_all(quick: bool, only: list[str] | None) -> tuple[list[Result], dict[str, float]]:
    results: list[Result] = []
    durations: dict[str, float] = {}
    for name, fn in _benchmarks().items():
        if only and name not in only:
            continue
        start = time.perf_counter()
        print(f"[{name}] running ...", file=sys.stderr, flush=True)
        try:
            results.extend(fn(quick))
        except Exception as exc:  # one broken benchmark must not hide the others' rows
            traceback.print_exc()
            results.append(Result(name, None, None, notes=f"FAILED: {type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0][:200]}"))
        durations[name] = time.perf_counter() - start
        print(f"[{name}] {durations[name]:.0f} s", file=sys.stderr, flush=True)
    return results, durations


def write_doc(path: Path, results: list[Result], extras: dict[str, Any], quick: bool,
              seconds: float, repeat: int = 1) -> None:
    """Replace the generated block of the results page and write its plots next to it."""
    from benchmarks import plots

    img = path.parent / "img"
    img.mkdir(parents=True, exist_ok=True)
    figures = plots.draw_all(results, extras, img)
    stamp = datetime.date.today().isoformat()
    block = [BEGIN, "",
             f"Generated by `python benchmarks/run.py{' --quick' if quick else ''}"
             f"{f' --repeat {repeat}' if repeat > 1 else ''} --doc "
             f"{path.as_posix()}` on {stamp} in {seconds / 60:.1f} min."
             + (f" The table and plots are the first of the {repeat} runs; the repeatability "
                "table below gives every run's ratios." if repeat > 1 else ""),
             "", f"Machine: {machine_description()}. **CPU-only figures** (gloo); no GPU was "
             "used.", "", table(results, markdown=True), ""]
    for title, file in figures:
        block += [f"![{title}](img/{file.name})", ""]
    for key, text in extras.get("markdown", {}).items():
        block += [f"#### {key}", "", text, ""]
    block.append(END)
    text = path.read_text() if path.exists() else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1] if END in rest else ""
    path.write_text(head + "\n".join(block) + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="lightning_gsched benchmarks, side by side")
    parser.add_argument("--quick", action="store_true",
                        help="fewer steps and sizes (what `make bench` runs; < 10 min idle)")
    parser.add_argument("--json", type=Path, help="write the results as a JSON list here")
    parser.add_argument("--only", nargs="*", help="run only these benchmarks (by name)")
    parser.add_argument("--doc", type=Path, help="rewrite this results page's generated block")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the suite this many times; print each row's ratio per run, "
                        "their median and max deviation from it (`make bench-repeat`: 3)")
    parser.add_argument("--processes", choices=("reused", "fresh"),
                        help="how alternated rounds run (benchmarks/rounds.py); default reused")
    args = parser.parse_args(argv)
    if args.processes is not None:
        from benchmarks import rounds

        rounds.PROCESSES = args.processes
    start = time.perf_counter()
    runs: list[list[Result]] = []
    durations: dict[str, float] = {}
    for i in range(max(1, args.repeat)):
        if args.repeat > 1:
            print(f"[repeat {i + 1}/{args.repeat}]", file=sys.stderr, flush=True)
        results, durations = run_all(args.quick, args.only)
        runs.append(results)
    results = runs[0]
    extras: dict[str, Any] = {"markdown": {}}
    fidelity = efficiency_rows(results)
    if fidelity:
        from benchmarks import efficiency

        extras["markdown"]["Efficiency: where the rest of the step goes"] = (
            efficiency.markdown(fidelity))
    from benchmarks import bench_pp_dp

    pp_dp = bench_pp_dp.markdown(results)  # the 2 x 2 rows, every rank
    if pp_dp:
        extras["markdown"]["Pipelines x data parallel (W=4 = 2 x 2): every rank"] = pp_dp
    if len(runs) > 1:
        extras["markdown"][f"Repeatability: {len(runs)} runs of the suite"] = (
            repeat_table(runs, markdown=True))
    if args.doc is not None:
        from benchmarks import bench_fidelity, bench_planner

        print("[plots] microbatch sweep ...", file=sys.stderr, flush=True)
        extras["sweep"] = bench_fidelity.microbatch_sweep(args.quick)
        planner = next((r for r in results if r.name == "planner_speed"), None)
        if planner is not None and planner.extra.get("per_schedule"):
            extras["markdown"]["Planner time per library schedule"] = (
                bench_planner.per_schedule_markdown(planner.extra["per_schedule"]))
        scale = next((r for r in results if r.name == "planner_scale_1024"), None)
        if scale is not None and scale.extra.get("per_schedule"):
            extras["markdown"]["plan() and one rank's program at W=1024 per library schedule"] = (
                bench_planner.scale_markdown(scale.extra["per_schedule"]))
        scale_dp = next((r for r in results if r.name == "planner_scale_1024_dp"), None)
        if scale_dp is not None and scale_dp.extra.get("per_schedule"):
            extras["markdown"]["plan() and one rank's program at W=1024 as 16 x 64"] = (
                bench_planner.scale_markdown(scale_dp.extra["per_schedule"]))
        large = next((r for r in results if r.name == "planner_w1024"), None)
        if large is not None:
            from benchmarks import bench_planner_scale

            extras["markdown"]["gsched plan at W=1024 and W=100,000"] = (
                bench_planner_scale.markdown(large.extra["w1024"] + large.extra["w100000"]))
        scaling = planner.extra.get("scaling") if planner is not None else None
        if scaling:
            extras["scaling"] = scaling
            extras["markdown"]["Planner time as W, S, B grow"] = bench_planner.scaling_markdown(scaling)
    seconds = time.perf_counter() - start
    print(table(results))
    if fidelity:
        from benchmarks import efficiency

        print("\nefficiency: where the rest of the step goes (shares of the measured "
              "executor.step; see benchmarks/efficiency.py)")
        print(efficiency.text(fidelity))
    if len(runs) > 1:
        print(f"\nrepeatability over {len(runs)} runs (max dev: largest |ratio - median| / "
              "median)")
        print(repeat_table(runs))
    print(f"\n{machine_description()}; total {seconds:.0f} s "
          + ", ".join(f"{k} {v:.0f} s" for k, v in durations.items())
          + (f" (last of {len(runs)} runs)" if len(runs) > 1 else ""))
    if args.json is not None:
        payload: Any = [r.as_json() for r in results]
        if len(runs) > 1:
            payload = [[r.as_json() for r in run] for run in runs]
        args.json.write_text(json.dumps(payload, indent=1))
    if args.doc is not None:
        write_doc(args.doc, results, extras, args.quick, seconds, len(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
