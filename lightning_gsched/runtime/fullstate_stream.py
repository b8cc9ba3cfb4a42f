"""A full checkpoint's tensors sent to rank 0 one at a time, in one order every rank knows.

Why: :mod:`.fullstate` gathers the whole model and every optimizer state entry onto rank 0
before anything is written, so rank 0 briefly holds the model and its optimizer state, which a
model larger than one rank cannot afford. Here saving is two steps:

1. *Describe* (collective, no tensor data moves): :func:`describe_state_dict` gives rank 0 the
   module's state dict with each parameter a :class:`StreamedTensor` placeholder (shape, dtype,
   where it comes from); :func:`describe_optimizer_state` gathers from every rank a small
   description of its primary optimizer entries (tensors as shape/dtype; tiny ones such as
   Adam's ``step`` as values) and gives rank 0 ``optimizer.state_dict()``'s full form with
   placeholders. Every rank records in a :class:`StreamPlan` what it will send.
2. *Transfer* (collective): :func:`transfer` walks the plan, weight units in
   :func:`.layout.weight_units` order (as :func:`.fullstate.full_state_dict`), then optimizers in
   the order described, source ranks in order, each source's entries in its description's
   order. The owner sends, rank 0 hands each tensor to ``sink(placeholder, tensor)`` (which
   writes it) and drops it before the next: rank 0 holds at most one weight unit's buffer
   received from another rank (or one optimizer tensor) besides what it already keeps.

Gathering the model's state dict (:func:`full_state_dict`) is the same transfer with every
tensor kept and put in place of its placeholder (:func:`fill_placeholders`), so the gathered and
the streamed checkpoint cannot differ in what they hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_gsched.runtime.flat import FlatStage
from lightning_gsched.runtime.fullstate import StageBuffers, parameter_names
from lightning_gsched.runtime.layout import weight_units

# an optimizer tensor of at most this many bytes travels in the description, as a value
SMALL_TENSOR_BYTES = 64


class StreamedTensor:
    """A tensor of a full checkpoint that rank 0 receives only while the file is written.

    Stands where ``torch.save`` would find the tensor (``checkpoint["state_dict"]`` values,
    optimizer state entries); the streaming writer pickles it as the tensor it will be. ``seq``
    is its place in the transfer order (unique within one save).
    """

    __slots__ = ("shape", "dtype", "source", "where", "seq")

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, source: int, where: str,
                 seq: int) -> None:
        self.shape = tuple(int(n) for n in shape)
        self.dtype = dtype
        self.source = source
        self.where = where
        self.seq = seq

    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    def __repr__(self) -> str:
        return (f"StreamedTensor(shape={self.shape}, dtype={self.dtype}, from rank "
                f"{self.source}, {self.where})")


Sink = Callable[[StreamedTensor, torch.Tensor], None]


@dataclass
class _Unit:
    src: int
    flat: FlatStage
    placeholders: list[StreamedTensor | None]  # rank 0: one per parameter view, else []


@dataclass
class _Source:
    rank: int
    count: int  # tensors it sends
    placeholders: list[StreamedTensor] = field(default_factory=list)  # rank 0
    tensors: list[torch.Tensor] = field(default_factory=list)  # on the source itself


@dataclass
class StreamPlan:
    """What one save transfers, the same sequence on every rank (each knows its own part)."""

    rank: int
    world_size: int
    device: torch.device = torch.device("cpu")  # where rank 0 receives
    units: list[_Unit] = field(default_factory=list)
    optimizers: list[list[_Source]] = field(default_factory=list)
    count: int = 0  # placeholders made so far (rank 0)

    def placeholder(self, shape: Sequence[int], dtype: torch.dtype, source: int,
                    where: str) -> StreamedTensor:
        self.count += 1
        return StreamedTensor(shape, dtype, source, where, self.count - 1)


def describe_state_dict(module: nn.Module, stages: StageBuffers,
                        world_size: int) -> tuple[dict[str, Any], StreamPlan]:
    """Rank 0: the module's state dict, every parameter held in a weight unit a placeholder
    (buffers and parameters outside the units stay real); other ranks: ``{}``. No collective."""
    rank = stages.rank
    units = weight_units(stages.programs, stages.flats, stages.ties)
    plan = StreamPlan(rank, world_size, units[0][1].device if units else torch.device("cpu"))
    names = parameter_names(module)
    state = module.state_dict() if rank == 0 else {}
    for i, (owners, flat) in enumerate(units):
        if not flat.numel:
            continue
        unit = _Unit(owners[0], flat, [])
        plan.units.append(unit)
        if rank != 0:
            continue
        for j, p in enumerate(flat.params):
            where = f"{flat.kind} {flat.index} (weight unit {i}) offset {flat.offsets[j]}"
            ph = plan.placeholder(flat.shapes[j], flat.dtype, unit.src, where)
            unit.placeholders.append(ph)
            for name in names.get(id(p), []):
                state[name] = ph  # a tied parameter: one placeholder under each name
    return state, plan


def _describe_entries(optimizer: Optimizer, primary: Sequence[nn.Parameter],
                      ) -> tuple[dict[int, dict[str, Any]], list[torch.Tensor]]:
    """This rank's primary entries with each sent tensor as ``("tensor", shape, dtype)``, and
    those tensors in the order described."""
    state = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    wanted = {id(p) for p in primary}
    described: dict[int, dict[str, Any]] = {}
    tensors: list[torch.Tensor] = []
    for index, entry in state["state"].items():
        if id(params[index]) not in wanted:
            continue
        out: dict[str, Any] = {}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and (
                    value.numel() * value.element_size() > SMALL_TENSOR_BYTES):
                out[key] = ("tensor", tuple(value.shape), value.dtype)
                tensors.append(value.detach())
            elif isinstance(value, torch.Tensor):
                out[key] = ("value", value.detach().cpu().clone())
            else:
                out[key] = ("value", value)
        described[index] = out
    return described, tensors


def describe_optimizer_state(plan: StreamPlan, optimizer: Optimizer,
                             primary: Sequence[nn.Parameter]) -> dict[str, Any]:
    """Rank 0: ``optimizer.state_dict()`` with every parameter's state, tensors as
    placeholders; ``{}`` elsewhere (collective: one small object gather). Adds the optimizer to
    ``plan``'s transfer."""
    rank, world_size = plan.rank, plan.world_size
    state = optimizer.state_dict()
    mine, tensors = _describe_entries(optimizer, primary)
    gathered: list[Any] = [mine]
    if world_size > 1:
        gathered_or_none: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(mine, gathered_or_none, dst=0)
        gathered = gathered_or_none or []
    k = len(plan.optimizers)
    sources: list[_Source] = []
    merged: dict[int, Any] = {}
    for src in range(world_size):
        if rank != 0:  # only the source itself knows its count; rank 0 needs nothing here
            if src == rank:
                sources.append(_Source(src, len(tensors), tensors=tensors))
            continue
        source = _Source(src, 0, tensors=tensors if src == 0 else [])
        for index, entry in gathered[src].items():
            out = {}
            for key, (kind, *rest) in entry.items():
                if kind == "tensor":
                    shape, dtype = rest
                    out[key] = plan.placeholder(
                        shape, dtype, src, f"optimizer {k} state of parameter {index} {key!r}")
                    source.placeholders.append(out[key])
                else:
                    out[key] = rest[0]
            merged[index] = out
        source.count = len(source.placeholders)
        sources.append(source)
    plan.optimizers.append(sources)
    if rank != 0:
        return {}
    return {"state": dict(sorted(merged.items())), "param_groups": state["param_groups"]}


def transfer(plan: StreamPlan, sink: Sink | None,
             on_hold: Callable[[int], None] | None = None) -> None:
    """Send every planned tensor to rank 0 in the plan's order (collective). Rank 0 calls
    ``sink(placeholder, tensor)`` for each (the tensor is valid during the call only);
    ``on_hold(bytes)`` is told the bytes rank 0 holds for the transfer (a received buffer)."""
    rank = plan.rank
    for unit in plan.units:
        flat = unit.flat
        if rank == unit.src and rank != 0:
            assert flat.flat is not None
            dist.send(flat.flat.detach().contiguous(), 0)
        if rank != 0:
            continue
        if unit.src == 0:
            assert flat.flat is not None
            buffer = flat.flat.detach()
        else:
            buffer = torch.empty(flat.numel, dtype=flat.dtype, device=flat.device)
            if on_hold is not None:
                on_hold(buffer.numel() * buffer.element_size())
            dist.recv(buffer, unit.src)
        for ph, (_, view) in zip(unit.placeholders, flat.views(buffer), strict=True):
            if ph is not None and sink is not None:
                sink(ph, view)
        del buffer
        if on_hold is not None:
            on_hold(0)
    for sources in plan.optimizers:
        for source in sources:
            if rank != 0:  # rank 0 only sends to itself: no message
                for tensor in source.tensors:
                    dist.send(tensor.contiguous(), 0)
                continue
            for i, ph in enumerate(source.placeholders):
                if source.rank == 0:
                    tensor = source.tensors[i]
                else:
                    tensor = torch.empty(ph.shape, dtype=ph.dtype, device=plan.device)
                    if on_hold is not None:
                        on_hold(tensor.numel() * tensor.element_size())
                    dist.recv(tensor, source.rank)
                if sink is not None:
                    sink(ph, tensor)
                del tensor
                if on_hold is not None:
                    on_hold(0)


def keep_all(plan: StreamPlan) -> dict[int, torch.Tensor]:
    """Run the transfer keeping every tensor (copies) on rank 0, by ``id(placeholder)``
    (collective): rank 0 then holds them all, as a gathered checkpoint does."""
    kept: dict[int, torch.Tensor] = {}

    def keep(placeholder: StreamedTensor, tensor: torch.Tensor) -> None:
        kept[id(placeholder)] = tensor.detach().clone()

    transfer(plan, keep)
    return kept


def fill_placeholders(obj: Any, tensors: Mapping[int, torch.Tensor]) -> Any:
    """``obj`` with every placeholder replaced by ``tensors[id(placeholder)]``, in place for
    dicts and lists (a state dict keeps its type and ``_metadata``)."""
    if isinstance(obj, StreamedTensor):
        return tensors[id(obj)]
    if isinstance(obj, dict):
        for key, value in obj.items():
            obj[key] = fill_placeholders(value, tensors)
        return obj
    if isinstance(obj, list):
        obj[:] = [fill_placeholders(v, tensors) for v in obj]
        return obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(fill_placeholders(v, tensors) for v in obj)
    return obj


def full_state_dict(module: nn.Module, stages: StageBuffers,
                    world_size: int) -> dict[str, Any]:
    """The module's full state dict on rank 0, ``{}`` elsewhere (collective): the streamed
    transfer, every tensor kept (a tied parameter is one tensor under each of its names)."""
    state, plan = describe_state_dict(module, stages, world_size)
    filled: dict[str, Any] = fill_placeholders(state, keep_all(plan))
    return filled
