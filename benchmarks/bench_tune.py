"""``tune``: does the tuner's pick run fastest, and do its "fits" hold?

1. ``tune_model`` ranks every library configuration (activation caps included) of the
   benchmark GPT (:mod:`benchmarks.model`) on W=2 ranks with the row's global batch, SGD with
   momentum (optimizer factor 1), no budget, with the runtime's costs measured on a W=2 gloo
   job (``runtime.calibrate``, as ``GeneralParallel("auto")`` does at its first batch).
2. ``CANDIDATES`` configurations are measured, each a fresh 2-process fit with
   ``GeneralParallel`` given exactly the candidate's schedule, S, B, R and checkpointing: the
   tuner's pick and the fastest-predicted candidate of every other schedule family, so the
   measured set spans the ranking rather than its top. Each fit reports its median steady step
   time and its measured peak bytes per rank (the engine's accounting, max over ranks).
3. The row: measured step time of the pick / the best measured step time (goal <= 1.10).
4. The budget check: a budget halfway between the smallest and the largest measured peak; for
   every measured candidate, "fits" as predicted (predicted peak <= budget) must equal "fits"
   as measured. The notes say how many agreed.

    python -m benchmarks.bench_tune [--quick]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from benchmarks.common import Result, launch, steady

WORLD = 2
PER_RANK = 8
STEPS, WARMUP = 8, 3
CANDIDATES = 6


def measured_fit(rank: int, world: int, config: dict[str, Any], steps: int,
                 per_rank: int) -> dict[str, Any]:
    """One fit of the benchmark GPT with ``GeneralParallel(**config)``: step times and peak."""
    from benchmarks.lit_runs import StepTimer, run_fit
    from benchmarks.model import GPTShape
    from lightning_gsched import GeneralParallel

    strategy = GeneralParallel(**config)
    timer = StepTimer()
    run_fit(strategy, rank, world, steps, per_rank, GPTShape(), [timer])
    report = strategy.memory_report
    peaks = [m["total"] for m in (report.measured or [])] if report is not None else []
    return {"times": timer.times, "peak": max(peaks) if peaks else None}


def calibrated(rank: int, world: int) -> dict[str, float]:
    """The runtime's costs measured on a fresh W-rank gloo job (what "auto" measures)."""
    import dataclasses

    import torch.distributed as dist

    from lightning_gsched.runtime import calibrate

    dist.init_process_group("gloo")
    return dataclasses.asdict(calibrate())


def _config(candidate: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"schedule": candidate.schedule, "stages": candidate.stages,
                              "microbatches": candidate.micro,
                              "checkpoint_activations": candidate.checkpoint}
    if candidate.R is not None:
        config["R"] = candidate.R
    if candidate.cap is not None:
        config["cap"] = candidate.cap
    return config


def _family(schedule: str) -> str:
    return {"fslpp-seed": "fslpp", "zb-h2": "zb-h1", "interleaved": "1f1b",
            "gpipe": "1f1b"}.get(schedule, schedule)


def run(quick: bool) -> list[Result]:
    import torch

    from benchmarks.model import GPTShape, build_core, lm_loss, token_data
    from lightning_gsched.partition.tune_profile import tune_model

    shape = GPTShape()
    global_rows = PER_RANK * WORLD
    from lightning_gsched.schedule.runtime_costs import RuntimeCosts

    costs = RuntimeCosts(**launch("benchmarks.bench_tune:calibrated", WORLD))
    torch.manual_seed(0)
    core = build_core(shape, seed=0)
    rows = global_rows // (2 * WORLD)  # profiled at the B=2W microbatch size
    x, y = token_data(shape, rows).tensors
    ranking = tune_model(core, (x,), WORLD, global_rows, loss_fn=lambda out: lm_loss(out, y),
                         optimizer_factor=1.0, repeats=3 if quick else 5, costs=costs)
    costed = [v for v in ranking.verdicts if v.step_time is not None]
    chosen, families = [], set()
    for v in costed:  # the pick first, then the best of every other family
        if _family(v.candidate.schedule) not in families:
            families.add(_family(v.candidate.schedule))
            chosen.append(v)
        if len(chosen) == CANDIDATES:
            break
    measured = []
    for v in chosen:
        out = launch("benchmarks.bench_tune:measured_fit", WORLD, config=_config(v.candidate),
                     steps=STEPS if quick else 2 * STEPS, per_rank=PER_RANK)
        measured.append({"candidate": v.candidate.text(), "predicted_s": v.step_time,
                         "predicted_peak": v.peak,
                         "measured_s": statistics.median(steady(out["times"], WARMUP)),
                         "measured_peak": out["peak"]})
    best = min(m["measured_s"] for m in measured)
    pick = measured[0]
    peaks = [m["measured_peak"] for m in measured if m["measured_peak"]]
    budget = (min(peaks) + max(peaks)) / 2
    agree = sum((m["predicted_peak"] <= budget) == (m["measured_peak"] <= budget)
                for m in measured if m["measured_peak"])
    order = sorted(measured, key=lambda m: m["measured_s"])
    notes = (f"W=2, global batch {global_rows}x{shape.seq} tokens; pick {pick['candidate']} "
             f"measured {pick['measured_s'] * 1e3:.0f} ms, best measured "
             f"{order[0]['candidate']} {best * 1e3:.0f} ms; {len(measured)} candidates measured "
             f"({', '.join(m['candidate'] for m in measured)}); fits under a budget of "
             f"{budget / 2**20:.2f} MiB (midway between measured peaks): {agree}/{len(peaks)} "
             f"predictions held; runtime costs {costs.text()}")
    return [Result(name="tune", ours_s=pick["measured_s"], anchor_s=best, goal="<= 1.10",
                   notes=notes, extra={"measured": measured, "budget": budget,
                                       "fits_agree": agree, "table": ranking.table(30)})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for r in run(args.quick):
        print(r.extra["table"])
        for m in r.extra["measured"]:
            print(f"  {m['candidate']:<30} predicted {m['predicted_s'] * 1e3:7.1f} ms "
                  f"{m['predicted_peak'] / 2**20:6.2f} MiB   measured "
                  f"{m['measured_s'] * 1e3:7.1f} ms {m['measured_peak'] / 2**20:6.2f} MiB")
        print(f"{r.name}: ratio {r.ratio:.3f}  {r.notes}")


if __name__ == "__main__":
    main()
