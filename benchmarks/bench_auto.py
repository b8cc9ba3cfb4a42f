"""``auto_vs_best_torch[W=4]`` (and ``[W=2]``): ``GeneralParallel("auto")`` under a memory budget
against the fastest torch option a user could have picked by hand that fits the same budget.

The question: does one general scheduler with a tuner give a user a faster plan than the best
one they would pick by hand from torch? Every side trains the benchmark GPT
(:mod:`benchmarks.model`, seed 0; 2W blocks at W=4, :func:`layers_for`) on the same global batches of ``PER_RANK * W`` rows, SGD with
momentum 0.9, with a budget of :data:`BUDGETS` bytes per rank, below what DDP and FSDP2 need.

Rivals (:data:`RIVALS`), each in a plain torch loop:

* torch.distributed.pipelining ``ScheduleGPipe``, ``Schedule1F1B``,
  ``ScheduleInterleavedZeroBubble`` (ZB1P; S = W, stage s on rank s), ``ScheduleInterleaved1F1B``
  (S = 2W looped), ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (S = 2W in a V), on our
  partitioner's cut rebuilt as plain modules (:mod:`benchmarks.pipeline_split`), each at every
  microbatch count of :data:`MICROBATCHES` (W, 2W, 4W) that torch accepts;
* FSDP2 as well as its API allows here (``bench_fsdp.fsdp2_at_its_best``) and DDP, one
  microbatch per rank.

Ours: ``GeneralParallel("auto", memory_budget=budget)`` through the Trainer, as a user writes
it. It tunes at its first batch in every fit (profiling, calibration, the search: all before
the timed steps), so what is timed is the plan it picked.

Two phases, each one launch of W processes (:mod:`benchmarks.rounds`, reused processes):

1. **Selection** (one round, every rival configuration): steady step time and peak bytes. A
   configuration *fits* when its measured peak, the worst rank, is at most the budget. Each
   torch schedule keeps its fastest fitting microbatch count: the finalists.
2. **Rounds**: ours and every finalist alternate (the order reverses every round). Per round,
   the ratio is ours / the fastest finalist *of that round* (so the best rival is chosen after
   the fact, on the very steps it is compared on: a choice no user could make, in torch's
   favour). The row's ratio is the median over rounds.

Peak bytes are measured the same way for every side, from outside both runtimes: one extra,
untimed step under :class:`benchmarks.allocator_peak.StepPeak` (ours: ``ProfilerPeak`` around a
Trainer batch): a census of the tensor storages alive at its start plus the peak of the
profiler's allocation events during it, less a census taken before the fit built anything
(:func:`benchmarks.allocator_peak.fit_peak`). It is an upper bound and independent of our bytes
model, which is what ``"auto"`` planned with: whether ours fits by this measurement is reported.

    python -m benchmarks.bench_auto [--quick] [--world 4 2]

Full run only (``run.py``): at W=4 on two cores, about 20 configurations are fitted.
"""

from __future__ import annotations

import argparse
import functools
import time
from dataclasses import dataclass
from typing import Any, Sequence

from benchmarks.bench_pipeline import pipeline_step
from benchmarks.common import Result, median
from benchmarks.pipeline_split import stage_split
from benchmarks.rounds import Side, SideRuns, measure

MODULE = "benchmarks.bench_auto"
PER_RANK = 16
WARMUP = 2
# bytes per rank, by W: below DDP's and FSDP2's measured peaks (193 and 164 MB at W=4, 100 and
# 97 MB at W=2 in an exploratory run), so neither fits, while most pipelines fit at some B
BUDGETS = {4: 128 * 2**20, 2: 80 * 2**20}
GOAL = "<= 0.90"
LAUNCH_TIMEOUT = 3600.0  # one launch runs every configuration: ~35 s each at W=4 on 2 cores
# (selection steps, round steps, rounds); warm-up steps included in both step counts
SIZES = {"quick": (4, 5, 2), "full": (5, 7, 3)}


@dataclass(frozen=True)
class Rival:
    """A torch option: a pipelining schedule (its class, S per W, placement) or a wrapper."""

    name: str
    torch_class: str = ""  # a torch.distributed.pipelining.schedules class, or "" (fsdp2, ddp)
    stages_per_rank: int = 1
    placement: str = "loop"

    @property
    def pipeline(self) -> bool:
        return bool(self.torch_class)


RIVALS = {r.name: r for r in (
    Rival("gpipe", "ScheduleGPipe"),
    Rival("1f1b", "Schedule1F1B"),
    Rival("zb1p", "ScheduleInterleavedZeroBubble"),
    Rival("interleaved", "ScheduleInterleaved1F1B", 2),
    Rival("zbv", "ScheduleZBVZeroBubble", 2, "v"),
    Rival("dualpipev", "ScheduleDualPipeV", 2, "v"),
    Rival("fsdp2"),
    Rival("ddp"),
)}


def layers_for(world: int) -> int:
    """The benchmark GPT's depth at W: 2W blocks (at least its default 4), so that the S = 2W
    rivals (interleaved, zbv, dualpipev) hold whole blocks, as torch's stages must."""
    return max(4, 2 * world)


def microbatch_counts(world: int) -> tuple[int, ...]:
    """The microbatch counts a pipeline rival is tried at: W, 2W and 4W."""
    return (world, 2 * world, 4 * world)


@functools.lru_cache(maxsize=None)
def _cuts(layers: int, stages: int, micro_rows: int) -> list[int]:
    from benchmarks.model import GPTShape

    return list(stage_split(GPTShape(layers=layers), stages, micro_rows)["cuts"])


# --------------------------------------------------------------------------- the rivals


def rival_timed(rank: int, world: int, rival: str, microbatches: int, steps: int,
                per_rank: int, cuts: list[int] | None = None) -> dict[str, Any]:
    """One rank of a torch rival: rank 0's step times, every rank's CPU times, the worst
    rank's peak (one extra untimed step) and the global batch's loss; ``{"refused": why}``
    where torch refuses the configuration at construction (on every rank alike)."""
    import gc

    import torch
    import torch.distributed as dist

    from benchmarks.allocator_peak import StepPeak, census_now, fit_peak
    from benchmarks.model import GPTShape, build_core, lm_loss, token_data

    spec = RIVALS[rival]
    if not dist.is_initialized():  # launched alone, not in benchmarks.rounds' processes
        dist.init_process_group("gloo")
    before_fit = census_now()
    shape = GPTShape(layers=layers_for(world))
    rows = per_rank * world
    xs, ys = token_data(shape, rows * (steps + 1)).tensors
    try:
        step = (_pipeline_step if spec.pipeline else _data_parallel_step)(
            rank, world, spec, microbatches, cuts, build_core(shape, seed=0), lm_loss)
    except (ValueError, RuntimeError, AssertionError) as exc:
        return {"refused": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    times, cpu_times, losses = [], [], []
    for i in range(steps):
        x, y = xs[i * rows:(i + 1) * rows], ys[i * rows:(i + 1) * rows]
        cpu, start = time.process_time(), time.perf_counter()
        losses.append(step(x, y))
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
    with StepPeak() as probe:
        step(xs[steps * rows:], ys[steps * rows:])
    peak = None if probe.events is None else fit_peak(probe.events, before_fit)["total"]
    box: list[Any] = [None] * world
    dist.all_gather_object(box, (losses, peak))
    del step
    gc.collect()
    dist.barrier()
    known = [ls for ls, _ in box if ls and ls[0] is not None]
    per_step = [sum(v) / len(v) for v in zip(*known, strict=True)]
    return {"times": times, "cpu_times": cpu_times, "loss": per_step[-1],
            "peaks": [pk for _, pk in box], "threads": torch.get_num_threads()}


def _pipeline_step(rank: int, world: int, spec: Rival, microbatches: int,
                   cuts: list[int] | None, core: Any, loss_fn: Any) -> Any:
    """A step function for a torch pipelining schedule on this rank's stages; its loss is the
    mean of the last stage's microbatch losses (None on ranks without the last stage)."""
    import torch

    assert cuts is not None
    step, _ = pipeline_step(rank, world, core, cuts, spec.placement, spec.torch_class,
                            microbatches, loss_fn)

    def mean_loss(x: Any, y: Any) -> float | None:
        losses = step(x, y)
        return None if losses is None else float(torch.stack(losses).mean())

    return mean_loss


def _data_parallel_step(rank: int, world: int, spec: Rival, microbatches: int,
                        cuts: list[int] | None, core: Any, loss_fn: Any) -> Any:
    """A step function for FSDP2 (at its best) or DDP on this rank's rows of the batch; its
    loss is this rank's (the ranks' row counts are equal, so their mean is the batch's)."""
    import torch

    if spec.name == "fsdp2":
        from benchmarks.bench_fsdp import fsdp2_at_its_best

        fsdp2_at_its_best(core)
        model = core
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(core)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(x: Any, y: Any) -> float:
        per_rank = x.shape[0] // world
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = loss_fn(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    return step


# --------------------------------------------------------------------------- ours


def auto_fit(rank: int, world: int, steps: int, per_rank: int, budget: int) -> dict[str, Any]:
    """Ours: ``GeneralParallel("auto", memory_budget=budget)`` through the Trainer; step and
    CPU times, every rank's peak (one extra untimed batch), the pick and its predicted peak."""
    import torch
    import torch.distributed as dist

    from benchmarks.allocator_peak import ProfilerPeak, census_now, fit_peak
    from benchmarks.lit_runs import StepTimer, run_fit
    from benchmarks.model import GPTShape
    from lightning_gsched import GeneralParallel

    before_fit = census_now()
    strategy = GeneralParallel("auto", memory_budget=budget)
    timer = StepTimer(cpu=True)
    probe = ProfilerPeak(batch=steps, timeline=False)
    trainer = run_fit(strategy, rank, world, steps + 1, per_rank,
                      GPTShape(layers=layers_for(world)), [timer, probe])
    peak = None if probe.events is None else fit_peak(probe.events, before_fit)["total"]
    peaks: list[Any] = [None] * world
    dist.all_gather_object(peaks, peak)
    config = strategy.schedule_config
    pick = config.chosen.arguments if config.chosen is not None else None
    best = config.tune_result.best if config.tune_result is not None else None
    loss = trainer.callback_metrics.get("train_loss")
    return {"times": timer.times[:steps], "cpu_times": (timer.cpu_times or [])[:steps],
            "loss": None if loss is None else float(loss), "peaks": peaks,
            "pick": None if pick is None else _pick_text(pick),
            "predicted_peak": None if best is None else best.peak,
            "threads": torch.get_num_threads()}


def _pick_text(pick: Any) -> str:
    text = f"{pick.schedule}, S={pick.stages}, B={pick.microbatches}"
    if pick.data_parallel_size > 1:
        text += f", G={pick.data_parallel_size} {pick.data_parallel}"
    return text + (", checkpointed" if pick.checkpoint_activations else "")


# --------------------------------------------------------------------------- the row


def _rival_side(name: str, microbatches: int, world: int, steps: int) -> Side:
    spec = RIVALS[name]
    cuts = (_cuts(layers_for(world), spec.stages_per_rank * world,
                  PER_RANK * world // microbatches)
            if spec.pipeline else None)
    return Side(f"{MODULE}:rival_timed", {
        "rival": name, "microbatches": microbatches, "steps": steps, "per_rank": PER_RANK,
        "cuts": cuts})


def _configurations(world: int) -> dict[str, tuple[str, int]]:
    """Every rival configuration: label -> (rival, microbatches)."""
    out = {}
    for name, spec in RIVALS.items():
        for b in microbatch_counts(world) if spec.pipeline else (world,):
            out[f"{name}/B={b}" if spec.pipeline else name] = (name, b)
    return out


def _peak(outputs: list[dict[str, Any]]) -> int | None:
    peaks = outputs[0].get("peaks") or []
    return None if not peaks or None in peaks else max(peaks)


def _seconds(runs: SideRuns, round_: int | None = None) -> float:
    return median(runs.all_wall() if round_ is None else runs.wall(round_))


def select(world: int, steps: int, budget: int) -> tuple[dict[str, tuple[str, int]],
                                                          list[dict[str, Any]]]:
    """Phase 1: every rival configuration once; the finalists (each rival's fastest fitting
    configuration) and a record of every configuration (time, peak, fits, refused)."""
    configs = _configurations(world)
    runs = measure({label: _rival_side(name, b, world, steps)
                    for label, (name, b) in configs.items()}, world, 1, WARMUP,
                   timeout=LAUNCH_TIMEOUT)
    record: list[dict[str, Any]] = []
    best: dict[str, tuple[float, str]] = {}
    for label, (name, _) in configs.items():
        first = runs[label].outputs[0]
        if "refused" in first[0]:
            record.append({"config": label, "refused": first[0]["refused"]})
            continue
        seconds, peak = _seconds(runs[label]), _peak(first)
        fits = peak is not None and peak <= budget
        record.append({"config": label, "ms": round(seconds * 1e3, 1), "peak": peak,
                       "fits": fits})
        if fits and (name not in best or seconds < best[name][0]):
            best[name] = (seconds, label)
    return {label: configs[label] for _, label in best.values()}, record


def measure_row(world: int, quick: bool, budget: int | None = None) -> Result:
    """One ``auto_vs_best_torch[W=world]`` row (module docstring)."""
    budget = budget or BUDGETS[world]
    select_steps, steps, rounds = SIZES["quick" if quick else "full"]
    wall = time.perf_counter()
    finalists, record = select(world, select_steps, budget)
    if not finalists:
        raise RuntimeError(f"no torch option fits {budget} bytes per rank at W={world}: "
                           f"{record}; raise BUDGETS[W]")
    sides = {"ours": Side(f"{MODULE}:auto_fit", {"steps": steps, "per_rank": PER_RANK,
                                                 "budget": budget})}
    sides.update({label: _rival_side(name, b, world, steps)
                  for label, (name, b) in finalists.items()})
    runs = measure(sides, world, rounds, WARMUP, timeout=LAUNCH_TIMEOUT)
    wall = time.perf_counter() - wall
    ours = runs.pop("ours")
    ratios, best_per_round = [], []
    for r in range(rounds):
        label = min(runs, key=lambda k: _seconds(runs[k], r))
        best_per_round.append(label)
        ratios.append(_seconds(ours, r) / _seconds(runs[label], r))
    fastest = min(runs, key=lambda k: _seconds(runs[k]))
    ours_out = ours.last()
    ours_peak = _peak(ours.outputs[-1])
    rivals = {k: {"ms": round(_seconds(v) * 1e3, 1), "peak": _peak(v.outputs[-1])}
              for k, v in runs.items()}
    mib = 2**20
    fit = {c["config"]: c.get("fits") for c in record}
    notes = (f"W={world}, GPT of {layers_for(world)} blocks, budget {budget / mib:.0f} MiB per "
             f"rank (DDP fits: {bool(fit.get('ddp'))}, FSDP2 fits: {bool(fit.get('fsdp2'))}), "
             f"global batch "
             f"{PER_RANK * world} rows; ours = GeneralParallel('auto', memory_budget) through "
             f"the Trainer, picked {ours_out['pick']} (peak measured "
             f"{(ours_peak or 0) / mib:.1f} MiB, planned {(ours_out['predicted_peak'] or 0) / mib:.1f}"
             f" MiB); fastest fitting torch option {fastest} "
             f"({rivals[fastest]['ms']:.0f} ms, peak {(rivals[fastest]['peak'] or 0) / mib:.1f}"
             f" MiB) among {len(record)} configurations ({sum(1 for c in record if c.get('fits'))}"
             f" fit); ratio = median over {rounds} rounds of ours / that round's fastest "
             f"finalist")
    return Result(
        name=f"auto_vs_best_torch[W={world}]", ours_s=_seconds(ours),
        anchor_s=_seconds(runs[fastest]), goal=GOAL, notes=notes, round_ratios=ratios,
        ours_cpu_s=median(ours.all_cpu()), anchor_cpu_s=median(runs[fastest].all_cpu()),
        extra={"pick": ours_out["pick"], "ours_peak": ours_peak,
               "ours_predicted_peak": ours_out["predicted_peak"],
               "ours_fits_measured": ours_peak is not None and ours_peak <= budget,
               "budget": budget, "finalists": rivals, "best_per_round": best_per_round,
               "selection": record, "loss_ours": ours_out["loss"],
               "loss_fastest": runs[fastest].last()["loss"], "wall_s": round(wall, 1)})


def run(quick: bool, worlds: Sequence[int] = (4, 2)) -> list[Result]:
    return [measure_row(w, quick) for w in worlds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--world", type=int, nargs="+", default=[4, 2])
    parser.add_argument("--budget-mib", type=float, default=None, help="default: BUDGETS[W]")
    args = parser.parse_args()
    for w in args.world:
        r = measure_row(w, args.quick, int(args.budget_mib * 2**20) if args.budget_mib else None)
        print(f"{r.name}: ours {r.ours_s * 1e3:.1f} ms, best torch {r.anchor_s * 1e3:.1f} ms, "
              f"ratio {r.ratio:.3f} {r.round_ratios}\n  {r.notes}")
        for c in r.extra["selection"]:
            print("   ", c)


if __name__ == "__main__":
    main()
