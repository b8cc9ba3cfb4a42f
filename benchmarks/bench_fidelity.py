"""``fidelity``: does the planner predict the step time it will get?

For each library schedule, on W ranks at once (so profiling sees the same contention as the run):

1. partition the benchmark model into the schedule's stages and time every stage's forward and
   backward on one real microbatch (:func:`lightning_gsched.partition.profile_stages`);
2. plan the schedule with those costs (rank 0's numbers, broadcast, so every rank plans the same
   programs) and read its latency: the predicted step time;
3. train with ``GeneralParallel`` given the same costs (so it executes exactly the predicted
   programs) and time ``executor.step`` (the programs: forward, backward, transfers,
   reductions) per step, the maximum over ranks; the full Lightning step (plus optimizer and
   loop) is reported beside it;
4. efficiency = (single-process forward+backward of the whole global batch / W) / measured.

The planner models compute only; the gap it leaves is transfers, gradient reduction and
per-action overhead, and the table shows it per schedule.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import Result, launch, median, steady
from benchmarks.lit_runs import ScheduleTimer, StepTimer, run_fit
from benchmarks.model import GPTShape, build_core, lm_loss, token_data

SCHEDULES = ["ddp", "fsdp", "gpipe", "1f1b", "lpp", "interleaved", "fslpp", "fslpp-seed"]


def _full_batch_compute(shape: GPTShape, x: torch.Tensor, y: torch.Tensor, repeats: int) -> float:
    """Median forward+backward time of the whole model on the whole global batch."""
    core = build_core(shape)
    samples = []
    for attempt in range(repeats + 1):
        start = time.perf_counter()
        lm_loss(core(x), y).backward()
        if attempt:
            samples.append(time.perf_counter() - start)
        core.zero_grad(set_to_none=True)
    return statistics.median(samples)


def fidelity_run(rank: int, world: int, schedule: str, steps: int, warmup: int, per_rank: int,
                 microbatches: int, shape: dict[str, int] | None = None, R: int | None = None,
                 repeats: int = 5) -> dict[str, Any]:
    from lightning_gsched import GeneralParallel
    from lightning_gsched.partition import partition
    from lightning_gsched.partition.profile import profile_stages
    from lightning_gsched.schedule.plan import plan

    dist.init_process_group("gloo")  # Lightning reuses it
    gshape = GPTShape(**(shape or {}))
    shape_plan = plan(schedule, workers=world, microbatches=microbatches, R=R)
    S = shape_plan.stages
    data = token_data(gshape, per_rank * world)
    x, y = data.tensors
    rows = per_rank * world // microbatches
    core = build_core(gshape)
    part = partition(core, S, (x[:rows],))
    times = profile_stages(part.stages, (x[:rows],), loss_fn=lambda out: lm_loss(out, y[:rows]),
                           repeats=repeats)
    single = _full_batch_compute(gshape, x, y, max(2, repeats // 2))
    box = [(times.forward, times.backward, single)]
    dist.broadcast_object_list(box, 0)
    forward, backward, single = box[0]
    predicted = plan(schedule, workers=world, microbatches=microbatches, R=R,
                     forward_cost=forward, backward_cost=backward)
    strategy = GeneralParallel(schedule, R=R, microbatches=microbatches, forward_cost=forward,
                               backward_cost=backward)
    step_timer, schedule_timer = StepTimer(), ScheduleTimer()
    run_fit(strategy, rank, world, steps, per_rank, gshape, [step_timer, schedule_timer])
    mine = {"schedule": schedule_timer.times, "step": step_timer.times}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    n = min(len(r["schedule"]) for r in everyone)
    measured = [max(r["schedule"][i] for r in everyone) for i in range(n)]
    # the first timed executor.step is step 2 (the wrapper goes in once the engine is built)
    measured = steady(measured, max(0, warmup - 1))
    full = steady([max(r["step"][i] for r in everyone) for i in range(len(everyone[0]["step"]))],
                  warmup)
    return {
        "schedule": schedule, "W": world, "S": S, "B": microbatches, "R": predicted.R,
        "forward_cost_s": forward, "backward_cost_s": backward,
        "predicted_s": predicted.metrics.latency,
        "predicted_bubble": predicted.metrics.bubble_fraction,
        "measured_s": median(measured), "measured_samples": measured,
        "lightning_step_s": median(full),
        "single_process_s": single,
        "efficiency": (single / world) / median(measured),
        "lightning_efficiency": (single / world) / median(full),
    }


def _row(r: dict[str, Any]) -> Result:
    error = r["measured_s"] / r["predicted_s"] - 1
    return Result(
        name=f"fidelity[{r['schedule']}]", ours_s=r["measured_s"], anchor_s=r["predicted_s"],
        goal="|ratio-1| <= 0.10",
        notes=(f"measured/predicted; S={r['S']} B={r['B']}; error {error:+.1%}; efficiency "
               f"{r['efficiency']:.2f} (Lightning step {r['lightning_step_s'] * 1e3:.0f} ms, "
               f"{r['lightning_efficiency']:.2f})"),
        extra=r,
    )


def run(quick: bool, schedules: list[str] | None = None) -> list[Result]:
    steps, warmup = (8, 3) if quick else (16, 4)
    results = []
    for schedule in schedules or SCHEDULES:
        r = launch("benchmarks.bench_fidelity:fidelity_run", 2, schedule=schedule, steps=steps,
                   warmup=warmup, per_rank=8, microbatches=8, repeats=3 if quick else 5)
        results.append(_row(r))
    return results


def microbatch_sweep(quick: bool, schedules: tuple[str, ...] = ("gpipe", "fslpp"),
                     global_batch: int = 32) -> list[dict[str, Any]]:
    """Measured and predicted step time as microbatches grow, at a fixed global batch."""
    steps, warmup = (6, 2) if quick else (12, 3)
    counts = (2, 8) if quick else (2, 4, 8, 16)
    rows = []
    for schedule in schedules:
        for B in counts:
            r = launch("benchmarks.bench_fidelity:fidelity_run", 2, schedule=schedule,
                       steps=steps, warmup=warmup, per_rank=global_batch // 2, microbatches=B,
                       repeats=3)
            rows.append(r)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--schedules", nargs="*")
    args = parser.parse_args()
    for r in run(args.quick, args.schedules):
        print(f"{r.name:24s} measured {r.ours_s * 1e3:8.1f} ms  predicted {r.anchor_s * 1e3:8.1f} ms"
              f"  ratio {r.ratio:.3f}  {r.notes}")


if __name__ == "__main__":
    main()
