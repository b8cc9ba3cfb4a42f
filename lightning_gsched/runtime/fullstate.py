"""The full model and optimizer state from sharded training: gather to rank 0, give back to all.

Why: under a sharded schedule no rank holds the whole model (non-owned stages have 0-byte
storage) and each optimizer holds state only for the parameters its rank owns. A checkpoint that
loads in one process needs the full state dict under the module's own names, so rank 0 collects
every stage from its first owner (the streamed transfer of :mod:`.fullstate_stream`, each
tensor kept: :func:`.fullstate_stream.full_state_dict`) and every optimizer state entry from the
parameter's primary rank (:mod:`.ownership`, here). Such a checkpoint does not depend on the
schedule or the worker count, so it resumes under any other: loading gives every rank the full
state (before any stage is released, or filtered to what a built rank holds), and the optimizer
state of parameters a rank does not own is pruned once the new schedule's ownership is known.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_gsched.runtime.flat import FlatStage
from lightning_gsched.runtime.layout import weight_units
from lightning_gsched.schedule.program import Programs


class StageBuffers(Protocol):
    """What gathering reads of the executor: the stage buffers and who owns them."""

    @property
    def rank(self) -> int: ...
    @property
    def programs(self) -> Programs: ...
    @property
    def flats(self) -> Sequence[FlatStage]: ...
    @property
    def ties(self) -> Mapping[int, FlatStage]: ...  # tie home stage -> its unit


def parameter_names(module: nn.Module) -> dict[int, list[str]]:
    """Every state-dict name of each parameter (tied parameters have several)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def restore_full_weights(stages: StageBuffers, world_size: int) -> None:
    """Give every rank every stage again (collective), e.g. when training ends.

    Parameters of non-owned stages become views of a freshly received buffer; owned ones keep
    their values. Afterwards the module is an ordinary full model on every rank (the stage
    buffers no longer back it: the runtime must not step again).
    """
    for owners, flat in weight_units(stages.programs, stages.flats, stages.ties):
        if not flat.numel:
            continue
        src = owners[0]
        if flat.owned:
            buffer = flat.flat.detach().clone()  # type: ignore[union-attr]
        else:
            buffer = torch.empty(flat.numel, dtype=flat.dtype, device=flat.device)
        if world_size > 1:
            dist.broadcast(buffer, src)
        for p, view in flat.views(buffer):
            p.data = view


def _cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _primary_entries(optimizer: Optimizer, state: dict[str, Any],
                     primary: Sequence[nn.Parameter]) -> dict[int, dict[str, Any]]:
    """The entries of ``state`` (optimizer.state_dict()) for parameters this rank is primary
    for, on the CPU so they can be pickled to other ranks."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    wanted = {id(p) for p in primary}
    return {
        index: {key: _cpu(value) for key, value in entry.items()}
        for index, entry in state["state"].items()
        if id(params[index]) in wanted
    }


def _merged(parts: list[Any], param_groups: Any) -> dict[str, Any]:
    merged: dict[int, Any] = {}
    for part in parts:
        merged.update(part)
    return {"state": dict(sorted(merged.items())), "param_groups": param_groups}


def full_optimizer_state(optimizer: Optimizer, primary: Sequence[nn.Parameter], rank: int,
                         world_size: int) -> dict[str, Any]:
    """The optimizer's state dict with every parameter's state, on rank 0 (collective)."""
    state = optimizer.state_dict()
    if world_size == 1:
        return state
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(_primary_entries(optimizer, state, primary), gathered, dst=0)
    if rank != 0:
        return {}
    return _merged(gathered or [], state["param_groups"])


def restore_full_optimizer_state(optimizers: Sequence[Optimizer],
                                 primary: Sequence[nn.Parameter], world_size: int) -> None:
    """Give every rank every parameter's optimizer state again (collective; end of a run).

    Together with :func:`restore_full_weights` this makes a finished run look like DDP's, so a
    checkpoint saved afterwards and a later run both see complete state.
    """
    for optimizer in optimizers:
        state = optimizer.state_dict()
        mine = _primary_entries(optimizer, state, primary)
        gathered: list[Any] = [mine]
        if world_size > 1:
            gathered = [None] * world_size
            dist.all_gather_object(gathered, mine)
        optimizer.load_state_dict(_merged(gathered, state["param_groups"]))


def prune_optimizer_state(optimizers: Sequence[Optimizer], keep: Sequence[nn.Parameter]) -> int:
    """Drop state of parameters this rank does not own (e.g. loaded from a full checkpoint)."""
    wanted = {id(p) for p in keep}
    dropped = 0
    for optimizer in optimizers:
        for p in list(optimizer.state):
            if id(p) not in wanted:
                del optimizer.state[p]
                dropped += 1
    return dropped


def load_held_state(module: nn.Module, state: dict[str, Any]) -> None:
    """Load ``state`` (a full state dict) into what this rank holds of a built model.

    Parameters of stages this rank does not own are empty here, so their entries are skipped
    (``strict=False``); owned stage parameters are views of the stage buffers, so loading copies
    into the buffers.
    """
    held_elsewhere = {name for name, p in module.named_parameters(remove_duplicate=False)
                      if p.numel() == 0}
    module.load_state_dict({k: v for k, v in state.items() if k not in held_elsewhere},
                           strict=False)
