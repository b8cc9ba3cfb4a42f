"""``tune``: does the tuner's pick run fastest under a fixed budget, and does it rank the rest?

1. ``tune_model`` ranks every library configuration (activation caps included; at W=2 the
   data-parallel lifts are ddp and fsdp under other names, so G stays 1; ``top=None``: every
   candidate costed, not only the top the bounded search ranks) of the
   benchmark GPT (:mod:`benchmarks.model`) on W=2 ranks with the row's global batch, SGD with
   momentum (optimizer factor 1) and a **fixed memory budget** per rank (:data:`BUDGET`, passed
   into the tuner, so "fits" constrains the pick), with the runtime's costs measured on a W=2
   gloo job (``runtime.calibrate``, as ``GeneralParallel("auto")`` does at its first batch).
2. The measured set: the tuner's top ``TOP`` fitting candidates, whatever their family (the
   pick first), plus ``RANDOM`` candidates drawn at random (fixed seed) from the rest of the
   costed ranking, fitting or not, so the set spans the ranking rather than its top.
3. Every candidate runs in **alternated rounds** (:mod:`benchmarks.rounds`, reused processes):
   each round runs every candidate once, a short ``GeneralParallel`` fit with exactly the
   candidate's schedule, S, B, R, cap and checkpointing, in an order that reverses every round,
   so a drift of the machine lands on all candidates alike.
4. The row: ratio = the median over rounds of (the pick's median step / the best median step
   among the measured candidates that fit the budget by their measured peak) in that round;
   ``extra.spearman`` = rank correlation of predicted and measured (median over rounds) step
   times over every measured candidate; ``extra.candidates_measured``; whether the pick's
   measured peak (the engine's accounting, max over ranks) fits the budget, and how many
   "fits" predictions held.

    python -m benchmarks.bench_tune [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

from benchmarks.common import THREADS_PER_RANK, Result, launch
from benchmarks.rank_stats import spearman
from benchmarks.rounds import Side, measure

WORLD = 2
PER_RANK = 8
BUDGET = 48 * 2**20  # bytes per rank: binding here (ddp at B=2 predicts ~54 MiB)
TOP, RANDOM = 6, 6  # >= 12 candidates measured
SEED = 0
# (rounds, steps per fit, warm-up steps) per mode: --quick stays within a few minutes
SIZES = {"quick": (2, 6, 2), "full": (3, 9, 3)}


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


def _config(candidate: Any, profiles: dict[int, Any]) -> dict[str, Any]:
    """``GeneralParallel``'s arguments for a candidate as ``"auto"`` would train its pick
    (``engine/auto.pick_as_config``): with the profiled stage costs, so the measured fit runs the
    very programs the tuner predicted. Without them the planner orders with unit costs, and
    for schedules whose order follows the costs (zbv, interleaved, zero-bubble W placement)
    the measured programs were not the predicted ones (the runs before 2026-11-26)."""
    from lightning_gsched.schedule.tune import candidate_costs

    forward, backward, weight = candidate_costs(candidate, profiles[candidate.stages])
    config: dict[str, Any] = {"schedule": candidate.schedule, "stages": candidate.stages,
                              "microbatches": candidate.micro,
                              "checkpoint_activations": candidate.checkpoint,
                              "forward_cost": list(forward), "backward_cost": list(backward)}
    if weight is not None:
        config["weight_cost"] = list(weight)
    if candidate.R is not None:
        config["R"] = candidate.R
    if candidate.cap is not None:
        config["cap"] = candidate.cap
    if candidate.replicas > 1:
        config["data_parallel_size"] = candidate.replicas
        config["data_parallel"] = candidate.mode
    return config


def choose(verdicts: list[Any], top: int, extra: int, seed: int) -> list[Any]:
    """The tuner's first ``top`` fitting verdicts (the pick first), then ``extra`` others at
    random from the rest of the costed ranking (one per distinct candidate text)."""
    costed = [v for v in verdicts if v.step_time is not None]
    head = [v for v in costed if v.fits][:top]
    seen = {v.candidate.text() for v in head}
    rest = [v for v in costed if v.candidate.text() not in seen]
    return head + random.Random(seed).sample(rest, min(extra, len(rest)))


def run(quick: bool) -> list[Result]:
    import torch

    from benchmarks.model import GPTShape, build_core, lm_loss, token_data
    from lightning_gsched.measure.tune_profile import tune_model
    from lightning_gsched.schedule.runtime_costs import RuntimeCosts

    rounds, steps, warmup = SIZES["quick" if quick else "full"]
    shape = GPTShape()
    global_rows = PER_RANK * WORLD
    costs = RuntimeCosts(**launch("benchmarks.bench_tune:calibrated", WORLD))
    torch.manual_seed(0)
    core = build_core(shape, seed=0)
    rows = global_rows // (2 * WORLD)  # profiled at the B=2W microbatch size
    x, y = token_data(shape, rows).tensors
    # profile with the ranks' one intra-op thread: with the parent's default (one per core)
    # the profile matched no run, and on the loaded machine OpenMP's threads competing for
    # busy cores made S>=2 stage times 10x too slow in one run (predictions of 1-4 s)
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS_PER_RANK)
    try:
        ranking = tune_model(core, (x,), WORLD, global_rows,
                             loss_fn=lambda out: lm_loss(out, y), budget=BUDGET,
                             optimizer_factor=1.0, repeats=3 if quick else 5, costs=costs,
                             top=None)  # every candidate costed: the random draws span it
    finally:
        torch.set_num_threads(threads)
    pick = ranking.best
    if pick is None:
        raise RuntimeError(f"nothing fits the budget of {BUDGET} bytes per rank")
    chosen = choose(ranking.verdicts, TOP, RANDOM, SEED)
    assert chosen[0] is pick
    names = [f"c{i}" for i in range(len(chosen))]
    sides = {n: Side("benchmarks.bench_tune:measured_fit",
                     {"config": _config(v.candidate, ranking.profiles), "steps": steps,
                      "per_rank": PER_RANK})
             for n, v in zip(names, chosen, strict=True)}
    runs = measure(sides, WORLD, rounds, warmup)
    per_round = {n: [statistics.median(runs[n].wall(r)) for r in range(rounds)] for n in names}
    peaks = {n: max((o[0]["peak"] or 0) for o in runs[n].outputs) for n in names}
    measured = [{"candidate": v.candidate.text(), "predicted_s": v.step_time,
                 "predicted_peak": v.peak, "predicted_fits": v.fits,
                 "measured_s": statistics.median(per_round[n]), "round_s": per_round[n],
                 "measured_peak": peaks[n], "measured_fits": peaks[n] <= BUDGET}
                for n, v in zip(names, chosen, strict=True)]
    fitting = [n for n, m in zip(names, measured, strict=True) if m["measured_fits"]]
    ratios = [per_round[names[0]][r] / min(per_round[n][r] for n in fitting)
              for r in range(rounds)]
    rho = spearman([m["predicted_s"] for m in measured], [m["measured_s"] for m in measured])
    best = min((m for m in measured if m["measured_fits"]), key=lambda m: m["measured_s"])
    agree = sum(m["predicted_fits"] == m["measured_fits"] for m in measured)
    pick_m = measured[0]
    notes = (f"W=2, global batch {global_rows}x{shape.seq} tokens, budget "
             f"{BUDGET / 2**20:.0f} MiB per rank passed to the tuner; {len(measured)} candidates "
             f"measured (top {TOP} fitting + {len(measured) - min(TOP, len(measured))} random) "
             f"in {rounds} alternated rounds of {steps} steps ({warmup} warm-up); pick "
             f"{pick_m['candidate']} {pick_m['measured_s'] * 1e3:.0f} ms, peak "
             f"{pick_m['measured_peak'] / 2**20:.1f} MiB (fits measured: "
             f"{pick_m['measured_fits']}); best measured that fits {best['candidate']} "
             f"{best['measured_s'] * 1e3:.0f} ms; ratio = median over rounds of pick / best "
             f"fitting in the round; spearman(predicted, measured) {rho:.2f}; fits predicted = "
             f"measured for {agree}/{len(measured)}; runtime costs {costs.text()}")
    return [Result(name="tune", ours_s=pick_m["measured_s"], anchor_s=best["measured_s"],
                   goal="<= 1.10, spearman >= 0.8", notes=notes,
                   round_ratios=ratios,
                   extra={"measured": measured, "budget": BUDGET, "fits_agree": agree,
                          "candidates_measured": len(measured), "spearman": rho,
                          "pick_over_best": statistics.median(ratios),
                          "pick_fits_measured": pick_m["measured_fits"],
                          "rounds": rounds, "table": ranking.table(30)})]


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
