"""Tensor parallelism inside a stage: torch's own styles, applied to each stage after the split.

Why this shape: Lightning users already write tensor-parallel plans for ``ModelParallelStrategy``
as ``parallelize_module(model, mesh["tensor_parallel"], {"blocks.*.attn.qkv": ColwiseParallel(),
...})``, and torchtitan applies one plan to every pipeline stage. A stage keeps the model's
original module names (:mod:`.stage`), so the same patterns resolve on every stage; each stage
gets the entries that name one of its modules, and a pattern that names no module of any stage
is an error here (torch only warns and skips it, which leaves a layer silently replicated).

Styles are torch's :class:`~torch.distributed.tensor.parallel.ParallelStyle` objects, or by name
where a YAML/JSON config cannot hold objects: ``"colwise"``, ``"rowwise"``, ``"sequence"``. A
plan may instead be a function ``parallelize(stage_module, tp_mesh)`` called once per stage.

Checked before anything is sharded, each naming the module and the fix: a column- or row-wise
style on a module it cannot shard (torch's styles shard ``nn.Linear`` and ``nn.Embedding``), an
embedding styled so that its output stays sharded on the embedding dimension, and a sharded
dimension the tensor-parallel size does not divide (even shards keep every rank's
compute, bytes and messages equal, which the planner's costs assume).

After sharding, every parameter torch made a ``DTensor`` is kept as a plain ``nn.Parameter``
holding this rank's shard, under its own name, and the module sees a ``DTensor`` view of it
(``DTensor.from_local``) only while its forward runs (:func:`keep_shards_local`). Why: the
runtime's flat buffers, weight fetches, gradient reductions, optimizers and byte measurements
work on plain tensors, and a ``DTensor`` parameter's storage cannot be re-pointed through
torch's public API; autograd through ``from_local`` gives the plain parameter its shard's
gradient (a replicated parameter's partial gradients are reduced there, as ``SequenceParallel``
needs). Where each local tensor sits in the full one is kept (:func:`shard_specs`) for
checkpoints and pretrained weights.
"""

from __future__ import annotations

import fnmatch
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence, TypeVar, Union, cast

import torch
from torch import nn

from lightning_gsched.partition.errors import PartitionError
from lightning_gsched.partition.names import close_matches

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

# the styles a YAML/JSON plan names (style_of): torch's, and the sequence-parallel variants
STYLE_NAMES = ("colwise", "rowwise", "sequence", "colwise_from_sequence", "rowwise_to_sequence",
               "sequence_input", "sequence_output", "sequence_gather", "head_norm")
_T = TypeVar("_T")

# A plan as a user gives it: module-name patterns -> styles (objects or names), or a function
# that parallelizes one stage in place on the tensor-parallel mesh.
TensorParallelPlan = Union[Mapping[str, Any], Callable[[nn.Module, "DeviceMesh"], Any]]


class TensorParallelPlanError(PartitionError, ValueError):
    """A tensor-parallel plan that names no module, a style that does not fit its module, or a
    size the tensor-parallel degree does not divide."""


def style_of(name_or_style: Any, pattern: str) -> ParallelStyle:
    """A torch style object from a plan entry's value (an object, or one of STYLE_NAMES).

    The names beyond torch's three spell Megatron-style sequence parallelism in a config that
    cannot hold objects: ``"colwise_from_sequence"`` (column-wise, its input split along the
    sequence and gathered), ``"rowwise_to_sequence"`` (row-wise, its output reduce-scattered
    along the sequence), ``"sequence_input"`` (the module's first input cut to this rank's part
    of the sequence, :class:`.sequence_input.SequenceInput`), ``"sequence_output"`` (the
    module's output joined whole again) and ``"sequence_gather"`` (a module's first input
    gathered once for the plain column-wise layers inside it,
    :class:`.sequence_input.SequenceGather`); docs/tensor_parallel.md has a plan. One more
    names a norm applied to each head of a column-wise projection, its input laid out
    (batch, sequence, heads, head_dim): ``"head_norm"`` (``SequenceParallel`` over dimension
    2, so the norm's weight gradient is summed over the ranks; :mod:`.replicated_grads`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    from lightning_gsched.partition.sequence_input import SequenceGather, SequenceInput

    if isinstance(name_or_style, ParallelStyle):
        return name_or_style
    by_name: dict[str, Callable[[], ParallelStyle]] = {
        "colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel,
        "colwise_from_sequence": lambda: ColwiseParallel(input_layouts=Shard(1)),
        "rowwise_to_sequence": lambda: RowwiseParallel(output_layouts=Shard(1)),
        "sequence_input": SequenceInput, "sequence_gather": SequenceGather,
        "sequence_output": lambda: PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True),
        "head_norm": lambda: SequenceParallel(sequence_dim=2, use_local_output=True)}
    if isinstance(name_or_style, str) and name_or_style.lower() in by_name:
        return by_name[name_or_style.lower()]()
    raise TensorParallelPlanError(
        f"tensor_parallel_plan[{pattern!r}] = {name_or_style!r} is not a tensor-parallel style. "
        f"Give one of torch's styles (ColwiseParallel(), RowwiseParallel(), SequenceParallel(), "
        f"PrepareModuleInput(...), ...) or its name: {', '.join(map(repr, STYLE_NAMES))}")


def check_plan(degree: int, plan: Any) -> TensorParallelPlan | None:
    """A front end's ``tensor_parallel_size`` and ``tensor_parallel_plan``, checked before any
    process starts: a plan exactly when the size is above 1, and its styles known (patterns
    are checked against the stages at the build, when the modules exist)."""
    if degree == 1:
        if plan is not None:
            raise TensorParallelPlanError(
                "tensor_parallel_plan is given but tensor_parallel_size=1, so nothing would be "
                "sharded: set tensor_parallel_size to the ranks each stage is shared by (e.g. "
                "2), or drop tensor_parallel_plan")
        return None
    if plan is None:
        raise TensorParallelPlanError(
            f"tensor_parallel_size={degree} needs a tensor_parallel_plan saying how a stage's "
            "layers are sharded: module-name patterns to styles, e.g. {'blocks.*.attn.q': "
            "'colwise', 'blocks.*.attn.k': 'colwise', 'blocks.*.attn.v': 'colwise', "
            "'blocks.*.attn.proj': 'rowwise'}, or a function "
            "parallelize(stage_module, tp_mesh)")
    if callable(plan):
        return cast(TensorParallelPlan, plan)
    if not isinstance(plan, Mapping) or not plan:
        raise TensorParallelPlanError(
            f"tensor_parallel_plan must be a non-empty dict of module-name patterns to styles "
            f"or a function parallelize(stage_module, tp_mesh), not {plan!r}")
    for pattern, style in plan.items():
        if not isinstance(pattern, str):
            raise TensorParallelPlanError(
                f"tensor_parallel_plan key {pattern!r} is not a module-name pattern (a str "
                "such as 'blocks.*.attn.qkv')")
        style_of(style, pattern)
    return dict(plan)


def name_matches(pattern: str, name: str) -> bool:
    """``parallelize_module``'s rule: as many dotted parts, each matched by ``fnmatch``."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(map(fnmatch.fnmatchcase, names, parts))


def kept_whole(module: nn.Module, plan: TensorParallelPlan) -> tuple[str, ...]:
    """The module names the split keeps whole for ``plan``: every module a pattern names, and
    the module holding it (not the root, nor a container: a ``ModuleList`` or ``ModuleDict`` is
    never called, and a ``Sequential`` may hold every block of the model). None for a function
    plan, whose modules are not known before it runs.

    Why the holders: a module sharded by the plan hands its holder local sizes (this rank's
    heads), and the holder's code, run as written, computes with them (``view(b, t, -1, d)``,
    or sizes read from the tensor: ``b, h, t, d = q.shape``). A traced stage replays the
    holder's code instead, and where the trace had to fix sizes to the example's (the
    static-shape mode, which e.g. transformers' models need for their mask code) it would
    replay the global head count: a shape error on the shard, or a broadcast that hides one.
    Why the styled modules: a style acts through the module's hooks, which run only where the
    stage calls the module (a block styled ``sequence_input`` must not be traced into)."""
    if callable(plan):
        return ()
    holders = kept_holders(module, plan)
    kept: list[str] = []
    for name, _ in module.named_modules():
        if name and any(name_matches(p, name) for p in plan):
            kept.append(name)
            if name.rpartition(".")[0] in holders:
                kept.append(name.rpartition(".")[0])
    return tuple(dict.fromkeys(kept))


def kept_holders(module: nn.Module, plan: TensorParallelPlan) -> dict[str, list[str]]:
    """The holders :func:`kept_whole` keeps whole, each with the styled modules in it that make
    it so (their output is sharded: the holder's own code sees local sizes)."""
    if callable(plan):
        return {}
    modules = dict(module.named_modules())
    holders: dict[str, list[str]] = {}
    for name in modules:
        pattern = next((p for p in plan if name and name_matches(p, name)), None)
        if pattern is None:
            continue
        holder = name.rpartition(".")[0]
        if holder and _holder_sees_local_sizes(plan[pattern], pattern, modules[holder]):
            holders.setdefault(holder, []).append(name)
    return holders


def too_few_units(error: Exception, holders: Mapping[str, list[str]]) -> str:
    """The refusal of a split that :func:`kept_whole`'s holders left with too few units: with
    a pipeline of several stages, a style whose output is sharded on a module the network
    holds directly keeps the network whole (its code would see local sizes)."""
    listed = "; ".join(f"{holder!r} (for {', '.join(map(repr, styled))})"
                       for holder, styled in holders.items())
    return (
        f"{error}. The tensor_parallel_plan keeps whole every module holding a module it "
        f"styles with a sharded output, since that module's own code then computes on this "
        f"rank's shards: {listed}. With a pipeline of several stages such a holder must not be "
        "the network the stages are cut from: give the network's own modules (embedding, "
        "final norm, head) styles whose output is whole (e.g. ColwiseParallel("
        "output_layouts=Replicate()) on an untied head), or none, and style the modules "
        "inside the blocks; for sequence parallelism, the styles 'sequence_input' on the "
        "first block and 'sequence_output' on the last (docs/tensor_parallel.md)")


def _holder_sees_local_sizes(value: Any, pattern: str, holder: nn.Module) -> bool:
    """Whether :func:`kept_whole` keeps ``holder`` whole for a module in it that the plan's
    ``pattern`` styles with ``value`` (a style or its name). Not a container (a ``ModuleList``
    or ``ModuleDict`` is never called, a ``Sequential`` may hold every block), nor where the
    style gives its output whole (column- or row-wise with a ``Replicate`` output, e.g. an
    untied head ``ColwiseParallel(output_layouts=Replicate())`` held by the network itself):
    the holder then computes with whole sizes, as traced, and kept whole it could be the
    whole network."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(holder, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        return False
    try:
        style = style_of(value, pattern)
    except TensorParallelPlanError:  # refused where the plan is assigned, naming the pattern
        return True
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        layouts = style.output_layouts
        layouts = layouts if isinstance(layouts, tuple) else (layouts,)
        return not all(isinstance(layout, Replicate) for layout in layouts)
    return True


def with_kept_whole(leaf_modules: Sequence[type | str], module: nn.Module,
                    plan: TensorParallelPlan | None) -> tuple[type | str, ...]:
    """``leaf_modules`` and :func:`kept_whole`'s names for ``plan`` (none without a plan), once
    each: what every split of a tensor-parallel model keeps whole (engine, ``gsched tune``)."""
    kept = kept_whole(module, plan) if plan is not None else ()
    return tuple(dict.fromkeys((*leaf_modules, *kept)))


def assign_plan(plan: Mapping[str, Any], stage_modules: Sequence[Sequence[str]]
                ) -> list[dict[str, ParallelStyle]]:
    """Per stage, ``{module name: style}`` for the plan's patterns.

    ``stage_modules``: each stage's module names (``named_modules`` of the stage; the model's
    own names). A pattern matching no module of any stage, or a module matched by two patterns,
    raises :class:`TensorParallelPlanError`.
    """
    styles = {pattern: style_of(value, pattern) for pattern, value in plan.items()}
    assigned: list[dict[str, ParallelStyle]] = [{} for _ in stage_modules]
    by_module: dict[str, str] = {}
    for pattern, style in styles.items():
        found = False
        for stage, names in zip(assigned, stage_modules, strict=True):
            for name in names:
                if not name or not name_matches(pattern, name):
                    continue
                found = True
                if by_module.setdefault(name, pattern) != pattern:
                    raise TensorParallelPlanError(
                        f"module {name!r} is matched by two tensor_parallel_plan patterns, "
                        f"{by_module[name]!r} and {pattern!r}: make them name disjoint modules")
                stage[name] = style
        if not found:
            known = {n for names in stage_modules for n in names if n}
            hint = close_matches(pattern, known)
            prefixed = sorted({f"{n.split('.')[0]}.{pattern}" for n in known
                               if any(name_matches(f"{n.split('.')[0]}.{pattern}", m)
                                      for m in known)})
            raise TensorParallelPlanError(
                f"tensor_parallel_plan pattern {pattern!r} matches no module of the model. "
                + (f"Did you mean {' or '.join(map(repr, prefixed))}? The names are those of "
                   "the module the strategy holds: under the Trainer the LightningModule, so "
                   "a network held as self.model has names 'model.<...>'. " if prefixed else "")
                + (f"Close matches: {', '.join(map(repr, hint))}. " if hint and not prefixed
                   else "")
                + "Patterns are module names with '*' for one dotted part, as in "
                "parallelize_module (e.g. 'blocks.*.attn.proj'); list the names with "
                "[n for n, _ in model.named_modules()]")
    return assigned


def called_modules(stages: Sequence[nn.Module]) -> set[str] | None:
    """The module names some stage calls as a module (None: not the partitioner's stages, whose
    calls are not known)."""
    found: set[str] = set()
    for stage in stages:
        calls = getattr(stage, "called_modules", None)
        if calls is None:
            return None
        found |= calls()
    return found


def check_called(called: set[str] | None, name: str, module: nn.Module,
                 style: ParallelStyle) -> None:
    """Refuse a style on a module no stage calls as a module (``called``:
    :func:`called_modules`; a stage that only reads a module's weight, e.g. a tied head, does
    not count, but another that calls the module does).

    Why: a style acts through hooks on its module's ``forward`` (its inputs and outputs laid
    out), but the split traces into every module that is not a leaf and runs its code inline,
    so those hooks would never run: the plan would be silently half applied (e.g. a
    ``PrepareModuleInput`` on a transformer block, which sequence parallelism needs)."""
    # a called module runs its own code, its submodules' calls (and their hooks) included
    if called is None or any(name == c or name.startswith(c + ".") for c in called):
        return
    kind = getattr(module, "original_type", type(module).__name__)  # a stage's shell of it
    raise TensorParallelPlanError(
        f"tensor_parallel_plan styles {name!r} ({kind}) with {type(style).__name__}, but the "
        f"split runs {kind}'s code inline (it traced into the module: only its submodules are "
        f"called), so the style's hooks would never run. Keep {kind} whole in the split, "
        f"leaf_modules=({kind!r},), so that the stages call it as a module; or style its "
        "submodules instead")


def _weight_holders(modules: Sequence[Mapping[str, nn.Module]]) -> dict[int, set[str]]:
    """Per parameter (by identity), the names of the modules holding it directly, over every
    stage (a tied weight: two names)."""
    holders: dict[int, set[str]] = {}
    for stage_modules in modules:
        for name, module in stage_modules.items():
            for parameter in module.parameters(recurse=False):
                holders.setdefault(id(parameter), set()).add(name)
    return holders


def check_untied(name: str, module: nn.Module, style: ParallelStyle,
                 holders: Mapping[int, set[str]]) -> None:
    """Refuse a column/row-wise style on a module whose weight another module holds too (tied
    embeddings): sharded for one, the weight is sharded for the other, whose code (an embedding
    lookup of every token, a projection to the whole vocabulary) reads it whole."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return
    for parameter in module.parameters(recurse=False):
        others = sorted(holders.get(id(parameter), set()) - {name})
        if others:
            raise TensorParallelPlanError(
                f"tensor_parallel_plan gives {type(style).__name__} to {name!r}, whose weight is "
                f"tied to {', '.join(map(repr, others))} (one Parameter): sharded for {name!r} it "
                f"would be sharded for {others[0]!r} too, whose code reads it whole. Leave both "
                "out of the plan (replicated), or untie the weight")


def fitted_to_module(style: ParallelStyle, module: nn.Module) -> ParallelStyle:
    """A style the plan gave by name, fitted to the module it lands on: ``"rowwise"`` on an
    ``nn.Embedding`` takes its input whole (``RowwiseParallel(input_layouts=Replicate())``, as
    torchtitan writes it). Why: the name's ``RowwiseParallel()`` takes its input as this rank's
    slice of the last dimension (a column-wise layer's output), and an embedding's input is
    token ids, whole on every rank: torch would gather the ranks' copies into a sequence T
    times as long, and train on it without an error."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    if isinstance(style, RowwiseParallel) and isinstance(module, nn.Embedding):
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=style.output_layouts[0],
                               use_local_output=style.use_local_output)
    return style


def _last_dim_shard(layout: Any) -> bool:
    from torch.distributed.tensor import Shard

    return isinstance(layout, Shard) and layout.dim == -1


def check_fits(name: str, module: nn.Module, style: ParallelStyle, degree: int) -> None:
    """Refuse a column/row-wise style on a module it cannot shard evenly ``degree`` ways, a
    row-wise style on an embedding that takes its token ids as sharded (:func:`fitted_to_module`
    says why; given by name, the style is fitted instead), and a column-wise one on an
    embedding that leaves its output sharded on the last (embedding) dimension (torch's
    default: the layers after an embedding read its output whole; a layout along the sequence,
    ``Shard(1)``, or ``Replicate()`` is a whole activation's layout and passes)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return
    kind = "column" if isinstance(style, ColwiseParallel) else "row"
    shell_of = getattr(module, "original_type", None)
    if shell_of is not None:  # a stage that reads the module's weight without calling it
        raise TensorParallelPlanError(
            f"tensor_parallel_plan gives {type(style).__name__} to {name!r} ({shell_of}), whose "
            "weight a stage reads directly as a tensor without calling the module (a tied "
            "output projection, e.g. F.linear(x, self.wte.weight)): a style lays out only what "
            f"passes through the module, so that read would get this rank's shard. Leave "
            f"{name!r} out of the plan (replicated), or untie the weight")
    if isinstance(module, nn.Linear):
        # a Linear's weight is (out, in): column-wise shards the outputs, row-wise the inputs
        dim, size = (("out_features", module.out_features) if kind == "column"
                     else ("in_features", module.in_features))
    elif isinstance(module, nn.Embedding):
        dim, size = (("embedding_dim", module.embedding_dim) if kind == "column"
                     else ("num_embeddings", module.num_embeddings))
        if kind == "row" and not isinstance(style.input_layouts[0], Replicate):
            raise TensorParallelPlanError(
                f"tensor_parallel_plan gives {name!r} (an Embedding) RowwiseParallel with input "
                f"layout {style.input_layouts[0]}: an embedding's input is token ids, whole on "
                "every rank, which that style would take as this rank's slice and gather into "
                "a longer sequence. Give RowwiseParallel(input_layouts=Replicate()) (or the "
                "name 'rowwise', which means that on an Embedding)")
        if kind == "column" and _last_dim_shard(style.output_layouts[0]):
            raise TensorParallelPlanError(
                f"tensor_parallel_plan gives {name!r} (an Embedding) ColwiseParallel with output "
                f"layout {style.output_layouts[0]}: column-wise shards the embedding dimension, "
                "so its output stays sharded on the last dimension, this rank's "
                f"{module.embedding_dim // max(degree, 1)} of {module.embedding_dim} features, "
                "and the code after it (a norm, a residual add, a block's first layer) reads "
                "that slice as the whole activation. Give "
                "ColwiseParallel(output_layouts=Replicate()) (the output gathered whole), or "
                "shard it row-wise over the vocabulary as torchtitan does for token embeddings: "
                "RowwiseParallel(input_layouts=Replicate()) (the name 'rowwise' on an Embedding)")
    else:
        inside = [n for n, m in module.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
        fix = (f"Name the Linear/Embedding inside it ({', '.join(f'{name}.{n}' for n in inside[:3])})"
               if inside else f"A {type(module).__name__} holds no Linear or Embedding to "
               "shard" + (" (transformers' Conv1D is a Linear with its weight transposed, "
                          "which torch's styles do not shard)"
                          if type(module).__name__ == "Conv1D" else "")
               + ": leave it out of the plan (replicated)")
        raise TensorParallelPlanError(
            f"tensor_parallel_plan gives {type(style).__name__} to {name!r}, a "
            f"{type(module).__name__}: {kind}-wise sharding applies to nn.Linear and "
            f"nn.Embedding only. {fix}, or give this module SequenceParallel / "
            "PrepareModuleInput instead")
    if size % degree:
        raise TensorParallelPlanError(
            f"{name!r} ({type(module).__name__}, {dim}={size}) cannot be split {kind}-wise "
            f"into tensor_parallel_size={degree} equal shards: choose a tensor_parallel_size "
            f"that divides {size}, or leave {name!r} out of the plan (replicated)")


def parallelize_stages(stages: Sequence[nn.Module], plan: TensorParallelPlan,
                       mesh: DeviceMesh) -> list[dict[str, ParallelStyle]]:
    """Shard every stage's modules over ``mesh`` (1-D, the tensor-parallel ranks), in place.

    Every check of the whole plan runs before the first module is sharded, so a refused plan
    leaves the model as it was. Returns what each stage received (empty for a function plan).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    originals = _parameters_of(stages)
    if callable(plan):
        for stage in stages:
            with _style_hooks_recorded(stage):
                plan(stage, mesh)
            keep_shards_local(stage, originals)
        return [{} for _ in stages]
    if not isinstance(plan, Mapping):
        raise TensorParallelPlanError(
            f"tensor_parallel_plan must be a dict of module-name patterns to styles or a "
            f"function parallelize(stage_module, tp_mesh), not {type(plan).__name__}")
    modules = [dict(stage.named_modules()) for stage in stages]
    assigned = assign_plan(plan, [list(m) for m in modules])
    named = [pattern for pattern, value in plan.items() if isinstance(value, str)]
    called = called_modules(stages)
    holders = _weight_holders(modules)
    for found, stage_modules in zip(assigned, modules, strict=True):
        for name, style in found.items():
            module = stage_modules[name]
            check_untied(name, module, style, holders)
            if any(name_matches(pattern, name) for pattern in named):
                style = found[name] = fitted_to_module(style, module)
            check_called(called, name, module, style)
            check_fits(name, module, style, mesh.size())
    done: set[int] = set()  # a module two stages share is sharded once
    for stage, found, stage_modules in zip(stages, assigned, modules, strict=True):
        todo = {n: s for n, s in found.items() if id(stage_modules[n]) not in done}
        done.update(id(stage_modules[n]) for n in todo)
        if todo:
            with _style_hooks_recorded(stage):
                parallelize_module(stage, mesh, todo)
                for name, style in todo.items():
                    guard_even_cuts(name, stage_modules[name], style, mesh.size())
    for stage in stages:
        keep_shards_local(stage, originals)
    return assigned


def guard_even_cuts(name: str, module: nn.Module, style: ParallelStyle, degree: int) -> None:
    """Before a ``PrepareModuleInput`` cuts a whole positional input into ``Shard(d)``, refuse a
    dimension ``degree`` does not divide, naming the module, the size and the fix.

    Why: torch cuts it into unequal parts without a word, and the sequence- or row-sharded
    styles after it take every part to be ``size / degree`` long, so the first gather sends
    parts of different sizes and gloo aborts the process (a sequence of 63 at T=2). Our own
    ``sequence_input`` refuses the same in its cut (:mod:`.sequence_input`)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    if not isinstance(style, PrepareModuleInput):
        return
    pairs = zip(style.input_layouts or (), style.desired_input_layouts or (), strict=True)
    cuts = [(i, want.dim) for i, (have, want) in enumerate(pairs)
            if isinstance(want, Shard) and not isinstance(have, Shard)]
    if cuts:
        module.register_forward_pre_hook(partial(_refuse_uneven_cut, name, cuts, degree),
                                         prepend=True)


def _refuse_uneven_cut(name: str, cuts: list[tuple[int, int]], degree: int, module: nn.Module,
                       args: tuple[Any, ...]) -> None:
    for i, dim in cuts:
        x = args[i] if i < len(args) else None
        if isinstance(x, torch.Tensor) and -x.dim() <= dim < x.dim() and x.shape[dim] % degree:
            raise TensorParallelPlanError(
                f"tensor_parallel_plan[{name!r}] cuts input {i} of shape {tuple(x.shape)} along "
                f"dimension {dim} into tensor_parallel_size={degree} parts, but {x.shape[dim]} "
                f"does not divide into {degree} equal parts, which the sharded layers after it "
                f"assume: use a length divisible by {degree} (pad the batch), or a "
                "tensor_parallel_size that divides it")


def _parameters_of(stages: Sequence[nn.Module]) -> dict[tuple[int, str], nn.Parameter]:
    """Every parameter object by (owner module, name), before sharding replaces them."""
    return {(id(owner), name): param for stage in stages for owner in stage.modules()
            for name, param in owner._parameters.items() if param is not None}


@dataclass(frozen=True)
class ShardSpec:
    """Where a rank's local parameter sits in the full one: ``dim`` is split into
    ``mesh.size()`` equal shards in rank order (None: every rank holds all of it)."""

    shape: torch.Size  # the full parameter's
    stride: tuple[int, ...]
    placements: tuple[Any, ...]
    mesh: Any  # DeviceMesh
    dim: int | None


# module -> {parameter name: spec}, for the modules keep_shards_local converted, and the
# hooks that show them as DTensors (removed when the shards are gathered back)
_SHARDED: weakref.WeakKeyDictionary[nn.Module, dict[str, ShardSpec]] = weakref.WeakKeyDictionary()
_HOOKS: weakref.WeakKeyDictionary[nn.Module, tuple[Any, Any]] = weakref.WeakKeyDictionary()


def keep_shards_local(module: nn.Module,
                      originals: Mapping[tuple[int, str], nn.Parameter] | None = None) -> None:
    """Every ``DTensor`` parameter under ``module`` becomes a plain parameter of its local
    shard, seen as a ``DTensor`` during its module's forward (module doc). Idempotent.

    ``originals``: the parameter objects before sharding, by (owner, name). Each shard goes
    back into its original object (``.data``), so an optimizer made before sharding (Lightning
    calls ``configure_optimizers`` before the first batch, when the engine shards) still holds
    the parameters the module trains."""
    from torch.distributed.tensor import DTensor, Shard

    for owner in module.modules():
        found: dict[str, ShardSpec] = {}
        for name, param in list(cast(dict[str, Any], owner._parameters).items()):
            if not isinstance(param, DTensor):
                continue
            shards = [pl.dim for pl in param.placements if isinstance(pl, Shard)]
            found[name] = ShardSpec(param.shape, tuple(param.stride()), tuple(param.placements),
                                    param.device_mesh, shards[0] if shards else None)
            local = param.to_local().detach()
            original = (originals or {}).get((id(owner), name))
            if original is not None and id(original) != id(param):
                original.data = local
                owner._parameters[name] = original
            else:
                owner._parameters[name] = nn.Parameter(local, requires_grad=param.requires_grad)
        if found:
            _SHARDED[owner] = found
            _HOOKS[owner] = (owner.register_forward_pre_hook(_as_dtensors),
                             owner.register_forward_hook(_as_parameters, always_call=True))


def _as_dtensors(owner: nn.Module, args: Any) -> None:
    """Before the forward: the module reads ``DTensor`` views of its local parameters (an
    instance attribute is found before ``nn.Module.__getattr__`` looks in ``_parameters``)."""
    from torch.distributed.tensor import DTensor

    for name, spec in _SHARDED[owner].items():
        owner.__dict__[name] = DTensor.from_local(
            cast(torch.Tensor, owner._parameters[name]), spec.mesh, spec.placements, run_check=False,
            shape=spec.shape, stride=spec.stride)


def _as_parameters(owner: nn.Module, args: Any, output: Any) -> Any:
    """After the forward (also a failed one): the plain parameters again; a row-wise layer's
    output, an all-reduce still in flight, waited for, so a stage sends plain tensors."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor, wait_tensor

    for name in _SHARDED[owner]:
        owner.__dict__.pop(name, None)
    if isinstance(output, AsyncCollectiveTensor):
        # on the wrapper, not its ``wait()`` (which returns the inner tensor, cut from autograd)
        return wait_tensor(output)  # type: ignore[no-untyped-call]
    return None


# the hooks the styles themselves registered (torch's ``distribute_module``: inputs made
# DTensors before the forward, outputs redistributed after), by module: (hook dict, key)
_STYLE_HOOKS: weakref.WeakKeyDictionary[nn.Module, list[tuple[str, int]]] = (
    weakref.WeakKeyDictionary())
_APPLIED = "_distribute_module_applied"  # torch's mark on a module distribute_module sharded
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
# where torch keeps a forward hook's flags, under the same key
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")


@contextmanager
def _style_hooks_recorded(stage: nn.Module) -> Iterator[None]:
    """Record the hooks a style adds to ``stage``'s modules while the body shards them.

    Why: torch never removes them, so a module made whole again would still turn its inputs
    into ``DTensor``s ("got mixed torch.Tensor and DTensor" at its first plain forward: the
    tuner's next cut of the same model, a user's forward after the run)."""
    before = {id(m): {name: set(getattr(m, name)) for name in _HOOK_DICTS}
              for m in stage.modules()}
    yield
    for m in stage.modules():
        seen = before.get(id(m), {})
        added = [(name, key) for name in _HOOK_DICTS for key in getattr(m, name)
                 if key not in seen.get(name, set())]
        if added or getattr(m, _APPLIED, False):
            _STYLE_HOOKS.setdefault(m, []).extend(added)


def forget_shards(module: nn.Module) -> list[tuple[nn.Module, str, ShardSpec]]:
    """Stop showing ``module``'s local parameters as ``DTensor`` views (the hooks go, the
    styles' own too) and return what :func:`keep_shards_local` recorded, ``(owner, parameter
    name, spec)``: the caller makes each parameter whole again (:mod:`.tensor_parallel_state`)."""
    out = []
    for owner in list(module.modules()):
        specs = _SHARDED.pop(owner, None)
        for handle in _HOOKS.pop(owner, ()):
            handle.remove()
        styled = _STYLE_HOOKS.pop(owner, None)
        for name, key in styled or ():
            getattr(owner, name).pop(key, None)
            for flags in _HOOK_FLAGS:
                getattr(owner, flags, {}).pop(key, None)
        if styled is not None:  # torch refuses to distribute a module twice: it may be again
            owner.__dict__.pop(_APPLIED, None)
        out += [(owner, name, spec) for name, spec in (specs or {}).items()]
    return out


def shard_specs(module: nn.Module) -> dict[str, ShardSpec]:
    """``{parameter name under module: spec}`` for every sharded parameter it holds."""
    return {f"{prefix}.{name}" if prefix else name: spec
            for prefix, owner in module.named_modules()
            for name, spec in _SHARDED.get(owner, {}).items()}


def sequence_patterns(plan: TensorParallelPlan) -> list[str]:
    """The plan's patterns styled ``SequenceParallel`` (by name or object); none for a
    function plan, whose styles are not known."""
    from torch.distributed.tensor.parallel import SequenceParallel

    if callable(plan):
        return []
    return [pattern for pattern, style in plan.items()
            if isinstance(style_of(style, pattern), SequenceParallel)]


def explain_sharded_failure(stage: nn.Module, degree: int, call: Callable[[], _T],
                            sequence: Sequence[str] = ()) -> _T:
    """``call()`` (a forward of ``stage`` after sharding); an error it raises becomes a
    :class:`TensorParallelPlanError` naming the last of the stage's modules that ran.

    Why: model code that computes with the model's global sizes (a head count, a fused
    projection split by the full width) fails on a shard deep inside the stage's generated code,
    whose traceback names no module; the module that ran last is where the sharded width came
    from, and the fix is in the code reading its output. ``sequence``: the plan's patterns
    sharded by sequence (:func:`sequence_patterns`), whose readers need styles that take that
    layout: the message says so, as the module named is then only where it surfaced."""
    from torch.nn.modules.module import register_module_forward_hook

    from lightning_gsched.errors import GschedError, error_text

    names = {id(m): n for n, m in stage.named_modules() if n}
    last: list[str] = []

    def record(module: nn.Module, args: Any, output: Any) -> None:
        name = names.get(id(module))
        if name is not None:
            last[:] = [name]

    handle = register_module_forward_hook(record)
    try:
        return call()
    except GschedError:
        raise
    except Exception as exc:
        where = f"right after {last[0]!r} ran" if last else "before any of its modules ran"
        holder = ""
        if last and any(n == last[0] or n.startswith(last[0] + ".") for n in shard_specs(stage)):
            where += " (a module the plan shards)"
            holder = _holder_hint(stage, last[0])
        raise TensorParallelPlanError(
            f"a stage's forward fails once sharded tensor_parallel_size={degree} ways, {where}: "
            f"{error_text(exc)}. The model's code must compute with local sizes; the usual "
            "causes: a global count in view/reshape/unflatten (write -1 for the sharded "
            "dimension: view(b, t, -1, head_dim)); a head count the degree does not divide "
            f"(each of the {degree} ranks must hold whole heads); a fused projection split by "
            "the full width (shard q, k and v as separate layers); an operation over a "
            "sharded dimension between a column-wise and a row-wise layer (a norm over the "
            "features of the first one's output sees only this rank's share: leave that pair "
            "whole)"
            + holder + _sequence_hint(sequence)) from exc
    finally:
        handle.remove()


def _holder_hint(stage: nn.Module, name: str) -> str:
    """Where the sharded module ``name``'s holder was traced into, not called: if its code
    reads sizes from its tensors it is right as written, and the trace fixed the example's."""
    holder = name.rpartition(".")[0]
    called = getattr(stage, "called_modules", None)
    if not holder or not callable(called):
        return ""
    parts = holder.split(".")
    if {".".join(parts[:k]) for k in range(1, len(parts) + 1)} & called():
        return ""  # the holder runs as written (it, or a module above it, is called whole)
    module = stage.get_submodule(holder)
    kind = getattr(module, "original_type", type(module).__name__)  # a stage's shell of it
    return (f". If {kind}'s code does so already (e.g. it reads the head count from a "
            f"tensor's shape), the split traced into {holder!r} with the example's sizes fixed: "
            f"keep it whole, leaf_modules=({kind!r},) (GeneralParallel does so by itself for "
            "the holders of a dict plan's modules)")


def _sequence_hint(sequence: Sequence[str]) -> str:
    if not sequence:
        return ""
    return (f". The plan shards {', '.join(map(repr, sequence))} by sequence (SequenceParallel):"
            " their outputs are split along dimension 1, so every module reading them must take "
            "that layout, and every module writing their inputs must give it: "
            "'colwise_from_sequence' (ColwiseParallel(input_layouts=Shard(1))) for the "
            "projections after them and 'rowwise_to_sequence' (RowwiseParallel(output_layouts="
            "Shard(1))) for those before them ('colwise' and 'rowwise' take and give whole, "
            "replicated activations), 'sequence_input' on the first block and "
            "'sequence_output' on the last ('sequence_gather' on an attention gathers once for "
            "its 'colwise' q, k, v)")
