"""The build's check that the sharded stages compute what the whole stages computed.

Why: model code that computes with a global size does not always fail on a shard. With q, k and
v column-wise, ``q.view(b, t, n_head, -1)`` runs on each rank's columns, reading them as
``n_head`` heads of ``head_dim / T``: every real head is cut in half, attention mixes the halves,
and nothing raises. All T ranks compute the same wrong values, so the gradient check
(:mod:`.replicated_grads`) sees nothing either, and the model trains differently from one device
(found by probing: weights 7.5e-4 off after three steps).

So, with tensor parallelism and a model built with weights, each stage runs once forward before
it is sharded and once after (:func:`record_outputs`), on the build's microbatch, in eval mode
(no dropout) and without gradients, buffers and random streams restored. Each call of each of the
stage's modules is summarised (shape, and the sum, absolute sum and sum of squares of each
floating output, in float64), and so is the stage's output. A call whose output keeps its shape
once sharded (a row-wise layer's all-reduced output, a norm, the stage's output; a column-wise
layer's output is a shard and is skipped) must agree with the whole stage's within what
reordered sums explain (:func:`verify.tolerance` of the dtype, relative to the absolute sum).
:func:`check_sharded_outputs` fails the build on every rank of the worker, naming the first call
(in the order the calls finished) that differs and the module whose code ran before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from lightning_gsched.partition.preserve import in_mode, preserved_tensors_and_rng
from lightning_gsched.partition.tensor_parallel import TensorParallelPlanError
from lightning_gsched.partition.verify import tolerance

STAGE_OUTPUT = "<the stage's output>"


@dataclass(frozen=True)
class Summary:
    """One call's floating outputs: per tensor (shape, dtype, sum, |sum|, sum of squares)."""

    stage: int
    name: str  # the module's name in its stage, or STAGE_OUTPUT
    call: int  # how many earlier calls of the same module in the same stage
    tensors: tuple[tuple[tuple[int, ...], torch.dtype, float, float, float], ...]


def _summary(stage: int, name: str, call: int, output: Any) -> Summary:
    from torch.distributed.tensor import DTensor

    tensors = []
    for leaf in pytree.tree_leaves(output):
        # not a DTensor: its local part is a layout a style chose, not a value to compare (a
        # collective's pending result, AsyncCollectiveTensor, is compared: it waits here)
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, DTensor) \
                and leaf.is_floating_point():
            x = leaf.detach().double()
            tensors.append((tuple(leaf.shape), leaf.dtype, float(x.sum()), float(x.abs().sum()),
                            float((x * x).sum())))
    return Summary(stage, name, call, tuple(tensors))


def record_outputs(stages: Sequence[nn.Module], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> list[Summary]:
    """Every module call's and stage's output summary, stage by stage (each stage's input the
    previous one's output), in the order the calls finished. Each module's own hook, added
    last: it sees the output a style's hooks hand on (a local tensor), not the DTensor inside."""
    found: list[Summary] = []
    calls: dict[tuple[int, str], int] = {}

    def record(stage: int, name: str, module: nn.Module, inputs: Any, output: Any) -> None:
        call = calls[(stage, name)] = calls.get((stage, name), -1) + 1
        found.append(_summary(stage, name, call, output))

    handles = [module.register_forward_hook(partial(record, k, name))
               for k, stage in enumerate(stages) for name, module in stage.named_modules()
               if name]
    carried: Any = None
    try:
        with torch.no_grad(), in_mode(stages, False), \
                preserved_tensors_and_rng(nn.ModuleList(stages)):
            for k, stage in enumerate(stages):
                carried = stage(*args, **kwargs) if k == 0 else stage(carried)
                found.append(_summary(k, STAGE_OUTPUT, 0, carried))
    finally:
        for handle in handles:
            handle.remove()
    return found


def _differs(whole: Summary, sharded: Summary) -> str | None:
    """How ``sharded`` differs from ``whole`` where their shapes agree (None: it does not, or
    the output is a shard: another shape)."""
    if len(whole.tensors) != len(sharded.tensors):
        return None
    for (shape, dtype, total, size, squares), (shape2, _, total2, _, squares2) in zip(
            whole.tensors, sharded.tensors, strict=True):
        if shape != shape2:
            continue
        bound = tolerance(dtype) * max(size, 1e-30)
        square_bound = 2 * tolerance(dtype) * max(squares, 1e-30)
        if not (math.isfinite(total2) and math.isfinite(squares2)):
            if math.isfinite(total) and math.isfinite(squares):
                return "non-finite values where the whole stage's are finite"
            continue
        if abs(total2 - total) > bound or abs(squares2 - squares) > square_bound:
            return (f"sum {total2:.6g} against {total:.6g}, sum of squares {squares2:.6g} "
                    f"against {squares:.6g}")
    return None


def first_difference(whole: Sequence[Summary], sharded: Sequence[Summary]) -> str | None:
    """The first call whose output differs once sharded, described; None if none does."""
    by_key = {(s.stage, s.name, s.call): s for s in sharded}
    for before in whole:
        after = by_key.get((before.stage, before.name, before.call))
        if after is None:
            continue
        how = _differs(before, after)
        if how is None:
            continue
        if before.name == STAGE_OUTPUT:
            return f"stage {before.stage}'s output ({how})"
        parent = before.name.rpartition(".")[0]
        around = f", so the code of {parent!r} before it" if parent else ""
        nth = f" (call {before.call + 1})" if before.call else ""
        return (f"the output of {before.name!r}{nth} in stage {before.stage} ({how}): it is "
                f"computed from values that already differ{around} computes with a global "
                "size on this rank's shard")
    return None


def check_sharded_outputs(stages: Sequence[nn.Module], args: tuple[Any, ...],
                          kwargs: dict[str, Any], whole: Sequence[Summary], group: Any) -> None:
    """Fail, on every rank of ``group`` (the worker's T ranks), if a sharded stage computes
    otherwise than the whole one did (``whole``: :func:`record_outputs` before sharding)."""
    mine = first_difference(whole, record_outputs(stages, args, kwargs))
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    found = next((d for d in everyone if d is not None), None)
    if found is not None:
        degree = dist.get_world_size(group)
        raise TensorParallelPlanError(
            f"the stages compute other values once sharded tensor_parallel_size={degree} ways "
            f"than whole, on the build's microbatch (eval mode, no dropout): first {found}. "
            "Nothing failed, so the model would train silently differently from one device. The "
            "usual cause is a head count fixed in view/reshape while the head size is inferred: "
            "view(b, t, n_head, -1) reads each rank's columns as n_head smaller heads; write "
            "view(b, t, -1, head_dim) (local heads), or keep the module whole (leave it out of "
            "the plan)")
