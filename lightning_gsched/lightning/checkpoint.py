"""Full checkpoints from sharded training state: gather to rank 0, prune after loading.

Why: under a sharded schedule no rank holds the whole model (non-owned stages have 0-byte
storage) and each optimizer holds state only for the parameters its rank owns. A ``.ckpt`` that
plain ``LightningModule.load_from_checkpoint`` loads in one process needs the full state dict
under the module's own names, so rank 0 collects every stage from its first owner and every
optimizer state entry from the rank that owns the parameter. Such a checkpoint does not depend
on the schedule or the worker count, so it resumes under any other: loading gives every rank the
full model and optimizer state (before any stage is released), and the strategy prunes what a
rank does not own once the new schedule's ownership is known.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_gsched.lightning.grads import GradStash
from lightning_gsched.runtime import ProgramExecutor


def parameter_names(module: nn.Module) -> dict[int, list[str]]:
    """Every state-dict name of each parameter (tied parameters have several)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def full_state_dict(module: nn.Module, executor: ProgramExecutor) -> dict[str, Any]:
    """The module's full state dict on rank 0 (collective; other ranks get ``{}``)."""
    rank = executor.rank
    owners = executor.programs.owners
    names = parameter_names(module)
    state = module.state_dict() if rank == 0 else {}
    for s, flat in enumerate(executor.flats):
        if not flat.numel:
            continue
        src = owners[s][0]
        buffer: torch.Tensor | None = None
        if rank == src:
            assert flat.flat is not None
            buffer = flat.flat
            if src != 0:
                dist.send(buffer.contiguous(), 0)
        elif rank == 0:
            buffer = torch.empty(flat.numel, dtype=flat.dtype, device=flat.device)
            dist.recv(buffer, src)
        if rank != 0:
            continue
        assert buffer is not None
        for p, offset, size, shape in zip(
            flat.params, flat.offsets, flat.sizes, flat.shapes, strict=True
        ):
            value = buffer[offset: offset + size].view(shape).detach().clone()
            for name in names.get(id(p), []):
                state[name] = value
    return state


def _cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _primary_entries(optimizer: Optimizer, state: dict[str, Any],
                     grads: GradStash) -> dict[int, dict]:
    """The entries of ``state`` (optimizer.state_dict()) for parameters this rank is first
    owner of, on the CPU so they can be pickled to other ranks."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    primary = {id(p) for p in grads.primary}
    return {
        index: {key: _cpu(value) for key, value in entry.items()}
        for index, entry in state["state"].items()
        if id(params[index]) in primary
    }


def _merged(parts: list[Any], param_groups: Any) -> dict[str, Any]:
    merged: dict[int, Any] = {}
    for part in parts:
        merged.update(part)
    return {"state": dict(sorted(merged.items())), "param_groups": param_groups}


def full_optimizer_state(optimizer: Optimizer, grads: GradStash) -> dict[str, Any]:
    """The optimizer's state dict with every parameter's state, on rank 0 (collective)."""
    state = optimizer.state_dict()
    if grads.world_size == 1:
        return state
    gathered: list[Any] | None = [None] * grads.world_size if grads.rank == 0 else None
    dist.gather_object(_primary_entries(optimizer, state, grads), gathered, dst=0)
    if grads.rank != 0:
        return {}
    return _merged(gathered or [], state["param_groups"])


def prune_optimizer_state(optimizers: list[Optimizer], keep: list[nn.Parameter]) -> int:
    """Drop state of parameters this rank does not own (loaded from a full checkpoint)."""
    wanted = {id(p) for p in keep}
    dropped = 0
    for optimizer in optimizers:
        for p in list(optimizer.state):
            if id(p) not in wanted:
                del optimizer.state[p]
                dropped += 1
    return dropped


def restore_full_weights(executor: ProgramExecutor) -> None:
    """Give every rank every stage again (collective), e.g. when training ends.

    Parameters of non-owned stages become views of a freshly received buffer; owned ones keep
    their values. Afterwards the module is an ordinary full model on every rank.
    """
    owners = executor.programs.owners
    for s, flat in enumerate(executor.flats):
        if not flat.numel:
            continue
        src = owners[s][0]
        if flat.owned:
            buffer = flat.flat.detach().clone()  # type: ignore[union-attr]
        else:
            buffer = torch.empty(flat.numel, dtype=flat.dtype, device=flat.device)
        if executor.channels.world_size > 1:
            dist.broadcast(buffer, src)
        for p, offset, size, shape in zip(
            flat.params, flat.offsets, flat.sizes, flat.shapes, strict=True
        ):
            p.data = buffer[offset: offset + size].view(shape)


def restore_full_optimizer_state(optimizers: list[Optimizer], grads: GradStash) -> None:
    """Give every rank every parameter's optimizer state again (collective; end of a run).

    Together with :func:`restore_full_weights` this makes a finished run look like DDP's, so
    ``trainer.save_checkpoint`` after ``fit`` and a later ``fit`` both see complete state.
    """
    for optimizer in optimizers:
        state = optimizer.state_dict()
        mine = _primary_entries(optimizer, state, grads)
        gathered: list[Any] = [mine]
        if grads.world_size > 1:
            gathered = [None] * grads.world_size
            dist.all_gather_object(gathered, mine)
        optimizer.load_state_dict(_merged(gathered, state["param_groups"]))
