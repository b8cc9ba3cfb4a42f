"""Timed Lightning fits, run inside a launched rank (see common.launch).

Both sides of a Lightning ratio go through :func:`fit_timed` with only the strategy changed, so
model, data, global batch, dtype, threads and Trainer options are identical by construction.
A step is timed from ``on_train_batch_start`` to ``on_train_batch_end``: forward, backward,
gradient reduction, optimizer step and logging, everything the strategy is responsible for.
Benchmarks that need more than the step times (CPU times, a profile, probes of the strategy)
build their callbacks themselves and call :func:`run_fit` with :func:`make_strategy`, the same
fit that :func:`fit_timed` runs.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks.model import BenchLit, GPTShape, rank_loader


class StepTimer(pl.Callback):
    """Wall time of every training batch on this rank (``times``, seconds).

    Optional, both off by default: ``cpu=True`` also records each batch's process CPU time (all
    threads, gloo's included) over the same window in ``cpu_times`` (``None`` otherwise);
    ``profiler`` (a ``cProfile.Profile``) is enabled around every batch with
    ``batch_idx >= profile_from`` only, switched on before the clocks start and off after they
    stop; ``profiled_steps`` counts those batches.
    """

    def __init__(self, cpu: bool = False, profiler: Any = None, profile_from: int = 0) -> None:
        self.times: list[float] = []
        self.cpu_times: list[float] | None = [] if cpu else None
        self.profiler = profiler
        self.profile_from = profile_from
        self.profiled_steps = 0
        self._start = 0.0
        self._cpu = 0.0

    def _profiled(self, batch_idx: int) -> bool:
        return self.profiler is not None and batch_idx >= self.profile_from

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._profiled(batch_idx):
            self.profiler.enable()
        if self.cpu_times is not None:
            self._cpu = time.process_time()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.times.append(time.perf_counter() - self._start)
        if self.cpu_times is not None:
            self.cpu_times.append(time.process_time() - self._cpu)
        if self._profiled(batch_idx):
            self.profiler.disable()
            self.profiled_steps += 1


def make_strategy(spec: dict[str, Any], world: int) -> Any:
    """``{"kind": "lightning_ddp"}``, ``{"kind": "single"}`` or ``{"kind": "gsched", ...kwargs}``."""
    kind = spec["kind"]
    if kind == "lightning_ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    if kind == "single":
        return "auto"
    if kind == "gsched":
        from lightning_gsched import GeneralParallel

        kwargs = {k: v for k, v in spec.items() if k != "kind"}
        return GeneralParallel(**kwargs)
    raise ValueError(f"unknown strategy kind {kind!r}")


class ScheduleTimer(pl.Callback):
    """Wall time of GeneralParallel's ``executor.step`` (the planned schedule alone) per batch.

    The planner predicts the duration of the programs, not of the optimizer step or Lightning's
    loop around them, so the fidelity benchmark compares its prediction with this time.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._wrapped = False

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if self._wrapped or engine is None or not engine.built:
            return
        executor = engine.executor
        inner = executor.step

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.times.append(time.perf_counter() - start)

        executor.step = timed_step
        self._wrapped = True


def run_fit(strategy: Any, rank: int, world: int, steps: int, per_rank: int, shape: GPTShape,
            callbacks: list[Any], profile: str | None = None, *,
            model: pl.LightningModule | None = None, loader: Any = None) -> pl.Trainer:
    """One fit of BenchLit on fixed data; ``profile``: see :func:`fit_timed`.

    ``model`` / ``loader``: another module or data (default: ``BenchLit(shape)`` and this
    rank's slice of each global batch), for a row whose sides need them (tensor parallelism:
    a module that shards itself in ``configure_model``, every rank reading the whole batch),
    with the Trainer options every Lightning row shares."""
    model = BenchLit(shape.as_dict()) if model is None else model
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, num_nodes=1, strategy=strategy,
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    if loader is None:
        loader = rank_loader(shape, per_rank, steps, rank, world)
    if profile and rank == 0:
        import cProfile

        profiler = cProfile.Profile()
        profiler.runcall(trainer.fit, model, train_dataloaders=loader)
        profiler.dump_stats(profile)
    else:
        trainer.fit(model, train_dataloaders=loader)
    return trainer


def fit_timed(rank: int, world: int, strategy: dict[str, Any], steps: int, per_rank: int,
              shape: dict[str, int] | None = None, profile: str | None = None) -> dict[str, Any]:
    """Fit ``steps`` steps; every step's wall and process CPU time, and the last loss.

    ``profile``: a path; rank 0 runs the fit under cProfile and writes the stats there (this
    slows the run, so profiled runs are never the timed ones).
    """
    gshape = GPTShape(**(shape or {}))
    timer = StepTimer(cpu=True)
    trainer = run_fit(make_strategy(strategy, world), rank, world, steps, per_rank, gshape,
                      [timer], profile)
    loss = trainer.callback_metrics.get("train_loss")
    return {"times": timer.times, "cpu_times": timer.cpu_times,
            "loss": None if loss is None else float(loss), "threads": torch.get_num_threads()}
