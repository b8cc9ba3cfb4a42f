"""One measuring pass over a split model's stages: seconds and bytes from the same runs.

Why one pass: the planner needs, per stage, the forward and backward seconds (the whole
backward, and B and W apart as the zero-bubble runtime splits it) and the bytes (stash,
message, what a split B frees and keeps for W). Measured by separate loops, the example
microbatch went through every stage once per figure. :func:`measure_stages` visits each stage
once, in pipeline order, and gets every figure asked for there:

1. its timed repetitions (:func:`~lightning_gsched.measure.profile.time_stage`), with no hooks
   installed: a saved-tensor hook runs Python for every tensor autograd saves, which would
   slow the forward it times;
2. then one byte repetition (:func:`~lightning_gsched.measure.measure_bytes.size_stage`) under
   the hooks: bytes follow from shapes, not from timing or values, so one repetition reads them
   as well as any; its output, as the runtime hands it over, feeds the next stage's runs.

``profile_stages`` (seconds) and ``measure_stage_bytes`` (bytes) are this pass asked for one
kind of figure; the tuner (:mod:`.tune_profile`) asks for all of them at once.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from lightning_gsched.errors import PartitionError
from lightning_gsched.measure.measure_bytes import (
    StashBytes,
    model_sizes,
    size_stage,
    tensor_bytes,
)
from lightning_gsched.measure.meta_attention import fused_attention_on_meta
from lightning_gsched.measure.profile import (
    Kind,
    KindSamples,
    StageCall,
    StageTimes,
    median,
    time_stage,
)
from lightning_gsched.partition.meta_run import has_meta_parameters
from lightning_gsched.partition.preserve import preserved_tensors_and_rng
from lightning_gsched.runtime import wire
from lightning_gsched.schedule.memory import ModelSizes


@dataclass(frozen=True)
class StageMeasurement:
    """What one pass measured (None: not asked for).

    ``times``: median seconds with the whole backward; ``split``: with B and W apart
    (``split.backward`` is B's, ``split.weight`` W's); both have ``forward[-1]`` with the loss.
    ``unlossed_last``: the last stage's (forward, backward) seconds without the loss (its
    outputs summed), to compare with runs that have no loss. ``sizes``: bytes per stage;
    ``stashes``: each stage's byte repetition, ``last_input`` the last stage's input as the
    pass handed it over (None for one stage: the model's call) and ``with_loss`` whether the
    last stage's bytes include a ``loss_fn`` (:func:`sizes_without_loss` reuses them).
    """

    times: StageTimes | None = None
    split: StageTimes | None = None
    unlossed_last: tuple[float, float] | None = None
    sizes: ModelSizes | None = None
    stashes: tuple[StashBytes, ...] = ()
    last_input: wire.Split | None = None
    with_loss: bool = False


def measure_stages(stages: Sequence[torch.nn.Module], args: tuple[Any, ...],
                   kwargs: dict[str, Any] | None = None,
                   loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
                   kinds: Sequence[Kind] = (), repeats: int = 5, warmup: int = 2,
                   sizes: bool = False, optimizer_factor: float = 0.0) -> StageMeasurement:
    """Measure every stage on one microbatch (``args``/``kwargs``, one call of the model).

    ``kinds``: the timed repetitions' backwards (``"whole"``, ``"split"``, ``"unlossed"``;
    none: no timing), ``warmup`` untimed runs then ``repeats`` of each kind per stage (medians;
    ``"unlossed"`` differs from ``"whole"`` on the last stage only: elsewhere it is "whole").
    ``sizes``: one byte repetition per stage (``optimizer_factor``: optimizer-state bytes per
    trainable parameter byte). ``loss_fn`` maps the last stage's output to the loss.
    Stage ``s`` runs ``warmup + repeats * k`` times for its seconds (``k``: its distinct kinds,
    ``"unlossed"`` counting on the last stage only) plus, with
    ``sizes``, once (twice when ``s > 0``: the input as received too), each a forward and,
    but for the received input, a backward. Nothing is left behind: no ``.grad``, and buffers
    (BatchNorm statistics) and the RNG streams are restored.
    """
    if not stages:
        raise PartitionError("measuring the stages needs at least one stage")
    kwargs = kwargs or {}
    count = len(stages)
    device = next((t.device for t in pytree.tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor)), None)
    samples: list[dict[Kind, KindSamples]] = []
    stashes: list[StashBytes] = []
    handed: wire.Split | None = None  # the previous stage's output as handed over
    last_input: wire.Split | None = None
    with torch.enable_grad(), ExitStack() as preserved:
        for stage in stages:
            preserved.enter_context(preserved_tensors_and_rng(stage))
        if any(has_meta_parameters(stage) for stage in stages):
            # sized on meta tensors: attention as the device's fused kernel saves it
            preserved.enter_context(fused_attention_on_meta())
        for s, stage in enumerate(stages):
            last_input = handed
            call = _local_call(args, kwargs, handed)
            # before the last stage there is no loss to leave out: "unlossed" is "whole"
            stage_kinds = list(dict.fromkeys(
                "whole" if k == "unlossed" and s < count - 1 else k for k in kinds))
            timed: wire.Split | None = None
            if stage_kinds and repeats > 0:
                per_kind, timed = time_stage(stage, s, count, call, loss_fn, stage_kinds,
                                             repeats, warmup, device)
                samples.append(per_kind)
            if sizes:
                message = None if handed is None else (_received(handed, device),)
                call_args, call_kwargs, leaves = call()
                stash, handed = size_stage(stage, s, count, call_args, call_kwargs, leaves,
                                           message, loss_fn)
                stashes.append(stash)
            else:
                handed = timed
    return StageMeasurement(
        times=_times(samples, "whole") if "whole" in kinds and samples else None,
        split=_times(samples, "split") if "split" in kinds and samples else None,
        unlossed_last=(median(samples[-1]["unlossed"].forward),
                       median(samples[-1]["unlossed"].backward))
        if "unlossed" in kinds and samples else None,
        sizes=model_sizes(stages, stashes, tensor_bytes((args, kwargs)), optimizer_factor)
        if sizes else None,
        stashes=tuple(stashes), last_input=last_input if sizes else None,
        with_loss=loss_fn is not None)


def sizes_without_loss(measured: StageMeasurement, stages: Sequence[torch.nn.Module],
                       args: tuple[Any, ...], kwargs: dict[str, Any],
                       optimizer_factor: float) -> ModelSizes:
    """``measure_stage_bytes(stages, args, kwargs, optimizer_factor=...)`` from a pass that
    measured the same cut on the same microbatch (``measured``, with sizes), running only what
    differs: the loss runs on the last stage alone, so every other stage's bytes are the pass's
    and the last stage is sized again without the loss, on the input the pass handed it (one
    byte repetition of one stage; none when the pass had no loss). ``stages`` are the cut's
    (their parameters are sized here: another partition of the same cut will do).
    """
    if not measured.stashes or len(measured.stashes) != len(stages):
        raise PartitionError(f"sizes_without_loss: the pass sized {len(measured.stashes)} "
                             f"stages, not the {len(stages)} given; measure them with "
                             "measure_stage_bytes instead")
    stashes = list(measured.stashes)
    if measured.with_loss:
        count = len(stages)
        device = next((t.device for t in pytree.tree_leaves((args, kwargs))
                       if isinstance(t, torch.Tensor)), None)
        handed = measured.last_input
        call_args, call_kwargs, leaves = _local_call(args, kwargs, handed)()
        message = None if handed is None else (_received(handed, device),)
        with torch.enable_grad(), preserved_tensors_and_rng(stages[-1]):
            stashes[-1], _ = size_stage(stages[-1], count - 1, count, call_args, call_kwargs,
                                        leaves, message, None)
    return model_sizes(stages, stashes, tensor_bytes((args, kwargs)), optimizer_factor)


def profile_stages(stages: Sequence[torch.nn.Module], args: tuple[Any, ...],
                   kwargs: dict[str, Any] | None = None,
                   loss_fn: Callable[[Any], torch.Tensor] | None = None, repeats: int = 5,
                   warmup: int = 2, split_backward: bool = False) -> StageTimes:
    """Time each stage's forward and backward on one microbatch (``args``/``kwargs``).

    ``stages``: a :class:`~lightning_gsched.partition.Partition`'s ``stages``. ``loss_fn`` maps
    the last stage's output to the scalar the backward starts from (the step's loss; without
    it the output's sum is used). The backward of a stage is timed from the gradient of its
    outputs (random, the shape a pipeline would receive) to the gradients of its inputs and
    parameters. Medians over ``repeats`` runs after ``warmup`` runs. ``split_backward``: time
    the backward as the zero-bubble runtime runs it, B (input gradients) then W (weight
    gradients), reported as ``backward`` and ``weight``. The measuring pass with seconds only.
    """
    if not stages:
        raise PartitionError("profile_stages needs at least one stage")
    if repeats < 1:
        raise PartitionError(f"profile_stages: repeats={repeats} leaves nothing to time; give "
                             "repeats >= 1 (the default is 5)")
    kind: Kind = "split" if split_backward else "whole"
    measured = measure_stages(stages, args, kwargs, loss_fn, kinds=(kind,), repeats=repeats,
                              warmup=warmup)
    times = measured.split if split_backward else measured.times
    assert times is not None
    return times


def measure_stage_bytes(stages: Sequence[torch.nn.Module], args: tuple[Any, ...],
                        kwargs: dict[str, Any] | None = None,
                        loss_fn: Callable[[Any], torch.Tensor] | None = None,
                        optimizer_factor: float = 0.0) -> ModelSizes:
    """Each stage's parameter, gradient, optimizer, stashed-activation and message bytes.

    ``args``/``kwargs``: one microbatch, as one call of the model's forward. ``loss_fn``: maps
    the last stage's output to the loss (what the last stage's forward also stashes); without
    it the output's sum. ``optimizer_factor``: optimizer-state bytes per trainable parameter
    byte (``runtime.footprint.optimizer_factor(optimizer)``: 2 for Adam, 1 for SGD with
    momentum). The measuring pass with bytes only: no ``.grad`` is left, and buffers such as
    BatchNorm statistics and the RNG streams are restored (a run measured first draws the same
    dropout masks as one that was not).
    """
    if not stages:
        raise PartitionError("measure_stage_bytes needs at least one stage")
    measured = measure_stages(stages, args, kwargs, loss_fn, sizes=True,
                              optimizer_factor=optimizer_factor)
    assert measured.sizes is not None
    return measured.sizes


def _local_call(args: tuple[Any, ...], kwargs: dict[str, Any],
                handed: wire.Split | None) -> StageCall:
    """A stage's input as the runtime builds it when its producer runs on the same rank:
    the model's call for the first stage, else fresh detached leaves of the producer's output
    (requiring grad where it did), new ones for every run."""
    def call() -> tuple[tuple[Any, ...], dict[str, Any], list[torch.Tensor]]:
        if handed is None:
            return args, kwargs, []
        leaves = wire.detached_leaves(handed.tensors)
        return (wire.join(handed.structure, leaves),), {}, leaves
    return call


def _received(handed: wire.Split, device: torch.device | None) -> Any:
    """The producer's output as a receiver on another rank gets it: one fresh buffer per
    tensor (``wire.received_copy``)."""
    where = handed.tensors[0].device if handed.tensors else (device or torch.device("cpu"))
    message, _ = wire.received_copy(handed, where)
    return message


def _times(samples: list[dict[Kind, KindSamples]], kind: Kind) -> StageTimes:
    """One kind's medians per stage; the forward pools the whole and split runs (the same
    computation, timed the same way)."""
    forward = [median([*per.get("whole", KindSamples()).forward,
                       *per.get("split", KindSamples()).forward]) for per in samples]
    backward = [median(per[kind].backward) for per in samples]
    weight = [median(per[kind].weight) for per in samples] if kind == "split" else []
    return StageTimes(forward, backward, weight)
