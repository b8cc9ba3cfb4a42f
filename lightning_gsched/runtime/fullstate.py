"""The full model and optimizer state from sharded training: gather to rank 0, give back to all.

A checkpoint that loads in one process needs the full state dict under the module's own names,
though no rank holds the whole model nor every optimizer entry: each weight unit comes from its
first owner, each optimizer entry from its parameter's primary rank (:mod:`.ownership`). It
resumes under any schedule and worker count: every rank loads what it holds of the full state and
prunes the optimizer state of parameters it does not own.

Saving streams, so that rank 0 never holds the whole model and its optimizer state at once:
*describe* (no tensor data moves) gives rank 0 the state dicts with each tensor a
:class:`StreamedTensor` placeholder (the optimizer's from one gather of every rank's small
description of its primary entries; tiny tensors such as Adam's ``step`` travel as values), and
every rank a :class:`StreamPlan` of what it will send; :func:`transfer` then walks the plan
(weight units in :func:`.layout.weight_units` order, then optimizers, source ranks in order) and
rank 0 hands each tensor to ``sink`` and drops it before the next. :func:`full_state_dict` is the
same transfer keeping every tensor, so the gathered and the streamed checkpoint cannot differ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_gsched.runtime.flat import FlatStage
from lightning_gsched.runtime.layout import StageBuffers, weight_units

# the workers' process group, read at each use (Channels.workers_group): rank 0 of it is worker 0
Group = Callable[[], Any]


def default_group() -> None:
    """Every rank (torch's default group): the workers' group when each worker is one rank."""
    return None


# an optimizer tensor of at most this many bytes travels in the description, as a value
SMALL_TENSOR_BYTES = 64


def parameter_names(module: nn.Module) -> dict[int, list[str]]:
    """Every state-dict name of each parameter, by id (tied parameters have several)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _primary_entries(optimizer: Optimizer, state: dict[str, Any],
                     primary: Sequence[nn.Parameter]) -> Iterable[tuple[int, dict[str, Any]]]:
    """The entries of ``state`` (``optimizer.state_dict()``) of the ``primary`` parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    wanted = {id(p) for p in primary}
    return ((i, entry) for i, entry in state["state"].items() if id(params[i]) in wanted)


def _cpu_entries(optimizer: Optimizer, state: dict[str, Any],
                 primary: Sequence[nn.Parameter]) -> dict[int, dict[str, Any]]:
    """:func:`_primary_entries` on the CPU, so they can be pickled to other ranks."""
    return {index: {key: value.detach().cpu() if isinstance(value, torch.Tensor) else value
                    for key, value in entry.items()}
            for index, entry in _primary_entries(optimizer, state, primary)}


def _merged(parts: Iterable[dict[int, Any]], param_groups: Any) -> dict[str, Any]:
    merged = {index: entry for part in parts for index, entry in part.items()}
    return {"state": dict(sorted(merged.items())), "param_groups": param_groups}


def full_optimizer_state(optimizer: Optimizer, primary: Sequence[nn.Parameter], rank: int,
                         world_size: int, group: Group) -> dict[str, Any]:
    """The optimizer's state dict with every parameter's state on rank 0, ``{}`` elsewhere.
    ``group()``: the workers' group (group rank = worker, ``Channels.workers_group``)."""
    state = optimizer.state_dict()
    if world_size == 1:
        return state
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(_cpu_entries(optimizer, state, primary), gathered, group=group(),
                       group_dst=0)
    return {} if gathered is None else _merged(gathered, state["param_groups"])


def restore_full_state(stages: StageBuffers, optimizers: Sequence[Optimizer],
                       primary: Sequence[nn.Parameter], world_size: int, group: Group) -> None:
    """Give every rank every stage and every parameter's optimizer state again (collective), e.g.
    when training ends, so the run looks like DDP's to a later save or run: parameters become
    views of a fresh copy of their unit (the runtime, no longer backing them, must not step)."""
    with torch.no_grad():
        for owners, flat in weight_units(stages.programs, stages.flats, stages.ties):
            if not flat.numel:
                continue
            buffer = (flat.flat.detach().clone() if flat.owned  # type: ignore[union-attr]
                      else torch.empty(flat.numel, dtype=flat.dtype, device=flat.device))
            if world_size > 1:
                dist.broadcast(buffer, group=group(), group_src=owners[0])
            for p, view in flat.views(buffer):
                p.data = view
    for optimizer in optimizers:
        state = optimizer.state_dict()
        mine = _cpu_entries(optimizer, state, primary)
        gathered: list[Any] = [mine]
        if world_size > 1:
            gathered = [None] * world_size
            dist.all_gather_object(gathered, mine, group=group())
        optimizer.load_state_dict(_merged(gathered, state["param_groups"]))


def prune_optimizer_state(optimizers: Sequence[Optimizer], keep: Sequence[nn.Parameter]) -> int:
    """Drop the state of parameters not in ``keep``; returns the number of entries dropped."""
    wanted = {id(p) for p in keep}
    dropped = 0
    for optimizer in optimizers:
        for p in [p for p in optimizer.state if id(p) not in wanted]:
            del optimizer.state[p]
            dropped += 1
    return dropped


def load_held_state(module: nn.Module, state: dict[str, Any]) -> None:
    """Load a full state dict into what this rank holds (owned parameters are views of the stage
    buffers); parameters held elsewhere (empty here) are skipped."""
    held_elsewhere = {name for name, p in module.named_parameters(remove_duplicate=False)
                      if p.numel() == 0}
    module.load_state_dict({k: v for k, v in state.items() if k not in held_elsewhere},
                           strict=False)


@dataclass(eq=False, slots=True)
class StreamedTensor:
    """A tensor of a full checkpoint that rank 0 receives only while the file is written: it
    stands where ``torch.save`` would find the tensor, and the streaming writer pickles it as the
    tensor it will be. ``seq``: its place in the transfer order (unique within one save)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    source: int
    where: str
    seq: int

    def __post_init__(self) -> None:
        self.shape = tuple(int(n) for n in self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def __repr__(self) -> str:
        return (f"StreamedTensor(shape={self.shape}, dtype={self.dtype}, from rank "
                f"{self.source}, {self.where})")


Sink = Callable[[StreamedTensor, torch.Tensor], None]


@dataclass
class _Message:
    """One tensor for rank 0: a weight ``unit``'s buffer (one placeholder per parameter view) or
    an optimizer state tensor."""

    src: int
    tensor: torch.Tensor | None  # on the source: what it sends
    placeholders: list[StreamedTensor]  # rank 0
    unit: FlatStage | None = None


@dataclass
class StreamPlan:
    """What one save transfers, in the same order on every rank (each knows its own part)."""

    rank: int
    world_size: int
    group: Group  # the workers' group (group rank = worker), read at each use
    device: torch.device = torch.device("cpu")  # where rank 0 receives optimizer tensors
    messages: list[_Message] = field(default_factory=list)
    optimizers: int = 0
    count: int = 0  # placeholders numbered so far (rank 0)

    def numbered(self, placeholder: StreamedTensor) -> StreamedTensor:
        """``placeholder`` with the next place in the transfer order as its ``seq``."""
        placeholder.seq = self.count
        self.count += 1
        return placeholder


def describe_state_dict(module: nn.Module, stages: StageBuffers, world_size: int,
                        group: Group) -> tuple[dict[str, Any], StreamPlan]:
    """Rank 0: the module's state dict, every parameter held in a weight unit a placeholder
    (buffers and parameters outside the units stay real); other ranks: ``{}``. No collective."""
    rank = stages.rank
    units = weight_units(stages.programs, stages.flats, stages.ties)
    plan = StreamPlan(rank, world_size, group,
                      units[0][1].device if units else torch.device("cpu"))
    names = parameter_names(module)
    state = module.state_dict() if rank == 0 else {}
    for i, (owners, flat) in enumerate(units):
        if not flat.numel:
            continue
        sent = flat.flat.detach() if rank == owners[0] and flat.flat is not None else None
        message = _Message(owners[0], sent, [], flat)
        plan.messages.append(message)
        for j, p in enumerate(flat.params if rank == 0 else []):
            where = f"{flat.kind} {flat.index} (weight unit {i}) offset {flat.offsets[j]}"
            ph = plan.numbered(StreamedTensor(flat.shapes[j], flat.dtype, owners[0], where, -1))
            message.placeholders.append(ph)
            for name in names.get(id(p), []):
                state[name] = ph  # a tied parameter: one placeholder under each name
    return state, plan


def describe_optimizer_state(plan: StreamPlan, optimizer: Optimizer,
                             primary: Sequence[nn.Parameter]) -> dict[str, Any]:
    """Rank 0: ``optimizer.state_dict()`` with every parameter's state, tensors as placeholders;
    ``{}`` elsewhere (collective: one small object gather). Adds the optimizer to ``plan``."""
    rank, k = plan.rank, plan.optimizers
    plan.optimizers += 1
    state = optimizer.state_dict()
    tensors: list[torch.Tensor] = []  # what this rank sends, in order

    def described(index: int, key: str, value: Any) -> Any:
        """``value`` as rank 0 first sees it: a placeholder for a tensor this rank will send."""
        if not isinstance(value, torch.Tensor):
            return value
        if value.numel() * value.element_size() <= SMALL_TENSOR_BYTES:
            return value.detach().cpu().clone()
        tensors.append(value.detach())
        where = f"optimizer {k} state of parameter {index} {key!r}"
        return StreamedTensor(value.shape, value.dtype, rank, where, -1)

    mine = {index: {key: described(index, key, value) for key, value in entry.items()}
            for index, entry in _primary_entries(optimizer, state, primary)}
    gathered: list[Any] | None = [mine]
    if plan.world_size > 1:
        gathered = [None] * plan.world_size if rank == 0 else None
        dist.gather_object(mine, gathered, group=plan.group(), group_dst=0)
    if gathered is None:  # only the source itself knows what it sends; rank 0 needs nothing
        plan.messages += [_Message(rank, tensor, []) for tensor in tensors]
        return {}
    for src, entries in enumerate(gathered):
        placeholders = [plan.numbered(value) for entry in entries.values()
                        for value in entry.values() if isinstance(value, StreamedTensor)]
        plan.messages += [_Message(src, tensors[i] if src == 0 else None, [ph])
                          for i, ph in enumerate(placeholders)]
    return _merged(gathered, state["param_groups"])


def transfer(plan: StreamPlan, sink: Sink | None,
             on_hold: Callable[[int], None] | None = None) -> None:
    """Send every planned tensor to rank 0 in the plan's order (collective); rank 0 calls
    ``sink(placeholder, tensor)`` for each (valid during the call only) and tells ``on_hold`` the
    bytes it holds for the transfer (a received buffer)."""
    rank = plan.rank
    hold: Callable[[int], None] = on_hold or (lambda nbytes: None)

    def receive(tensor: torch.Tensor, src: int) -> torch.Tensor:
        hold(tensor.numel() * tensor.element_size())
        dist.recv(tensor, group=plan.group(), group_src=src)
        return tensor

    for m in plan.messages:
        if rank != 0:  # rank 0 only sends to itself: no message
            if rank == m.src:
                assert m.tensor is not None
                dist.send(m.tensor.contiguous(), group=plan.group(), group_dst=0)
            continue
        unit, first = m.unit, m.placeholders[0]
        if m.src == 0:
            assert m.tensor is not None
            buffer = m.tensor
        elif unit is not None:
            buffer = receive(torch.empty(unit.numel, dtype=unit.dtype, device=unit.device), m.src)
        else:
            buffer = receive(torch.empty(first.shape, dtype=first.dtype, device=plan.device), m.src)
        if sink is not None and unit is not None:
            for ph, (_, view) in zip(m.placeholders, unit.views(buffer), strict=True):
                sink(ph, view)
                del view  # a view keeps the whole buffer alive: at most one received unit held
        elif sink is not None:
            sink(first, buffer)
        del buffer
        hold(0)


def transfer_kept(plan: StreamPlan, described: Any) -> Any:
    """Run the transfer keeping a copy of every tensor on rank 0 in place of its placeholder in
    ``described`` (collective): rank 0 then holds them all, as a gathered checkpoint does."""
    kept: dict[int, torch.Tensor] = {}

    def keep(placeholder: StreamedTensor, tensor: torch.Tensor) -> None:
        kept[id(placeholder)] = tensor.detach().clone()

    transfer(plan, keep)
    return fill_placeholders(described, kept)


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


def full_state_dict(module: nn.Module, stages: StageBuffers, world_size: int,
                    group: Group = default_group) -> dict[str, Any]:
    """The module's full state dict on rank 0, ``{}`` elsewhere (collective): the streamed
    transfer, every tensor kept (a tied parameter is one tensor under each of its names)."""
    state, plan = describe_state_dict(module, stages, world_size, group)
    filled: dict[str, Any] = transfer_kept(plan, state)
    return filled
