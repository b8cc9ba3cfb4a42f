"""Full tensors from tensor-parallel shards and back: at teardown, in checkpoints, on resume.

Why a module of its own: :mod:`.tensor_parallel` shards a stage and keeps each rank's shard as
a plain parameter; everything that crosses the run's boundary must see the model one device
would hold instead. A run's end gives every rank the full parameters (:func:`gather_shards`); a
full checkpoint holds plain full tensors, model and optimizer state alike (the model's made
whole on the way to rank 0 through each piece's :func:`whole`, ``runtime/fullstate.py``; a
gathered optimizer state by :func:`full_optimizer_state`); a full checkpoint loaded into a
sharded run, or optimizer state loaded before the stages were sharded, is cut to this rank's
shard (:func:`local_model_state`, :func:`local_optimizer_state`, :func:`shard_optimizer_state`).
A sharded checkpoint (a torch.distributed.checkpoint directory) keeps each rank's piece where it
is and writes it as a ``DTensor`` (:func:`global_model_state`, :func:`global_optimizer_state`):
the directory records every piece's offset in the full tensor, so it reads back as full tensors
under any layout, sharded or not.

A tensor is a shard's counterpart when it has the shard's shape (gathered) or the full
parameter's (sliced): optimizer state such as momentum or Adam's moments has its parameter's
shape; a scalar (Adam's step) has neither and is left as it is. The ``i``-th of the T equal
pieces along the spec's dimension belongs to the rank at index ``i`` of the tensor-parallel
mesh (torch's ``Shard(dim)`` layout).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_gsched.partition.tensor_parallel import ShardSpec, forget_shards, shard_specs

StateDict = dict[str, Any]


def local_shape(spec: ShardSpec) -> torch.Size:
    """The shape of one rank's shard of a parameter sharded as ``spec``."""
    shape = list(spec.shape)
    if spec.dim is not None:
        shape[spec.dim] //= spec.mesh.size()
    return torch.Size(shape)


def whole(local: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The full tensor from every rank's ``local`` piece (collective over the spec's
    tensor-parallel group, every rank of it calling with its piece)."""
    if spec.dim is None:
        return local
    group = spec.mesh.get_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=spec.dim)


def region(spec: ShardSpec) -> tuple[slice, ...]:
    """Where this rank's piece sits in the full tensor (all of it for an unsharded spec)."""
    where = [slice(None)] * len(spec.shape)
    if spec.dim is not None:
        size = spec.shape[spec.dim] // int(spec.mesh.size())
        start = size * int(spec.mesh.get_local_rank())
        where[spec.dim] = slice(start, start + size)
    return tuple(where)


def piece(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """This rank's piece of ``full`` (a copy: it must not keep the full tensor alive)."""
    if spec.dim is None:
        return full
    return full[region(spec)].clone()


def gather_shards(module: nn.Module, optimizers: Sequence[Any] = ()) -> int:
    """Every sharded parameter under ``module`` becomes the full tensor again, in place (the
    same ``nn.Parameter``, so optimizers keep their references), and so does its optimizer
    state (collective over each tensor-parallel group). Returns how many were gathered.

    Why in place and with the optimizer state: after a run every rank holds the model one
    device would have trained (the front ends' contract), and a later fit or save reads the
    same parameters and their state."""
    states = [getattr(o, "state", {}) for o in optimizers]
    gathered = 0
    for owner, name, spec in forget_shards(module):
        param = owner._parameters[name]
        if spec.dim is None or param is None:
            continue
        for state in states:
            entry = state.get(param, {})
            _swap(entry, list(entry), param.shape, partial(whole, spec=spec))
        param.data = whole(param.detach(), spec)
        gathered += 1
    return gathered


def shard_optimizer_state(optimizers: Sequence[Any], module: nn.Module) -> None:
    """Optimizer state made for the full parameters (loaded from a checkpoint before the
    stages were sharded) cut to this rank's shards, in place."""
    by_id = {id(param): spec for param, spec in sharded_parameter_specs(module)}
    for optimizer in optimizers:
        for param, entry in getattr(optimizer, "state", {}).items():
            spec = by_id.get(id(param))
            if spec is not None:
                _swap(entry, list(entry), spec.shape, partial(piece, spec=spec))


def local_model_state(state: Mapping[str, Any], module: nn.Module) -> StateDict:
    """A full state dict with every sharded entry cut to this rank's piece."""
    out = dict(state)
    for name, spec in shard_specs(module).items():
        _swap(out, [name], spec.shape, partial(piece, spec=spec))
    return out


def full_optimizer_state(state: StateDict, optimizer: Any, module: nn.Module) -> StateDict:
    """``optimizer.state_dict()``-shaped ``state`` with every shard-shaped tensor whole
    (collective over each tensor-parallel group: call on every rank of a group holding it).
    A new dict, as :func:`global_optimizer_state` returns: ``state``'s entries may be the
    optimizer's own (one worker's ``optimizer.state_dict()``)."""
    entries = {index: dict(entry) for index, entry in state.get("state", {}).items()}
    for index, spec in _specs_by_index(optimizer, module).items():
        entry = entries.get(index, {})
        _swap(entry, list(entry), local_shape(spec), partial(whole, spec=spec))
    return {**state, "state": entries}


def local_optimizer_state(state: StateDict, optimizer: Any, module: nn.Module) -> StateDict:
    """A full optimizer state dict with every full-shaped tensor cut to this rank's piece."""
    out = {**state, "state": {i: dict(e) for i, e in state.get("state", {}).items()}}
    for index, spec in _specs_by_index(optimizer, module).items():
        entry = out["state"].get(index, {})
        _swap(entry, list(entry), spec.shape, partial(piece, spec=spec))
    return out


def global_view(local: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """``local`` (this rank's piece) as the ``DTensor`` of the full tensor it belongs to: a
    view, no data moves, and nothing is communicated until something reads it whole."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                              shape=spec.shape, stride=spec.stride)


def global_model_state(state: StateDict, module: nn.Module) -> StateDict:
    """``state`` (entries of the module's state dict of local shards) with every sharded entry
    seen as the ``DTensor`` of its full parameter (no communication)."""
    for name, spec in shard_specs(module).items():
        if spec.dim is not None:
            _swap(state, [name], local_shape(spec), partial(global_view, spec=spec))
    return state


def global_optimizer_state(state: StateDict, optimizer: Any, module: nn.Module) -> StateDict:
    """A sharded checkpoint's optimizer state (entries keyed by the names in
    ``state["index_names"]``, see ``engine/checkpoint_sharded.py``) with every shard-shaped
    tensor seen as the ``DTensor`` of the full one, as in :func:`global_model_state`. A new
    dict: the entries of ``optimizer.state_dict()`` are the optimizer's own state dicts, and a
    DTensor written into them would be the buffer its next step updates."""
    names = state.get("index_names") or []
    entries = {name: dict(entry) for name, entry in state.get("state", {}).items()}
    for index, spec in _specs_by_index(optimizer, module).items():
        entry = entries.get(names[index], {}) if index < len(names) else {}
        _swap(entry, list(entry), local_shape(spec), partial(global_view, spec=spec))
    return {**state, "state": entries}


def _swap(entries: dict[Any, Any], keys: Sequence[Any], shape: torch.Size,
          convert: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``entries[key] = convert(value)`` for each of ``keys`` holding a tensor of ``shape``
    (the module doc's rule: a shard's counterpart has the shard's or the full shape)."""
    for key in keys:
        value = entries.get(key)
        if isinstance(value, torch.Tensor) and value.shape == shape:
            entries[key] = convert(value)


def sharded_parameter_specs(module: nn.Module) -> list[tuple[nn.Parameter, ShardSpec]]:
    """Every parameter under ``module`` held as a shard, with its spec."""
    params = dict(module.named_parameters())
    return [(params[name], spec) for name, spec in shard_specs(module).items()
            if name in params and spec.dim is not None]


def _specs_by_index(optimizer: Any, module: nn.Module) -> dict[int, ShardSpec]:
    """Sharded parameters by their index in ``optimizer.state_dict()`` (param_groups order)."""
    by_id = {id(param): spec for param, spec in sharded_parameter_specs(module)}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {i: by_id[id(p)] for i, p in enumerate(params) if id(p) in by_id}
