"""``memory[<schedule>]``: does the planner predict the bytes a rank holds?

For every library schedule, the benchmark GPT (:mod:`benchmarks.model`) trains a few steps with
``GeneralParallel(schedule)`` on W=2 processes (SGD with momentum: one state buffer per
parameter). The engine sizes the stages on the first microbatch and predicts every rank's peak
bytes from the training programs (``schedule/memory.py``); during the second step (the
optimizer state exists by then) the runtime accounts for every tensor it holds, after every
action (``runtime/footprint.py``). The row's ratio is measured / predicted of the rank with the
largest |ratio - 1|; the goal is within ±10%.

Measured here means the runtime's accounting of its own tensors (stage weight and gradient
buffers, saved activations, posted receive buffers, the optimizer's state), not the process's
resident memory: the allocator, Python objects and the loss's temporaries are outside both
sides. On CUDA the engine also reports ``torch.cuda.max_memory_allocated``.

    python -m benchmarks.bench_memory [--schedules 1f1b zbv]
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.common import Result, launch
from lightning_gsched.schedule.library import LIBRARY

WORLD = 2
PER_RANK = 8
STEPS = 3


def memory_run(rank: int, world: int, schedules: list[str], steps: int,
               per_rank: int) -> dict[str, Any]:
    """One fit per schedule in these processes; every rank's predicted and measured peaks."""
    from benchmarks.lit_runs import run_fit
    from benchmarks.model import GPTShape
    from lightning_gsched import GeneralParallel

    out = {}
    for schedule in schedules:
        strategy = GeneralParallel(schedule, microbatches=2 * world)
        run_fit(strategy, rank, world, steps, per_rank, GPTShape(), [])
        report = strategy.memory_report
        if report is None or report.predicted is None or report.measured is None:
            raise RuntimeError(f"no memory report for {schedule}: "
                               f"{getattr(report, 'unavailable', None)}")
        # categories: each one's own peak; totals: the peak of the sum (both sides alike)
        out[schedule] = {
            "predicted": [{**m.category_peaks.as_dict(), "total": m.peak}
                          for m in report.predicted],
            "measured": report.measured}
    return out


def _row(schedule: str, r: dict[str, Any]) -> Result:
    ratios = [m["total"] / p["total"] for p, m in zip(r["predicted"], r["measured"], strict=True)]
    worst = max(range(len(ratios)), key=lambda i: abs(ratios[i] - 1))
    predicted, measured = r["predicted"][worst], r["measured"][worst]
    mib = 1024 * 1024
    split = ", ".join(f"{k} {measured[k] / mib:.2f}/{predicted[k] / mib:.2f}"  # own peaks
                      for k in ("weights", "gradients", "optimizer", "activations",
                                "communication"))
    return Result(
        name=f"memory[{schedule}]", ours_s=measured["total"], anchor_s=predicted["total"],
        goal="within ±10%", unit="bytes",
        notes=(f"measured/predicted peak bytes, rank {worst} (ratios per rank "
               f"{', '.join(f'{x:.3f}' for x in ratios)}); MiB measured/predicted: {split}"),
        extra=r)


def run(quick: bool, schedules: list[str] | None = None) -> list[Result]:
    names = schedules or list(LIBRARY)
    runs = launch("benchmarks.bench_memory:memory_run", WORLD, schedules=names, steps=STEPS,
                  per_rank=PER_RANK)
    return [_row(schedule, runs[schedule]) for schedule in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="*")
    args = parser.parse_args()
    for r in run(True, args.schedules):
        print(f"{r.name:22s} measured {r.ours_s / 2**20:7.2f} MiB  predicted "
              f"{r.anchor_s / 2**20:7.2f} MiB  ratio {r.ratio:.3f}  {r.notes}")


if __name__ == "__main__":
    main()
