"""``pipeline_vs_torch``: our gpipe / 1f1b against torch.distributed.pipelining on the same split.

Both sides train the benchmark GPT (:mod:`benchmarks.model`, seed 0) on the same global batches
with 2 processes (2 stages, one per rank), 8 microbatches, SGD with momentum 0.9 and lr 0.05, and
the mean of the microbatches' ``lm_loss`` as the loss.

* Ours: :func:`fit_timed_ours` (the fit of :func:`benchmarks.lit_runs.fit_timed`, through
  :func:`benchmarks.lit_runs.run_fit`, plus CPU times and optional profiling) with
  ``GeneralParallel("gpipe" | "1f1b", microbatches=8)``;
  a step is Lightning's whole training batch (forward, backward, transfers, optimizer step,
  logging), see :mod:`benchmarks.lit_runs`.
* Anchor: a plain torch loop (:func:`torch_pipeline_timed`) with ``PipelineStage`` and
  ``ScheduleGPipe`` / ``Schedule1F1B`` (``n_microbatches=8``, ``loss_fn=lm_loss``, default
  ``scale_grads=True``, outputs not returned); a step is ``schedule.step`` + ``optimizer.step``
  + ``zero_grad``.

Same split: :func:`stage_split` asks our partitioner (in the parent process) where it cuts the
model at 2 stages, and the anchor builds its two stages as plain ``nn.Module`` halves of
``GPTCore`` cut at that block (an error if the cut is not between two blocks). With the default
shape the cut is after ``blocks.1`` (1,661,440 | 1,645,568 parameters, one 256 KiB activation
per 4-row microbatch crosses it): stage 0 = ``wte, wpe, blocks[0:2]``, stage 1 =
``blocks[2:4], ln_f, head``.

Same computation: each side reports the loss of its last step (ours: the logged ``train_loss``,
the mean over the global batch; anchor: the mean of the last stage's microbatch losses), i.e.
the loss after ``steps - 1`` updates from the same initial weights on the same data; the two
must agree closely (they did to all printed digits when this was written).

Both sides time rank 0's steps; the first ``WARMUP`` steps of each run are dropped. Besides the
wall times (the ratio), ``extra`` has each side's median process CPU time per step on rank 0:
on a machine shared with other jobs the wall times swing by tens of percent while the CPU times
stay put, so a wall ratio far from ``cpu_ratio`` says "noise or waiting", not "more work".

``python -m benchmarks.bench_pipeline [--quick] [--profile]``: print the rows; ``--profile``
additionally runs each side once under cProfile (rank 0 and rank 1, steady steps only) and
prints the top functions in ms per step.
"""

from __future__ import annotations

import cProfile
import functools
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import (
    Result,
    alternate,
    bench_main,
    dump_profile,
    launch,
    median,
    profile_summary,
    spread,
    steady,
)

MODULE = "benchmarks.bench_pipeline"  # not __name__: that is "__main__" under python -m
WORLD = 2
MICROBATCHES = 8
WARMUP = 3
PER_RANK = 16  # global batch 32 rows of 64 tokens, microbatches of 4 rows
GOAL = "<= 0.95"
SCHEDULES = ("gpipe", "1f1b")
QUICK = {"steps": 8, "rounds": 1}
FULL = {"steps": 12, "rounds": 3}


# --------------------------------------------------------------------------- the anchor


@functools.lru_cache(maxsize=None)
def stage_split(shape: Any) -> dict[str, Any]:
    """Where our partitioner cuts BenchLit at 2 stages, as a block index (checked).

    Runs once in the parent process (tracing + the "params" balance are deterministic, so this
    is the cut every rank of our runs makes); the anchor's workers get the block index.
    """
    import torch

    from benchmarks.model import BenchLit
    from lightning_gsched.partition import partition

    model = BenchLit(shape.as_dict())
    example = torch.zeros(2, shape.seq, dtype=torch.long)
    part = partition(model, WORLD, (example,), {})
    first, second = (set(names) for names in part.stage_parameter_names)
    layers = shape.layers

    def block_names(blocks: range) -> set[str]:
        return {f"core.blocks.{i}.{name}" for i in blocks
                for name, _ in model.core.blocks[i].named_parameters()}

    for cut in range(layers + 1):
        want0 = {"core.wte.weight", "core.wpe.weight"} | block_names(range(cut))
        want1 = block_names(range(cut, layers)) | {"core.ln_f.weight", "core.ln_f.bias",
                                                   "core.head.weight"}
        if first == want0 and second == want1:
            return {"cut": cut, "stage_params": part.stage_param_counts,
                    "boundary": part.boundary_names[0]}
    raise RuntimeError(
        "our partitioner does not cut the benchmark GPT between two blocks, so the anchor "
        f"cannot rebuild the same split; stage 0 reads {sorted(first)}, stage 1 {sorted(second)}"
    )


def _halves(core: Any, cut: int) -> tuple[Any, Any]:
    """Stage 0 = embeddings + blocks[:cut]; stage 1 = blocks[cut:] + ln_f + head (same tensors)."""
    import torch.nn as nn

    class First(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = core.wte, core.wpe
            self.blocks = nn.Sequential(*list(core.blocks)[:cut])
            self.register_buffer("positions", core.positions, persistent=False)

        def forward(self, idx: Any) -> Any:
            return self.blocks(self.wte(idx) + self.wpe(self.positions))

    class Second(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*list(core.blocks)[cut:])
            self.ln_f, self.head = core.ln_f, core.head

        def forward(self, x: Any) -> Any:
            return self.head(self.ln_f(self.blocks(x)))

    return First(), Second()


def torch_pipeline_timed(rank: int, world: int, schedule: str, steps: int, per_rank: int,
                         cut: int, microbatches: int = MICROBATCHES,
                         shape: dict[str, int] | None = None, profile_dir: str | None = None,
                         warmup: int = WARMUP) -> dict[str, Any]:
    """One rank of the anchor: torch.distributed.pipelining, plain loop; rank 0's step times."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from benchmarks.model import GPTShape, build_core, lm_loss, token_data

    gshape = GPTShape(**(shape or {}))
    dist.init_process_group("gloo")
    try:
        core = build_core(gshape, seed=0)
        module = _halves(core, cut)[rank]
        del core
        stage = PipelineStage(module, rank, world, torch.device("cpu"))
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        sched = cls(stage, microbatches, loss_fn=lm_loss)
        opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
        rows = per_rank * world
        data = token_data(gshape, rows * steps)
        xs, ys = data.tensors
        times: list[float] = []
        cpu_times: list[float] = []
        losses: list[float] = []
        prof = cProfile.Profile() if profile_dir else None
        for i in range(steps):
            x, y = xs[i * rows:(i + 1) * rows], ys[i * rows:(i + 1) * rows]
            if prof is not None and i >= warmup:
                prof.enable()
            cpu = time.process_time()
            start = time.perf_counter()
            if rank == 0:
                sched.step(x)
            else:
                step_losses: list[Any] = []
                sched.step(target=y, losses=step_losses, return_outputs=False)
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu)
            if prof is not None and i >= warmup:
                prof.disable()
            if rank == world - 1:
                losses.append(float(torch.stack(step_losses).mean()))
        if prof is not None:
            dump_profile(prof, profile_dir, rank, steps - warmup)
        # the loss lives on the last stage; rank 0 returns it
        box = [losses]
        dist.broadcast_object_list(box, src=world - 1)
        return {"times": times, "cpu_times": cpu_times, "loss": box[0][-1], "losses": box[0],
                "threads": torch.get_num_threads()}
    finally:
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
    from benchmarks.model import GPTShape

    timer = StepTimer(cpu=True, profiler=cProfile.Profile() if profile_dir else None,
                      profile_from=warmup)
    trainer = run_fit(make_strategy(strategy, world), rank, world, steps, per_rank,
                      GPTShape(**(shape or {})), [timer])
    if profile_dir:
        dump_profile(timer.profiler, profile_dir, rank, timer.profiled_steps)
    loss = trainer.callback_metrics.get("train_loss")
    return {"times": timer.times, "loss": None if loss is None else float(loss),
            "threads": torch.get_num_threads(), "cpu_times": timer.cpu_times}


# --------------------------------------------------------------------------- the benchmark


def _ours(schedule: str, steps: int, per_rank: int) -> dict[str, Any]:
    return launch(f"{MODULE}:fit_timed_ours", WORLD,
                  strategy={"kind": "gsched", "schedule": schedule, "microbatches": MICROBATCHES},
                  steps=steps, per_rank=per_rank)


def _anchor(schedule: str, steps: int, per_rank: int) -> dict[str, Any]:
    from benchmarks.model import GPTShape

    return launch(f"{MODULE}:torch_pipeline_timed", WORLD, schedule=schedule, steps=steps,
                  per_rank=per_rank, cut=stage_split(GPTShape())["cut"],
                  microbatches=MICROBATCHES)


def _fmt(loss: float | None) -> str:
    return "n/a" if loss is None else f"{loss:.4f}"


def _side(
    fn: Any, schedule: str, steps: int, losses: list[float | None], cpu: list[float]
) -> Callable[[], list[float]]:
    """One side's measurement for :func:`alternate`: the steady step times of a fresh run; the
    final loss and CPU times go to ``losses`` / ``cpu``. Everything it uses is bound here, not
    read from the caller's loop variables when it runs."""

    def measure() -> list[float]:
        out = fn(schedule, steps, PER_RANK)
        losses.append(out["loss"])
        cpu.extend(steady(out["cpu_times"], WARMUP))
        return steady(out["times"], WARMUP)

    return measure


def run(quick: bool) -> list[Result]:
    from benchmarks.model import GPTShape

    cfg = QUICK if quick else FULL
    steps, rounds = cfg["steps"], cfg["rounds"]
    shape = GPTShape()
    split = stage_split(shape)
    cut = split["cut"]
    results = []
    for schedule in SCHEDULES:
        losses: dict[str, list[float | None]] = {"ours": [], "anchor": []}
        cpu: dict[str, list[float]] = {"ours": [], "anchor": []}

        wall = time.perf_counter()
        times = alternate(
            {
                name: _side(fn, schedule, steps, losses[name], cpu[name])
                for name, fn in (("ours", _ours), ("anchor", _anchor))
            },
            rounds,
        )
        wall = time.perf_counter() - wall
        loss_ours, loss_anchor = losses["ours"][-1], losses["anchor"][-1]
        diff = None if loss_ours is None or loss_anchor is None else abs(loss_ours - loss_anchor)
        torch_name = "ScheduleGPipe" if schedule == "gpipe" else "Schedule1F1B"
        notes = (f"W=2, 2 stages, {MICROBATCHES} microbatches, global batch "
                 f"{PER_RANK * WORLD}x{shape.seq} tokens, SGD momentum; same split both sides "
                 f"(our partitioner's, rebuilt as nn.Modules for torch): wte+wpe+blocks[0:{cut}] "
                 f"| blocks[{cut}:]+ln_f+head; anchor = torch.distributed.pipelining "
                 f"{torch_name} in a plain loop; loss at step {steps}: ours {_fmt(loss_ours)}, "
                 f"torch {_fmt(loss_anchor)}")
        results.append(Result(
            name=f"pipeline_vs_torch[{schedule}]",
            ours_s=median(times["ours"]),
            anchor_s=median(times["anchor"]),
            goal=GOAL,
            notes=notes,
            extra={
                "ours_spread": spread(times["ours"]),
                "anchor_spread": spread(times["anchor"]),
                # rank 0's process CPU time per step (all its threads): the work each side
                # does, much less sensitive than wall time to other load on the machine
                "ours_cpu_s": median(cpu["ours"]), "anchor_cpu_s": median(cpu["anchor"]),
                "cpu_ratio": median(cpu["ours"]) / median(cpu["anchor"]),
                "steps_per_run": steps, "warmup_dropped": WARMUP, "rounds": rounds,
                "steps_measured": {k: len(v) for k, v in times.items()},
                "loss_ours": loss_ours, "loss_anchor": loss_anchor, "loss_abs_diff": diff,
                "loss_per_round": losses,
                "cut_after_block": cut, "stage_params": split["stage_params"],
                "boundary_values": split["boundary"],
                "per_rank": PER_RANK, "global_batch": PER_RANK * WORLD,
                "microbatches": MICROBATCHES, "wall_s": round(wall, 1),
            },
        ))
    return results


def profile(quick: bool) -> str:
    """Run each side once per schedule under cProfile; the summaries (for development)."""
    from benchmarks.model import GPTShape

    steps = (QUICK if quick else FULL)["steps"]
    texts = []
    for schedule in SCHEDULES:
        with tempfile.TemporaryDirectory(prefix="gsched_prof_") as tmp:
            ours_dir, anchor_dir = str(Path(tmp) / "ours"), str(Path(tmp) / "anchor")
            launch(f"{MODULE}:fit_timed_ours", WORLD, profile_dir=ours_dir,
                   strategy={"kind": "gsched", "schedule": schedule,
                             "microbatches": MICROBATCHES},
                   steps=steps, per_rank=PER_RANK)
            launch(f"{MODULE}:torch_pipeline_timed", WORLD, schedule=schedule, steps=steps,
                   per_rank=PER_RANK, cut=stage_split(GPTShape())["cut"], profile_dir=anchor_dir)
            texts.append(f"######## {schedule}: ours ########\n" + profile_summary(ours_dir))
            texts.append(f"######## {schedule}: torch ########\n" + profile_summary(anchor_dir))
    return "\n".join(texts)


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, __doc__.splitlines()[0], run, profile,
               "also run each side under cProfile and print the top functions", short=True)


if __name__ == "__main__":
    main()
