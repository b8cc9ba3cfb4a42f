"""``pipeline_engine_vs_torch``: our pipeline engine in a plain loop against torch's, same split.

Why beside ``pipeline_vs_torch``: that row runs ours through Lightning's Trainer (hooks,
logging, the loss exchange) against torch's bare loop, so its gap mixes the engine with the
Trainer around it. Here ours is the same engine in a plain loop: Lightning Fabric with
``GeneralParallelFabric(<schedule>, microbatches=8)`` (:func:`engine_timed`), a step being
``strategy.step(model, batch, loss_fn)`` (the pipelined forward and backward, gradients handed
to the parameters) + ``optimizer.step`` + ``zero_grad``, exactly what the anchor's step is
around ``schedule.step``. The anchor, the rows (gpipe, 1f1b, zb-h1, zbv), the split, the data
and the rounds are those of :mod:`benchmarks.bench_pipeline`. Goal: engine <= 1.00.

    python -m benchmarks.bench_engine [--quick] [--rows gpipe 1f1b ...] [--profile-costs]
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

from benchmarks.bench_pipeline import (
    FULL,
    MICROBATCHES,
    PER_RANK,
    QUICK,
    ROWS,
    WARMUP,
    WORLD,
    _anchor_side,
    _chosen,
    _fmt,
    _placement_text,
    process_counts,
)
from benchmarks.common import Result
from benchmarks.rounds import Side, measure, ratio_result

MODULE = "benchmarks.bench_engine"
GOAL = "<= 1.00"


def engine_timed(rank: int, world: int, schedule: str, steps: int, per_rank: int,
                 microbatches: int = MICROBATCHES, profile_costs: bool = False
                 ) -> dict[str, Any]:
    """One rank of ours in a plain Fabric loop; rank 0's wall and CPU seconds per step.
    ``profile_costs``: planned with the stages' seconds timed at the build (the option)."""
    import torch
    from lightning.fabric import Fabric

    from benchmarks.model import GPTShape, build_core, lm_loss, token_data
    from lightning_gsched.fabric import GeneralParallelFabric

    shape = GPTShape()
    fabric = Fabric(accelerator="cpu", devices=world,
                    strategy=GeneralParallelFabric(schedule, microbatches=microbatches,
                                                   profile_costs=profile_costs))
    fabric.launch()
    core = build_core(shape, seed=0)
    opt = torch.optim.SGD(core.parameters(), lr=0.05, momentum=0.9)
    model, opt = fabric.setup(core, opt)
    rows = per_rank * world
    xs, ys = token_data(shape, rows * steps).tensors  # the anchor's global batches

    def loss_fn(module: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return lm_loss(module(x), y)

    times: list[float] = []
    cpu_times: list[float] = []
    losses: list[float] = []
    counts: list[list[int]] = []
    for i in range(steps):
        lo = i * rows + rank * per_rank  # this rank's rows of global batch i
        batch = (xs[lo:lo + per_rank], ys[lo:lo + per_rank])
        before = process_counts()
        cpu = time.process_time()
        start = time.perf_counter()
        loss = fabric.strategy.step(model, batch, loss_fn)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
        counts.append([b - a for a, b in zip(before, process_counts(), strict=True)])
        losses.append(float(loss))
    # our process groups (each a gloo thread that wakes every 10 ms) must not outlive the fit:
    # in reused processes (benchmarks/rounds.py) they would run beside the next fits, the
    # anchor's included
    fabric.strategy.teardown()
    return {"times": times, "cpu_times": cpu_times, "loss": losses[-1], "losses": losses,
            "threads": torch.get_num_threads(), "counts": counts}


def step_counts(runs: Any) -> list[list[float]]:
    """Per rank, the median over every round's steady steps of (minor page faults, voluntary,
    involuntary context switches) per step (:func:`process_counts`)."""
    from benchmarks.common import median

    per_rank: list[list[float]] = []
    for rank in range(len(runs.outputs[0])):
        steps = [c for out in runs.outputs for c in out[rank]["counts"][runs.warmup:]]
        per_rank.append([median([float(c[i]) for c in steps]) for i in range(3)])
    return per_rank


def _engine_side(schedule: str, steps: int, profile_costs: bool = False) -> Side:
    return Side(f"{MODULE}:engine_timed",
                {"schedule": schedule, "steps": steps, "per_rank": PER_RANK,
                 "profile_costs": profile_costs})


def run(quick: bool, rows: Sequence[str] | None = None,
        profile_costs: bool = False) -> list[Result]:
    """``pipeline_engine_vs_torch[<schedule>]`` for the chosen rows of bench_pipeline's table;
    with ``profile_costs``, ours planned with its stages' measured seconds, as
    ``pipeline_engine_vs_torch[<schedule>, profiled costs]``."""
    cfg = QUICK if quick else FULL
    results = []
    for row in _chosen(rows):
        wall = time.perf_counter()
        runs = measure({"ours": _engine_side(row.schedule, cfg["steps"], profile_costs),
                        "anchor": _anchor_side(row.schedule, cfg["steps"])},
                       WORLD, cfg["rounds"], WARMUP)
        wall = time.perf_counter() - wall
        loss_ours = runs["ours"].last()["loss"]
        loss_anchor = runs["anchor"].last()["loss"]
        notes = (f"W={WORLD}, {_placement_text(row)}, {MICROBATCHES} microbatches, global "
                 f"batch {PER_RANK * WORLD} rows; ours = GeneralParallelFabric"
                 f"{'(profile_costs=True)' if profile_costs else ''} in a plain "
                 f"Fabric loop (no Trainer); anchor = torch.distributed.pipelining "
                 f"{row.torch_schedule} in a plain loop, same split; loss at step "
                 f"{cfg['steps']}: ours {_fmt(loss_ours)}, torch {_fmt(loss_anchor)}")
        label = f"{row.schedule}, profiled costs" if profile_costs else row.schedule
        results.append(ratio_result(
            f"pipeline_engine_vs_torch[{label}]", runs["ours"], runs["anchor"], GOAL,
            notes, extra={"loss_ours": loss_ours, "loss_anchor": loss_anchor,
                          "steps_per_run": cfg["steps"], "wall_s": round(wall, 1),
                          "faults_switches_per_step": {"ours": step_counts(runs["ours"]),
                                                       "anchor": step_counts(runs["anchor"])}}))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=None)
    parser.add_argument("--profile-costs", action="store_true",
                        help="ours planned with the stages' measured seconds (profile_costs=True)")
    args = parser.parse_args()
    for r in run(args.quick, args.rows, args.profile_costs):
        print(f"{r.name:34s} ours {r.ours_s * 1e3:7.1f} ms  torch {r.anchor_s * 1e3:7.1f} ms  "
              f"ratio {r.ratio:.3f}  cpu ratio {r.cpu_ratio}  {r.notes}")
        print(f"  per rank (minor faults, voluntary, involuntary switches) per step: "
              f"{r.extra['faults_switches_per_step']}")


if __name__ == "__main__":
    main()
