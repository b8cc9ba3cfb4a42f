"""The build's check that a parameter the plan leaves whole gets the same gradient on every rank.

Why: a tensor-parallel plan shards some layers; every other parameter of a stage stays whole on
each of its worker's T ranks, and each rank updates its copy with the gradient it computed. That
is right only where the gradient is the same on every rank, which holds for a parameter that
reads whole (replicated) activations, as a norm before a column-wise layer does. A parameter
that reads this rank's shard (a norm applied to each head of a column-wise projection, as
Qwen3's ``q_norm`` and ``k_norm`` are) gets only its shard's part of the gradient: the copies
drift apart, silently (measured: Qwen3 at T=2, a weight 1.4e-4 off after three steps, every
loss equal). torch's styles fix it by making such a parameter a replicated ``DTensor`` (e.g.
``SequenceParallel`` over the heads' dimension), whose gradient is then summed over the ranks.

So at the build (tensor parallelism only), the sharded stages run once forward and backward on
the build's microbatch, and every parameter left whole has its gradient compared across the T
ranks (two sums of it, in one all-gather); one that differs fails the build on every rank with
:class:`~lightning_gsched.partition.tensor_parallel.TensorParallelPlanError`, naming it and the
fix; the model's output (the last stage's, which the loss reads) is compared the same way, so
a style that leaves it sharded fails too. The same pass is the build's check that the sharded
stages run at all: each forward goes
through :func:`~lightning_gsched.partition.tensor_parallel.explain_sharded_failure`, so a model
whose code needs global sizes fails here on every rank, naming the module, rather than inside a
schedule's step on some ranks. Nothing else changes: the gradients are taken with ``torch.autograd.grad`` (no ``.grad``
is written), and buffers and random streams are restored.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from lightning_gsched.partition.preserve import preserved_tensors_and_rng
from lightning_gsched.partition.tensor_parallel import (
    TensorParallelPlanError,
    explain_sharded_failure,
    shard_specs,
)

# A partial gradient differs from the whole one by a share of its size; reordered float sums
# by a few ulps. Between the two, any tolerance separates them; this one is far from both.
RELATIVE_TOLERANCE = 1e-3
# gradient_sums' entry for the model's output (the last stage's): the same on every rank unless
# a style leaves it sharded (a column-wise head without output_layouts=Replicate())
LAST_OUTPUT = "<the last stage's output>"


def _whole_parameters(stage: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The stage's trainable parameters no style shards nor makes a ``DTensor`` (those are
    in ``shard_specs``, replicated ones included: torch reduces their gradients itself)."""
    styled = set(shard_specs(stage))
    return [(name, p) for name, p in stage.named_parameters()
            if p.requires_grad and name not in styled and p.numel()]


def _scalar(output: Any) -> torch.Tensor | None:
    """A sum of every floating output that needs a gradient (any scalar function will do:
    a partial gradient differs whatever the loss)."""
    leaves = [t for t in pytree.tree_leaves(output)
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    return sum((t.float().sum() for t in leaves), torch.zeros(())) if leaves else None


def _detached(output: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, output)


def gradient_sums(stages: Sequence[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any],
                  degree: int, sequence: Sequence[str] = ()) -> list[tuple[str, float, float]]:
    """``(name, sum, sum of absolute values)`` of each whole parameter's gradient, stage by
    stage on the build's microbatch (each stage's input the previous one's output); a forward
    that fails raises :func:`explain_sharded_failure`'s error (``degree`` ranks; ``sequence``:
    the plan's sequence-sharded patterns)."""
    sums: list[tuple[str, float, float]] = []
    carried: Any = None
    with torch.enable_grad(), preserved_tensors_and_rng(nn.ModuleList(stages)):
        for k, stage in enumerate(stages):
            call = partial(stage, *args, **kwargs) if k == 0 else partial(stage, carried)
            output = explain_sharded_failure(stage, degree, call, sequence)
            carried = _detached(output)
            params = _whole_parameters(stage)
            scalar = _scalar(output)
            if scalar is None or not params:
                continue
            grads = torch.autograd.grad(scalar, [p for _, p in params], allow_unused=True)
            for (name, _), grad in zip(params, grads, strict=True):
                if grad is not None:
                    g = grad.detach().double()
                    sums.append((name, float(g.sum()), float(g.abs().sum())))
    outputs = [t.double() for t in pytree.tree_leaves(carried)
               if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if outputs:  # the last stage's output: whole on every rank, as the loss reads it
        sums.append((LAST_OUTPUT, float(sum(t.sum() for t in outputs)),
                     float(sum(t.abs().sum() for t in outputs))))
    return sums


def check_replicated_gradients(stages: Sequence[nn.Module], args: tuple[Any, ...],
                               kwargs: dict[str, Any], group: Any,
                               sequence: Sequence[str] = ()) -> None:
    """Fail, on every rank of ``group`` (the worker's T ranks), if a sharded stage cannot run
    or a whole parameter's gradient differs between them (collective over ``group``; module
    doc; ``sequence``: the plan's sequence-sharded patterns, named in a failure's fix)."""
    mine = gradient_sums(stages, args, kwargs, dist.get_world_size(group), sequence)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    differing = []
    # by position, not by name: a tied parameter has one gradient sum per stage that reads it
    for k, (name, total, size) in enumerate(mine):
        values = [sums[k][1:] for sums in everyone if k < len(sums) and sums[k][0] == name]
        if len(values) < len(everyone):  # a rank got no gradient there: not the same
            differing.append(name)
            continue
        bound = RELATIVE_TOLERANCE * (max(abs(a) for _, a in values) or 1.0)
        if any(abs(t - total) > bound or abs(a - size) > bound for t, a in values):
            differing.append(name)
    if LAST_OUTPUT in differing:
        raise TensorParallelPlanError(
            "the model's output (the last stage's) differs between the tensor-parallel ranks: a "
            "style leaves it sharded, so the loss would read this rank's slice (e.g. of the "
            "vocabulary: an 'index out of bounds' in the loss, or a wrong loss). Give the last "
            "column-wise layer its output whole, ColwiseParallel(output_layouts=Replicate()) "
            "(torchtitan's output projection), or leave it out of the plan")
    if differing:
        shown = ", ".join(map(repr, differing[:4])) + (
            f" and {len(differing) - 4} more" if len(differing) > 4 else "")
        raise TensorParallelPlanError(
            f"the parameter(s) {shown} stay whole on each tensor-parallel rank, but their "
            "gradient differs between the ranks: they read this rank's shard (e.g. a norm "
            "applied to each head of a column-wise projection), so each rank gets only its "
            "part of the gradient and the copies would drift apart. Give their module a style "
            "that sums the gradient over the ranks: SequenceParallel(sequence_dim=<the heads' "
            "dimension of its input>, use_local_output=True), by name 'head_norm' for a "
            "(batch, sequence, heads, head_dim) input (Qwen3's q_norm and k_norm) or "
            "'sequence' for dimension 1. (Or the model draws random numbers that differ between "
            "the ranks by other means than torch's generators, which the engine aligns within "
            "a worker: e.g. a mask drawn with numpy or Python's random.)")
