"""``pipeline_vs_torch``: our pipeline schedules against torch.distributed.pipelining, same split.

Four rows, one code path (:data:`ROWS`, :func:`run`): each row names our schedule, torch's
closest schedule, the number of stages S and how stages sit on ranks.

| row | ours | torch | S | rank r holds |
|---|---|---|---|---|
| ``gpipe`` | ``GeneralParallel("gpipe")`` | ``ScheduleGPipe`` | 2 | stage r |
| ``1f1b`` | ``GeneralParallel("1f1b")`` | ``Schedule1F1B`` | 2 | stage r |
| ``zb-h1`` | ``GeneralParallel("zb-h1")`` | ``ScheduleInterleavedZeroBubble`` | 2 | stage r |
| ``zbv`` | ``GeneralParallel("zbv")`` | ``ScheduleZBVZeroBubble`` | 4 | stages r and 3 - r |

Both sides train the benchmark GPT (:mod:`benchmarks.model`, seed 0) on the same global batches
with 2 processes, 8 microbatches, SGD with momentum 0.9 and lr 0.05, and the mean of the
microbatches' ``lm_loss`` as the loss.

* Ours: :func:`fit_timed_ours` (the fit of :func:`benchmarks.lit_runs.fit_timed`, through
  :func:`benchmarks.lit_runs.run_fit`, plus CPU times and optional profiling) with
  ``GeneralParallel(<schedule>, microbatches=8, data_loading="per_replica")`` and the library
  defaults (S = W for gpipe, 1f1b and zb-h1, S = 2W in a V for zbv; zb-h1 and zbv split each
  backward into B and W); a step is Lightning's whole training batch (forward, backward,
  transfers, optimizer step, logging), see :mod:`benchmarks.lit_runs`. Every rank loads each
  global batch whole, as torch's loop hands rank 0 every input and the last stage's rank every
  target (``"per_rank"``, DDP's loading, moves rows at each step's start instead).
* Anchor: a plain torch loop (:func:`torch_pipeline_timed`) with one ``PipelineStage`` per local
  stage and the row's torch schedule (``n_microbatches=8``, ``loss_fn=lm_loss``, default
  ``scale_grads=True``, outputs not returned); a step is ``schedule.step`` + ``optimizer.step``
  + ``zero_grad``. ``ScheduleInterleavedZeroBubble`` (torch's ZB1P, i.e. ZB-H1) accepts one
  local stage per rank: its warm-up is then W-1-r forwards, and it needs ``n_microbatches`` to
  be a multiple of ``max(1, n_microbatches // W)`` (8 at W=2: 4 rounds of 2). Both torch
  zero-bubble schedules split the backward into input (I) and weight (W) passes as ours do.

Same split: :func:`benchmarks.pipeline_split.stage_split` asks our partitioner (in the parent
process) where it cuts the model at S stages, and the anchor rebuilds the same S stages as plain
``nn.Module`` slices of ``GPTCore`` at those blocks (an error if a cut falls inside a block).
With the default shape: at S=2 the cut is after ``blocks.1`` (1,661,440 | 1,645,568
parameters): ``wte+wpe+blocks[0:2] | blocks[2:4]+ln_f+head``; at S=4 every stage holds one
block: ``wte+wpe+blocks[0:1] | blocks[1:2] | blocks[2:3] | blocks[3:4]+ln_f+head``
(871,680 | 789,760 | 789,760 | 855,808). One 256 KiB activation per 4-row microbatch crosses
each cut.

Same computation: each side reports the loss of its last step (ours: the logged ``train_loss``,
the mean over the global batch; anchor: the mean of the last stage's microbatch losses), i.e.
the loss after ``steps - 1`` updates from the same initial weights on the same data; the two
must agree closely (``loss_abs_diff`` in ``extra``).

The two sides alternate in rounds (:mod:`benchmarks.rounds`): both time rank 0's steps, the
first ``WARMUP`` steps of each fit are dropped, the ratio is the median of the per-round ratios
and its spread their min and max. Beside the wall times, each side's process CPU time per step
summed over both ranks: on a machine shared with other jobs the wall times swing by tens of
percent while the CPU times stay put, so a wall ratio far from ``cpu_ratio`` says "noise or
waiting", not "more work".

``python -m benchmarks.bench_pipeline [--quick] [--profile] [--rows NAME ...]``: print the rows
(all, or the named ones); ``--profile`` additionally runs each side of those rows once under
cProfile (rank 0 and rank 1, steady steps only) and prints the top functions in ms per step.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from benchmarks.common import (
    Result,
    bench_main,
    dump_profile,
    launch,
    profile_summary,
)
from benchmarks.pipeline_split import describe, local_stages, stage_modules, stage_split
from benchmarks.rounds import Side, measure, ratio_result

MODULE = "benchmarks.bench_pipeline"  # not __name__: that is "__main__" under python -m
WORLD = 2
MICROBATCHES = 8
WARMUP = 3
PER_RANK = 16  # global batch 32 rows of 64 tokens, microbatches of 4 rows
GOAL = "<= 1.02"  # issue 34: through the Trainer (an earlier issue asked <= 0.95)
# steps per fit (warm-up included) and alternated rounds; quick is what `make bench` runs
QUICK = {"steps": 7, "rounds": 4}
FULL = {"steps": 10, "rounds": 8}


@dataclass(frozen=True)
class PipelineRow:
    """One ``pipeline_vs_torch[<schedule>]`` row: our schedule, torch's, the stages and placement.

    ``placement``: ``"loop"`` (stage s on rank s mod W) or ``"v"`` (rank r holds r and 2W-1-r),
    see :func:`benchmarks.pipeline_split.local_stages`; it must be where our library puts the
    stages, so both sides hold the same modules on the same ranks.
    """

    schedule: str
    torch_schedule: str
    stages: int
    placement: str = "loop"


ROWS = {row.schedule: row for row in (
    PipelineRow("gpipe", "ScheduleGPipe", WORLD),
    PipelineRow("1f1b", "Schedule1F1B", WORLD),
    PipelineRow("interleaved", "ScheduleInterleaved1F1B", 2 * WORLD),
    PipelineRow("zb-h1", "ScheduleInterleavedZeroBubble", WORLD),
    PipelineRow("zbv", "ScheduleZBVZeroBubble", 2 * WORLD, "v"),
)}


def process_counts() -> tuple[int, int, int]:
    """This process's minor page faults, voluntary and involuntary context switches so far:
    read around each step, their differences say whether one side's kernels touch fresh pages
    (a new allocation backed by new pages faults on first write) or lose the core more often."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt, usage.ru_nvcsw, usage.ru_nivcsw


@functools.lru_cache(maxsize=None)
def _split(stages: int) -> dict[str, Any]:
    from benchmarks.model import GPTShape

    return stage_split(GPTShape(), stages, PER_RANK * WORLD // MICROBATCHES)


# --------------------------------------------------------------------------- the anchor


def schedule_step(stages: list[Any], torch_class: str, microbatches: int, loss_fn: Any,
                  params: Any, first: bool, last: bool) -> Any:
    """A torch pipelining schedule over this rank's ``stages`` (``PipelineStage`` objects) and
    SGD with momentum over ``params``: ``step(x, y)`` runs ``schedule.step`` (``x`` used where
    ``first``, ``y`` where ``last``, as torch requires), ``optimizer.step`` and ``zero_grad``,
    and returns the last stage's microbatch losses (None on a rank without it). What every
    torch anchor of the benchmarks times as a step."""
    import torch
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, torch_class)
    single = issubclass(cls, schedules.PipelineScheduleSingle)
    sched = cls(stages[0] if single else stages, microbatches, loss_fn=loss_fn)
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)

    def step(x: Any, y: Any) -> list[Any] | None:
        losses: list[Any] = []
        sched.step(*((x,) if first else ()), target=y if last else None,
                   losses=losses if last else None, return_outputs=False)
        opt.step()
        opt.zero_grad()
        return losses if last else None

    return step


def pipeline_step(rank: int, world: int, core: Any, cuts: list[int], placement: str,
                  torch_class: str, microbatches: int, loss_fn: Any) -> tuple[Any, bool]:
    """:func:`schedule_step` on this rank's stages of ``core`` cut before the blocks ``cuts``
    (``placement``: see :func:`benchmarks.pipeline_split.local_stages`); the step and whether
    this rank holds the last stage."""
    import torch
    from torch.distributed.pipelining import PipelineStage

    modules = stage_modules(core, cuts)
    num_stages = len(modules)
    mine = local_stages(placement, rank, world, num_stages)
    local = [PipelineStage(modules[s], s, num_stages, torch.device("cpu")) for s in mine]
    last = num_stages - 1 in mine
    step = schedule_step(local, torch_class, microbatches, loss_fn,
                         [p for s in mine for p in modules[s].parameters()], 0 in mine, last)
    return step, last


def torch_pipeline_timed(rank: int, world: int, schedule: str, steps: int, per_rank: int,
                         cuts: list[int], microbatches: int = MICROBATCHES,
                         shape: dict[str, int] | None = None, profile_dir: str | None = None,
                         warmup: int = WARMUP) -> dict[str, Any]:
    """One rank of the anchor: torch.distributed.pipelining, plain loop; rank 0's step times.

    ``schedule`` names a row of :data:`ROWS`; ``cuts`` are the block indices of
    :func:`benchmarks.pipeline_split.stage_split`. The rank holding stage 0 passes the inputs,
    the one holding the last stage the targets (both on rank 0 in the V), as torch requires.
    """
    import torch
    import torch.distributed as dist

    from benchmarks.model import GPTShape, build_core, lm_loss, token_data

    row = ROWS[schedule]
    gshape = GPTShape(**(shape or {}))
    owned = not dist.is_initialized()  # in reused processes (benchmarks.rounds) it exists
    if owned:
        dist.init_process_group("gloo")
    try:
        num_stages = len(cuts) + 1
        step, last = pipeline_step(rank, world, build_core(gshape, seed=0), cuts, row.placement,
                                   row.torch_schedule, microbatches, lm_loss)
        rows = per_rank * world
        data = token_data(gshape, rows * steps)
        xs, ys = data.tensors
        times: list[float] = []
        cpu_times: list[float] = []
        losses: list[float] = []
        counts: list[list[int]] = []
        prof = cProfile.Profile() if profile_dir else None
        for i in range(steps):
            x, y = xs[i * rows:(i + 1) * rows], ys[i * rows:(i + 1) * rows]
            if prof is not None and i >= warmup:
                prof.enable()
            before = process_counts()
            cpu = time.process_time()
            start = time.perf_counter()
            step_losses = step(x, y)
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu)
            counts.append([b - a for a, b in zip(before, process_counts(), strict=True)])
            if prof is not None and i >= warmup:
                prof.disable()
            if step_losses is not None:
                losses.append(float(torch.stack(step_losses).mean()))
        if prof is not None:
            dump_profile(prof, profile_dir, rank, steps - warmup)
        # the loss lives with the last stage; rank 0 returns it
        box = [losses]
        holder = next(r for r in range(world)
                      if num_stages - 1 in local_stages(row.placement, r, world, num_stages))
        dist.broadcast_object_list(box, src=holder)
        return {"times": times, "cpu_times": cpu_times, "loss": box[0][-1], "losses": box[0],
                "threads": torch.get_num_threads(), "counts": counts}
    finally:
        if owned:
            dist.destroy_process_group()


# --------------------------------------------------------------------------- ours


def fit_timed_ours(rank: int, world: int, strategy: dict[str, Any], steps: int, per_rank: int,
                   shape: dict[str, int] | None = None, profile_dir: str | None = None,
                   warmup: int = WARMUP) -> dict[str, Any]:
    """:func:`benchmarks.lit_runs.fit_timed`'s fit, plus each step's CPU time, optionally profiled.

    :func:`benchmarks.lit_runs.run_fit` with one :class:`~benchmarks.lit_runs.StepTimer` that
    also reads the process CPU time (all threads, gloo's included) around the same window as the
    wall time, and with ``profile_dir`` switches cProfile on for the steps after ``warmup`` only
    (no setup or teardown in the profile). Returns ``fit_timed``'s keys (``times``, ``loss``: the
    last logged ``train_loss``, ``threads``) plus ``cpu_times``.
    """
    import torch

    from benchmarks.lit_runs import StepTimer, make_strategy, run_fit
    from benchmarks.model import GPTShape, replica_loader

    timer = StepTimer(cpu=True, profiler=cProfile.Profile() if profile_dir else None,
                      profile_from=warmup)
    gshape = GPTShape(**(shape or {}))
    # data_loading="per_replica" (one replica): every rank loads each global batch whole
    loader = (replica_loader(gshape, per_rank * world, steps)
              if strategy.get("data_loading") == "per_replica" else None)
    trainer = run_fit(make_strategy(strategy, world), rank, world, steps, per_rank, gshape,
                      [timer], loader=loader)
    if profile_dir:
        dump_profile(timer.profiler, profile_dir, rank, timer.profiled_steps)
    loss = trainer.callback_metrics.get("train_loss")
    return {"times": timer.times, "loss": None if loss is None else float(loss),
            "threads": torch.get_num_threads(), "cpu_times": timer.cpu_times}


# --------------------------------------------------------------------------- the benchmark


def _ours_side(schedule: str, steps: int, profile_dir: str | None = None) -> Side:
    return Side(f"{MODULE}:fit_timed_ours", {
        "strategy": {"kind": "gsched", "schedule": schedule, "microbatches": MICROBATCHES,
                     "data_loading": "per_replica"},
        "steps": steps, "per_rank": PER_RANK, "profile_dir": profile_dir})


def _anchor_side(schedule: str, steps: int, profile_dir: str | None = None) -> Side:
    return Side(f"{MODULE}:torch_pipeline_timed", {
        "schedule": schedule, "steps": steps, "per_rank": PER_RANK,
        "cuts": _split(ROWS[schedule].stages)["cuts"], "microbatches": MICROBATCHES,
        "profile_dir": profile_dir})


def _fmt(loss: float | None) -> str:
    return "n/a" if loss is None else f"{loss:.4f}"


def _placement_text(row: PipelineRow) -> str:
    if row.placement == "v":
        return f"{row.stages} stages in a V (rank r holds stages r and {row.stages - 1}-r)"
    return f"{row.stages} stages, one per rank" if row.stages == WORLD else f"{row.stages} stages"


def measure_row(row: PipelineRow, steps: int, rounds: int) -> Result:
    """One row: both sides alternated ``rounds`` times (:mod:`benchmarks.rounds`); loss check."""
    from benchmarks.model import GPTShape

    shape = GPTShape()
    split = _split(row.stages)
    wall = time.perf_counter()
    runs = measure({"ours": _ours_side(row.schedule, steps),
                    "anchor": _anchor_side(row.schedule, steps)}, WORLD, rounds, WARMUP)
    wall = time.perf_counter() - wall
    losses = {k: [out[0]["loss"] for out in runs[k].outputs] for k in runs}
    loss_ours, loss_anchor = losses["ours"][-1], losses["anchor"][-1]
    diff = None if loss_ours is None or loss_anchor is None else abs(loss_ours - loss_anchor)
    notes = (f"W={WORLD}, {_placement_text(row)}, {MICROBATCHES} microbatches, global batch "
             f"{PER_RANK * WORLD}x{shape.seq} tokens, SGD momentum; same split both sides "
             f"(our partitioner's, rebuilt as nn.Modules for torch): "
             f"{describe(split['cuts'], shape.layers)}; anchor = "
             f"torch.distributed.pipelining {row.torch_schedule} in a plain loop; loss at step "
             f"{steps}: ours {_fmt(loss_ours)}, torch {_fmt(loss_anchor)}")
    return ratio_result(
        f"pipeline_vs_torch[{row.schedule}]", runs["ours"], runs["anchor"], GOAL, notes,
        extra={
            "steps_per_run": steps, "warmup_dropped": WARMUP,
            "loss_ours": loss_ours, "loss_anchor": loss_anchor, "loss_abs_diff": diff,
            "loss_per_round": losses,
            "stages": row.stages, "placement": row.placement, "cuts_before_block": split["cuts"],
            "stage_params": split["stage_params"], "boundary_values": split["boundary"],
            "per_rank": PER_RANK, "global_batch": PER_RANK * WORLD,
            "microbatches": MICROBATCHES, "wall_s": round(wall, 1),
        },
    )


def _chosen(names: Sequence[str] | None) -> list[PipelineRow]:
    unknown = sorted(set(names or ()) - set(ROWS))
    if unknown:
        raise ValueError(f"unknown pipeline_vs_torch rows {unknown}; choose from {list(ROWS)}")
    return [row for name, row in ROWS.items() if not names or name in names]


def run(quick: bool, rows: Sequence[str] | None = None) -> list[Result]:
    """The rows named in ``rows`` (all of :data:`ROWS` by default), in :data:`ROWS`' order."""
    cfg = QUICK if quick else FULL
    return [measure_row(row, cfg["steps"], cfg["rounds"]) for row in _chosen(rows)]


def profile(quick: bool, rows: Sequence[str] | None = None) -> str:
    """Run each side of each chosen row once under cProfile; the summaries (for development)."""
    steps = (QUICK if quick else FULL)["steps"]
    texts = []
    for row in _chosen(rows):
        with tempfile.TemporaryDirectory(prefix="gsched_prof_") as tmp:
            for side, fn in (("ours", _ours_side), ("torch", _anchor_side)):
                folder = str(Path(tmp) / side)
                one = fn(row.schedule, steps, profile_dir=folder)
                launch(one.target, WORLD, **one.kwargs)
                texts.append(f"######## {row.schedule}: {side} ########\n"
                             + profile_summary(folder))
    return "\n".join(texts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=None)
    known, rest = parser.parse_known_args(argv)
    bench_main(rest, __doc__.splitlines()[0], functools.partial(run, rows=known.rows),
               functools.partial(profile, rows=known.rows),
               "also run each side under cProfile and print the top functions", short=True)


if __name__ == "__main__":
    main()
