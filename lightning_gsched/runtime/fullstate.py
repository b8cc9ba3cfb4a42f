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

With tensor parallelism (``tensor_parallel=(T, t)``, ``pieces``: the parameters this rank holds
as a piece of a larger tensor) a worker is T ranks, each holding its pieces of the same units. A
checkpoint holds what one device would, so each message is the full tensors: the source worker's
T ranks make them together (:attr:`.materialize.Piece.whole`, a collective among them, one
parameter at a time) and its rank ``t = 0`` sends them over its workers' group, to which rank 0
belongs; the other ranks only help make them. Rank 0 therefore never holds more than one full
unit either, and no rank holds more than one unit's full tensors.
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
from lightning_gsched.runtime.materialize import Piece, Pieces

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
    ``group()``: the workers' group (group rank = worker, ``Channels.workers_group``). Its
    entries are never the optimizer's own dicts (one worker's are copied), so a caller may
    change them."""
    state = optimizer.state_dict()
    if world_size == 1:
        return {**state, "state": {index: dict(entry) for index, entry in state["state"].items()}}
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


# on the source worker's ranks: makes the tensor it sends (collective over the worker's T ranks
# where it holds pieces)
Sender = Callable[[], torch.Tensor]


@dataclass
class _Message:
    """One tensor for rank 0: a weight unit's parameters one after another in its buffer order
    (a placeholder each), or an optimizer state tensor; full tensors either way."""

    src: int  # the source worker
    send: Sender | None  # on the source's ranks
    placeholders: list[StreamedTensor]  # rank 0
    device: torch.device  # where rank 0 receives it

    def size(self) -> int:
        return sum(ph.numel() for ph in self.placeholders)


@dataclass
class StreamPlan:
    """What one save transfers, in the same order on every rank (each knows its own part)."""

    rank: int  # the worker
    world_size: int
    group: Group  # the workers' group (group rank = worker), read at each use
    device: torch.device = torch.device("cpu")  # where rank 0 receives optimizer tensors
    tensor_parallel: tuple[int, int] = (1, 0)  # (T, t): each worker is T ranks, this is its t
    pieces: Pieces = field(default_factory=dict)  # this rank's parameters held as pieces
    messages: list[_Message] = field(default_factory=list)
    optimizers: int = 0
    count: int = 0  # placeholders numbered so far (rank 0)

    @property
    def receives(self) -> bool:
        """This rank is rank 0, where the tensors go: worker 0's rank ``t = 0``."""
        return self.rank == 0 and self.tensor_parallel[1] == 0

    def numbered(self, placeholder: StreamedTensor) -> StreamedTensor:
        """``placeholder`` with the next place in the transfer order as its ``seq``."""
        placeholder.seq = self.count
        self.count += 1
        return placeholder


def describe_state_dict(module: nn.Module, stages: StageBuffers, world_size: int,
                        group: Group, tensor_parallel: tuple[int, int] = (1, 0),
                        pieces: Pieces | None = None) -> tuple[dict[str, Any], StreamPlan]:
    """Rank 0: the module's state dict, every parameter held in a weight unit a placeholder of
    its full shape (buffers and parameters outside the units stay real); other ranks: ``{}``.
    No collective."""
    rank = stages.rank
    units = weight_units(stages.programs, stages.flats, stages.ties)
    plan = StreamPlan(rank, world_size, group,
                      units[0][1].device if units else torch.device("cpu"), tensor_parallel,
                      pieces or {})
    names = parameter_names(module)
    state = module.state_dict() if plan.receives else {}
    for i, (owners, flat) in enumerate(units):
        if not flat.numel:
            continue
        send = (_unit_sender(flat, plan.pieces)
                if rank == owners[0] and flat.flat is not None else None)
        message = _Message(owners[0], send, [], flat.device)
        plan.messages.append(message)
        shapes = _full_shapes(flat, plan.pieces)
        for j, p in enumerate(flat.params if plan.receives else []):
            where = f"{flat.kind} {flat.index} (weight unit {i}) offset {flat.offsets[j]}"
            ph = plan.numbered(StreamedTensor(shapes[j], flat.dtype, owners[0], where, -1))
            message.placeholders.append(ph)
            for name in names.get(id(p), []):
                state[name] = ph  # a tied parameter: one placeholder under each name
    return state, plan


def _full_shapes(flat: FlatStage, pieces: Pieces) -> list[torch.Size]:
    """Each of a unit's parameters' shape on one device (the unit records the local shapes,
    which a rank that holds none of it still knows)."""
    return [pieces[id(p)].shape if id(p) in pieces else shape
            for p, shape in zip(flat.params, flat.shapes, strict=True)]


def _whole(piece: Piece, local: torch.Tensor) -> torch.Tensor:
    """The full tensor of which ``local`` is this rank's ``piece`` (collective, see
    :attr:`.materialize.Piece.whole`)."""
    if piece.whole is None:
        raise RuntimeError(f"a piece of a {tuple(piece.shape)} tensor has no way to be made "
                           "whole (Piece.whole): the engine gives every piece one")
    return piece.whole(local)


def _unit_sender(flat: FlatStage, pieces: Pieces) -> Sender:
    """What a weight unit's owner sends: its buffer, or, where some of its parameters are
    pieces, every parameter's full tensor in the buffer's order (made one at a time, so the
    worker holds one full unit and one parameter's gathered tensor at most)."""
    buffer = flat.flat.detach() if flat.flat is not None else torch.empty(0)
    if not any(id(p) in pieces for p in flat.params):
        return lambda: buffer

    def full() -> torch.Tensor:
        sizes = [math.prod(shape) for shape in _full_shapes(flat, pieces)]
        out = torch.empty(sum(sizes), dtype=flat.dtype, device=flat.device)
        offset = 0
        for size, (p, view) in zip(sizes, flat.views(buffer), strict=True):
            piece = pieces.get(id(p))
            tensor = view if piece is None else _whole(piece, view)
            out[offset:offset + size].copy_(tensor.reshape(-1))
            offset += size
        return out

    return full


def _optimizer_sender(tensor: torch.Tensor, piece: Piece | None) -> Sender:
    """What a parameter's owner sends for one optimizer state tensor: itself, or its full
    tensor where it is the counterpart of a piece."""
    if piece is None:
        return lambda: tensor
    return lambda: _whole(piece, tensor)


def describe_optimizer_state(plan: StreamPlan, optimizer: Optimizer,
                             primary: Sequence[nn.Parameter]) -> dict[str, Any]:
    """Rank 0: ``optimizer.state_dict()`` with every parameter's state, tensors as placeholders;
    ``{}`` elsewhere (collective: one small object gather). Adds the optimizer to ``plan``."""
    rank, k = plan.rank, plan.optimizers
    plan.optimizers += 1
    state = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sends: list[Sender] = []  # what this rank sends, in order

    def described(index: int, key: str, value: Any) -> Any:
        """``value`` as rank 0 first sees it: a placeholder for a tensor this rank will send
        (a piece's counterpart, which has its parameter's local shape, at the full shape)."""
        if not isinstance(value, torch.Tensor):
            return value
        piece = plan.pieces.get(id(params[index]))
        if piece is not None and value.shape != params[index].shape:
            piece = None  # e.g. Adam's step: not a counterpart of the piece
        if piece is None and value.numel() * value.element_size() <= SMALL_TENSOR_BYTES:
            return value.detach().cpu().clone()
        sends.append(_optimizer_sender(value.detach(), piece))
        where = f"optimizer {k} state of parameter {index} {key!r}"
        shape = value.shape if piece is None else piece.shape
        return StreamedTensor(shape, value.dtype, rank, where, -1)

    mine = {index: {key: described(index, key, value) for key, value in entry.items()}
            for index, entry in _primary_entries(optimizer, state, primary)}
    gathered: list[Any] | None = [mine]
    if plan.tensor_parallel[1] != 0:  # a worker's other ranks help its rank t = 0 send
        gathered = None
    elif plan.world_size > 1:
        gathered = [None] * plan.world_size if rank == 0 else None
        dist.gather_object(mine, gathered, group=plan.group(), group_dst=0)
    if gathered is None:  # only the source itself knows what it sends; rank 0 needs nothing
        plan.messages += [_Message(rank, send, [], plan.device) for send in sends]
        return {}
    for src, entries in enumerate(gathered):
        placeholders = [plan.numbered(value) for entry in entries.values()
                        for value in entry.values() if isinstance(value, StreamedTensor)]
        plan.messages += [_Message(src, sends[i] if src == 0 else None, [ph], plan.device)
                          for i, ph in enumerate(placeholders)]
    return _merged(gathered, state["param_groups"])


def transfer(plan: StreamPlan, sink: Sink | None,
             on_hold: Callable[[int], None] | None = None) -> None:
    """Send every planned tensor to rank 0 in the plan's order (collective); rank 0 calls
    ``sink(placeholder, tensor)`` for each (valid during the call only) and tells ``on_hold`` the
    bytes it holds for the transfer (a received buffer)."""
    hold: Callable[[int], None] = on_hold or (lambda nbytes: None)

    def receive(tensor: torch.Tensor, src: int) -> torch.Tensor:
        hold(tensor.numel() * tensor.element_size())
        dist.recv(tensor, group=plan.group(), group_src=src)
        return tensor

    def made(m: _Message) -> torch.Tensor:
        if m.send is None:
            raise RuntimeError(f"worker {m.src} has nothing to send for a described tensor")
        return m.send()

    for m in plan.messages:
        if not plan.receives:  # rank 0 only sends to itself: no message
            if plan.rank == m.src:
                tensor = made(m)  # with every rank of the worker
                if plan.tensor_parallel[1] == 0:
                    dist.send(tensor.contiguous(), group=plan.group(), group_dst=0)
                del tensor
            continue
        first = m.placeholders[0]
        if m.src == 0:
            buffer = made(m).reshape(-1)
        else:
            buffer = receive(torch.empty(m.size(), dtype=first.dtype, device=m.device), m.src)
        if sink is not None:
            offset = 0
            for ph in m.placeholders:  # one after another, as the source laid them out
                view = buffer[offset:offset + ph.numel()].view(ph.shape)
                offset += ph.numel()
                sink(ph, view)
                del view  # a view keeps the whole buffer alive: at most one received unit held
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
                    group: Group = default_group, tensor_parallel: tuple[int, int] = (1, 0),
                    pieces: Pieces | None = None) -> dict[str, Any]:
    """The module's full state dict on rank 0, ``{}`` elsewhere (collective): the streamed
    transfer, every tensor kept (a tied parameter is one tensor under each of its names)."""
    state, plan = describe_state_dict(module, stages, world_size, group, tensor_parallel, pieces)
    filled: dict[str, Any] = transfer_kept(plan, state)
    return filled
