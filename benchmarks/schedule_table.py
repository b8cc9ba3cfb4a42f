"""Every library schedule planned with unit costs and with profiled stage costs, as markdown.

    python -m benchmarks.schedule_table [--layers 16] [--rows 2] [--repeats 5]

Why: the table of docs/schedules.md compares the schedules on the planner's unit model (a stage
costs forward W/S, backward 2W/S, split evenly between B and W). Real stages are not uniform (the
first stage's backward has no input gradient to compute, the last one carries the vocabulary
projection and the loss) and B and W are not halves, so the same comparison with measured
costs says how much of the unit-cost ranking survives on a real model.

For each (W, B) and schedule: the schedule's default S and R at W; the benchmark GPT
(:mod:`benchmarks.model`, ``--layers`` blocks so that S = 2W stages exist) cut into S stages by
:func:`lightning_gsched.partition.partition`; every stage's forward and backward timed on one
microbatch of ``--rows`` rows by :func:`lightning_gsched.measure.profile_stages` (B and W
apart for the zero-bubble schedules, with the runtime's split backward); then ``plan()`` with
those costs. Latency is compute only (no communication) on one process: the planner's view, not
a measured step. "vs best" is the profiled latency over the fastest schedule's at that (W, B). Profiles are shared between schedules with the same S and split.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks.model import GPTShape, build_core, lm_loss, token_data
from lightning_gsched.measure import profile_stages
from lightning_gsched.partition import partition
from lightning_gsched.schedule import plan
from lightning_gsched.schedule.library import LIBRARY

SHAPES = ((4, 8), (8, 16))


def profiled_costs(shape: GPTShape, stages: int, split: bool, rows: int,
                   repeats: int) -> dict[str, list[float]]:
    """plan()'s cost arguments for the benchmark GPT cut into ``stages`` stages."""
    core = build_core(shape, seed=0)
    x, y = token_data(shape, rows).tensors
    part = partition(core, stages, (x,))
    times = profile_stages(part.stages, (x,), loss_fn=lambda out: lm_loss(out, y),
                           repeats=repeats, split_backward=split)
    return times.plan_costs()


def rows_for(workers: int, micro: int, shape: GPTShape, rows: int, repeats: int,
             cache: dict[tuple[int, bool], dict[str, list[float]]]) -> list[dict[str, Any]]:
    out = []
    for name in LIBRARY:
        S = plan(name, workers=workers, microbatches=micro).stages
        # the unit model of the same network: W forward units in all, W/S per stage
        unit = plan(name, workers=workers, microbatches=micro, forward_cost=workers / S,
                    backward_cost=2 * workers / S)
        split = unit.programs.split_backward
        if (S, split) not in cache:
            cache[(S, split)] = profiled_costs(shape, S, split, rows, repeats)
        measured = plan(name, workers=workers, microbatches=micro, **cache[(S, split)])
        out.append({
            "schedule": name, "S": S, "R": unit.R,
            "unit_latency": unit.metrics.latency, "unit_bubble": unit.metrics.bubble_fraction,
            "latency_s": measured.metrics.latency, "bubble": measured.metrics.bubble_fraction,
            "peak_stash": measured.metrics.max_of("peak_activations"),
        })
    return out


def markdown(workers: int, micro: int, rows: list[dict[str, Any]]) -> str:
    best = min(r["latency_s"] for r in rows)
    lines = [f"**W={workers}, B={micro}**", "",
             "| schedule | S | R | unit latency | unit bubble | profiled latency | vs best "
             "| profiled bubble | peak stash |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| `{r['schedule']}` | {r['S']} | {r['R'] or '-'} | {r['unit_latency']:g} | "
            f"{r['unit_bubble']:.1%} | {r['latency_s'] * 1e3:.1f} ms | "
            f"{r['latency_s'] / best:.2f} | {r['bubble']:.1%} | {r['peak_stash']:g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rows", type=int, default=2, help="rows of one microbatch")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one worker's compute: as a rank of a W-process run would see it
    shape = GPTShape(layers=args.layers, dim=args.dim, heads=4)
    cache: dict[tuple[int, bool], dict[str, list[float]]] = {}
    print(f"benchmark GPT, {args.layers} blocks of width {args.dim}, microbatches of "
          f"{args.rows}x{shape.seq} tokens, 1 thread\n")
    for workers, micro in SHAPES:
        print(markdown(workers, micro, rows_for(workers, micro, shape, args.rows, args.repeats,
                                                cache)))
        print()


if __name__ == "__main__":
    main()
