"""The tuner's measurements: a model cut into S stages, timed and sized on one microbatch.

Why here: the search (``schedule/tune.py``) is pure planning and takes numbers; cutting the
model, timing the stages and counting their bytes needs torch and the partitioner. One
:func:`stage_profile` call per stage count gives everything a candidate with that S needs:
forward and backward seconds (and B/W apart, as the zero-bubble runtime splits them), the
share of each that does not shrink with the microbatch's rows (timed again on half the rows)
and the bytes per stage (what a checkpointed stage would keep included): one measuring pass
(``measure.stage_pass``) gets the seconds and the bytes from the same visit of each stage, and
one more timing on half the rows gives the shares.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils import _pytree as pytree

from lightning_gsched.errors import GschedError
from lightning_gsched.measure.build_passes import BuildPasses
from lightning_gsched.measure.profile import Kind
from lightning_gsched.measure.stage_pass import measure_stages
from lightning_gsched.partition.api import Partition, partition
from lightning_gsched.partition.preserve import preserved_tensors_and_rng
from lightning_gsched.partition.tensor_parallel import TensorParallelPlan, parallelize_stages
from lightning_gsched.partition.tensor_parallel_state import gather_shards
from lightning_gsched.schedule import validate
from lightning_gsched.schedule.runtime_costs import RuntimeCosts
from lightning_gsched.schedule.tune import TOP, StageProfile, TuneResult, candidates, tune


def _rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Rows of the microbatch: the first dimension of its first tensor."""
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return 1


MAX_FIXED_SHARE = 0.9  # a noisy pair of timings must not make a job's cost independent of rows


def _first_rows(args: tuple[Any, ...], kwargs: dict[str, Any], rows: int, keep: int
                ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The microbatch cut to its first ``keep`` rows (tensors whose first dimension is
    ``rows``; everything else as it is)."""
    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == rows:
            return x[:keep]
        return x

    cut_args, cut_kwargs = pytree.tree_map(cut, (args, kwargs))
    return cut_args, cut_kwargs


def fixed_shares(full: Sequence[float], part: Sequence[float], share: float
                 ) -> tuple[float, ...]:
    """Per stage, the share of ``full`` (seconds at the profile's rows) that does not scale
    with the rows, from ``part`` (seconds at ``share`` of the rows): the intercept of the line
    through both points over ``full``, clamped to [0, MAX_FIXED_SHARE]."""
    out = []
    for t, h in zip(full, part, strict=True):
        fixed = (h - share * t) / (1 - share) if t > 0 else 0.0
        out.append(min(max(fixed / t if t > 0 else 0.0, 0.0), MAX_FIXED_SHARE))
    return tuple(out)


# the stages as they will run, for the span of a measurement: e.g. sharded over a worker's
# tensor-parallel ranks (engine/auto.py), made whole again on the way out
ShardStages = Callable[[Sequence[torch.nn.Module]], AbstractContextManager[Any]]


def sharded_while_measured(module: torch.nn.Module, plan: TensorParallelPlan, tp_mesh: Any
                           ) -> ShardStages:
    """The tuner's ``shard``: a cut's stages sharded by ``plan`` over ``tp_mesh`` while they
    are measured, then every parameter of ``module`` whole again (its values exact: the
    pieces were cut from them), before the next cut."""
    @contextmanager
    def sharded(stages: Sequence[torch.nn.Module]) -> Iterator[None]:
        parallelize_stages(stages, plan, tp_mesh)
        try:
            yield
        finally:
            gather_shards(module)

    return sharded


def stage_profile(model: torch.nn.Module, stages: int, args: tuple[Any, ...],
                  kwargs: dict[str, Any] | None = None,
                  loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  optimizer_factor: float = 0.0, repeats: int = 3,
                  passes: BuildPasses | None = None, shard: ShardStages | None = None,
                  **partition_options: Any) -> StageProfile:
    """``model`` cut into ``stages`` stages, measured on the microbatch ``args``/``kwargs``.

    ``loss_fn(output) -> scalar``: the loss of the last stage (timed and sized with it).
    ``optimizer_factor``: optimizer-state bytes per parameter byte (2 for Adam).
    ``passes``: where the measuring pass is kept for later consumers (the memory report).
    ``shard``: the stages as they will run while they are measured (tensor-parallel shards:
    their seconds include the layers' collectives, their bytes are a rank's).
    ``partition_options``: as :func:`partition` takes them (``balance``, ``leaf_modules``...).
    """
    kwargs = kwargs or {}
    # a measurement, not the split that trains: the engine verifies the one it builds
    part = partition(model, stages, args, kwargs, **{"verify": False, **partition_options})
    with shard(part.stages) if shard is not None else nullcontext():
        return _measured_profile(part, stages, args, kwargs, loss_fn, optimizer_factor,
                                 repeats, passes)


def _measured_profile(part: Partition, stages: int, args: tuple[Any, ...],
                      kwargs: dict[str, Any], loss_fn: Callable[[Any], torch.Tensor] | None,
                      optimizer_factor: float, repeats: int,
                      passes: BuildPasses | None) -> StageProfile:
    """:func:`stage_profile`'s measurement of the cut ``part``."""
    rows = _rows(args, kwargs)
    # the row shares below compare seconds without the loss: the last stage is timed so too
    unlossed: tuple[Kind, ...] = ("unlossed",) if rows >= 2 and loss_fn is not None else ()
    # one pass: seconds (whole and split backward) and bytes from the same visit of each stage
    measured = measure_stages(part.stages, args, kwargs, loss_fn,
                              kinds=("whole", "split", *unlossed), repeats=repeats,
                              sizes=True, optimizer_factor=optimizer_factor)
    if passes is not None:
        passes.record(part.stage_units, args, kwargs, measured)
    whole, split, sizes = measured.times, measured.split, measured.sizes
    assert whole is not None and split is not None and sizes is not None
    fixed = None
    if rows >= 2:
        # what does not shrink with the rows: the stages' seconds without the loss (whose
        # targets belong to the full microbatch) on all rows, from the pass, against one more
        # timing on half of them
        keep = rows // 2
        half_args, half_kwargs = _first_rows(args, kwargs, rows, keep)
        last_f, last_b = measured.unlossed_last or (whole.forward[-1], whole.backward[-1])
        full_f, full_b = [*whole.forward[:-1], last_f], [*whole.backward[:-1], last_b]
        half = measure_stages(part.stages, half_args, half_kwargs, kinds=("whole",),
                              repeats=repeats).times
        assert half is not None
        fixed = (fixed_shares(full_f, half.forward, keep / rows),
                 fixed_shares(full_b, half.backward, keep / rows))
    return StageProfile(
        stages=stages, rows=rows, forward=tuple(whole.forward),
        backward=tuple(whole.backward), sizes=sizes,
        split=(tuple(split.backward), tuple(split.weight)), fixed_share=fixed)


def tune_model(model: torch.nn.Module, args: tuple[Any, ...], workers: int, global_rows: int,
               kwargs: dict[str, Any] | None = None,
               loss_fn: Callable[[Any], torch.Tensor] | None = None,
               budget: int | str | None = None, optimizer_factor: float = 2.0,
               costs: RuntimeCosts | None = None, schedules: Sequence[str] | None = None,
               checkpoint: Sequence[bool] = (False, True), repeats: int = 3, *,
               stages: int | None = None, micro: int | None = None, R: int | None = None,
               replicas: int | None = None, top: int | None = TOP,
               passes: BuildPasses | None = None, shard: ShardStages | None = None,
               **partition_options: Any) -> TuneResult:
    """Rank the library configurations for ``model`` on ``workers`` ranks (``gsched tune``).

    ``args``/``kwargs``: one microbatch (its rows are the profile's; other microbatch sizes are
    scaled from it). ``global_rows``: the rows of one optimizer step over all ranks: a
    candidate with G replicas and B microbatches per replica cuts it into B x G microbatches.
    ``budget``: bytes per rank (an int or ``"20GiB"``); None ranks without a budget.
    ``optimizer_factor``: optimizer state per parameter byte (2: Adam, 1: SGD with momentum).
    ``stages``/``micro`` (B per replica)/``R``/``replicas`` (G, ``data_parallel_size``):
    values the search must keep (``schedule.tune.candidates``); ``top``: the fitting
    candidates ranked exactly (``schedule.tune.tune``; None: every candidate costed).
    ``costs``: the runtime's costs per message, job and step (``runtime.calibrate()`` on the
    job's process group; default ``schedule.runtime_costs.DEFAULT_COSTS``).
    The model is profiled once per stage count the candidates need, with its buffers and the
    RNG restored afterwards; ``partition_options`` go to :func:`partition`. ``passes``: where
    each stage count's measuring pass is kept (the engine's memory report reuses them).
    ``shard``: the stages as they will run while measured (:func:`stage_profile`); peers in
    :func:`follow_tuning` run the same profiles in the same order (``tune`` asks for every
    stage count of its candidates, rising: :func:`tuned_stage_counts`).
    """
    limit = None if budget is None else validate.byte_size("memory_budget", budget)
    profiles: dict[int, StageProfile] = {}

    def profile_of(count: int) -> StageProfile:
        if count not in profiles:
            with preserved_tensors_and_rng(model):
                profiles[count] = stage_profile(model, count, args, kwargs, loss_fn,
                                                optimizer_factor, repeats, passes=passes,
                                                shard=shard, **partition_options)
        return profiles[count]

    return tune(workers, global_rows, profile_of, budget=limit, costs=costs,
                schedules=schedules, checkpoint=checkpoint, stages=stages, micro=micro, R=R,
                replicas=replicas, top=top)


def tuned_stage_counts(workers: int, global_rows: int, schedules: Sequence[str] | None,
                       checkpoint: Sequence[bool], *, stages: int | None, micro: int | None,
                       R: int | None, replicas: int | None) -> list[int]:
    """Every stage count a candidate of the search has, ascending: the profiles
    :func:`tune_model` asks for, in its order (``schedule.tune.tune``)."""
    found = candidates(workers, global_rows, schedules, checkpoint, stages=stages, micro=micro,
                       R=R, replicas=replicas)
    return sorted({c.stages for c in found})


def follow_tuning(model: torch.nn.Module, args: tuple[Any, ...], workers: int,
                  global_rows: int, shard: ShardStages, kwargs: dict[str, Any] | None = None,
                  loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  optimizer_factor: float = 2.0, schedules: Sequence[str] | None = None,
                  checkpoint: Sequence[bool] = (False, True), repeats: int = 3, *,
                  stages: int | None = None, micro: int | None = None, R: int | None = None,
                  replicas: int | None = None, **partition_options: Any) -> None:
    """A tensor-parallel peer of the rank running :func:`tune_model` with the same arguments
    and ``shard``: the same profiles in the same order, so that each sharded layer's
    collectives meet their counterparts there; the measurements are that rank's to keep."""
    for count in tuned_stage_counts(workers, global_rows, schedules, checkpoint, stages=stages,
                                    micro=micro, R=R, replicas=replicas):
        try:
            with preserved_tensors_and_rng(model):
                stage_profile(model, count, args, kwargs, loss_fn, optimizer_factor, repeats,
                              shard=shard, **partition_options)
        except GschedError:  # a count the model cannot be cut into: tune drops it alike
            continue
