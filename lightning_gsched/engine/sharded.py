"""Sharded checkpoints: a torch.distributed.checkpoint directory, each rank writes what it owns.

Why: for a model too large to gather on one rank, ``state_dict_type="sharded"`` lets every rank
write the stages and ties it is the first owner of (rank 0 adds buffers, extra parameters and
the non-tensor trainer state), in parallel, without a full copy anywhere. Keys are the module's own
parameter names (``model.<name>``) and ``optim.<i>.<name>.<state key>``, never stage numbers, so
the directory resumes under any schedule and worker count: loading reads every tensor on every
rank (each rank still holds the full model before its stages are released) and returns an
ordinary full checkpoint dict, which Lightning restores as usual; the strategy then drops what a
rank does not own. A model built without weights (deferred) instead reads, at the build, only
the tensors of the parameters each rank keeps (:func:`load_deferred`, :mod:`.deferred_restore`).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.optim import Optimizer

from lightning_gsched.engine import ckpt_files
from lightning_gsched.engine.deferred_restore import DeferredRestore
from lightning_gsched.errors import StrategyConfigError
from lightning_gsched.runtime import ModelRuntime, parameter_names

META = "gsched_meta.pt"


def is_sharded_checkpoint(path: Any) -> bool:
    return os.path.isdir(str(path)) and os.path.isfile(os.path.join(str(path), META))


def writer_of_names(module: nn.Module, runtime: ModelRuntime | None, rank: int,
                    world: int) -> Callable[[str], bool]:
    """Which state-dict keys this rank writes.

    While stages are distributed: a stage or tie parameter is written by its first owner,
    everything else (buffers, extra parameters) by rank 0. After a run (every rank holds the full
    model again) the keys are dealt round-robin, so the write is still spread over the ranks.
    """
    if runtime is None:
        keys = list(module.state_dict().keys())
        mine_keys = {k for i, k in enumerate(keys) if i % world == rank}
        return mine_keys.__contains__
    names = parameter_names(module)
    stage_names = {n for p in runtime.stage_parameters() for n in names.get(id(p), [])}
    primary = {n for p in runtime.primary_parameters() for n in names.get(id(p), [])}
    return lambda key: key in primary or (rank == 0 and key not in stage_names)


def local_model_state(module: nn.Module, is_mine: Callable[[str], bool]) -> dict:
    """The state-dict entries this rank writes (copies: stage views share one buffer)."""
    return {k: v.detach().clone() for k, v in module.state_dict().items() if is_mine(k)}


def local_optimizer_state(module: nn.Module, optimizer: Optimizer,
                          is_mine: Callable[[str], bool]) -> dict:
    """Optimizer state of the parameters whose (first) name this rank writes, keyed by name."""
    names = parameter_names(module)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    index_names = [names[id(p)][0] if id(p) in names else f"param{i}"
                   for i, p in enumerate(params)]
    state = optimizer.state_dict()
    local = {index_names[i]: entry for i, entry in state["state"].items()
             if is_mine(index_names[i])}
    return {"state": local, "param_groups": state["param_groups"], "index_names": index_names}


def save(checkpoint: dict[str, Any], path: Any, rank: int) -> None:
    """Write ``path/`` (collective): DCP shards plus rank 0's non-tensor metadata."""
    path = str(path)
    if os.path.isfile(path):
        raise StrategyConfigError(
            f"{path} is a file; a sharded checkpoint is a directory. Remove it or use "
            "state_dict_type='full'"
        )
    tensors: dict[str, torch.Tensor] = {}
    others: dict[tuple, Any] = {}
    for key, value in checkpoint.get("state_dict", {}).items():
        tensors[f"model.{key}"] = value
    optim_meta = []
    for i, opt_state in enumerate(checkpoint.get("optimizer_states", [])):
        for name, entry in opt_state.get("state", {}).items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim.{i}.{name}.{key}"] = value.detach().clone()
                else:
                    others[(i, name, key)] = value
        optim_meta.append({"param_groups": opt_state.get("param_groups"),
                           "index_names": opt_state.get("index_names")})
    world = dist.get_world_size() if dist.is_initialized() else 1
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    # every rank writes into one staging directory next to ``path`` (same name on every rank);
    # rank 0 swaps it in only after every rank finished, so an interrupted save leaves the
    # previous checkpoint whole and its staging directory is removed (ckpt_files)
    staging = ckpt_files.staging_name(path, unique=False)
    if rank == 0:
        ckpt_files.remove_stale(path)
        os.makedirs(staging)
    if world > 1:
        dist.barrier()  # the staging directory exists (and is empty) before anyone writes
        dist.gather_object(others, gathered, dst=0)
    else:
        gathered = [others]
    try:
        dcp.save(tensors, checkpoint_id=staging)
        if rank == 0:
            merged: dict[tuple, Any] = {}
            for part in gathered or []:
                merged.update(part)
            rest = {k: v for k, v in checkpoint.items()
                    if k not in ("state_dict", "optimizer_states")}
            torch.save({"rest": rest, "optimizers": optim_meta, "non_tensor": merged},
                       os.path.join(staging, META))
        if world > 1:
            dist.barrier()  # every rank's shards are written
        if rank == 0:
            ckpt_files.swap_in_directory(staging, path)
    except BaseException:
        # dcp.save raises on every rank when any rank's write fails (it gathers the outcome);
        # rank 0 removes the staging directory (a peer may still be leaving it); a rank 0 that
        # was killed leaves it to the next save of this name (ckpt_files.remove_stale)
        if rank == 0:
            ckpt_files.discard(staging)
        raise
    if world > 1:
        dist.barrier()


def load(path: Any, module: Any = None, optimizers: Any = None) -> dict[str, Any]:
    """Read a sharded directory into an ordinary full checkpoint dict (collective)."""
    path = str(path)
    meta = torch.load(os.path.join(path, META), weights_only=False, map_location="cpu")
    layout = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    targets = {
        key: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for key, m in layout.items() if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(targets, checkpoint_id=path)
    state_dict = {k[len("model."):]: v for k, v in targets.items() if k.startswith("model.")}
    optimizer_states = []
    for i, om in enumerate(meta["optimizers"]):
        index_of = {name: index for index, name in enumerate(om["index_names"] or [])}
        state: dict[int, dict] = {}
        prefix = f"optim.{i}."
        for key, value in targets.items():
            if key.startswith(prefix):
                name, field = key[len(prefix):].rsplit(".", 1)
                state.setdefault(index_of[name], {})[field] = value
        for (j, name, field), value in meta["non_tensor"].items():
            if j == i:
                state.setdefault(index_of[name], {})[field] = value
        optimizer_states.append({"state": dict(sorted(state.items())),
                                 "param_groups": om["param_groups"]})
    return {**meta["rest"], "state_dict": state_dict, "optimizer_states": optimizer_states}


def saved_model_entries(path: Any) -> dict[str, torch.Tensor]:
    """The model entries of a sharded directory as meta tensors of their saved shapes.

    Why: a model built without weights reads the directory's tensors only at the build, but
    Lightning restores the optimizers' param groups before it, so another model's directory
    would fail there in torch's own words. The index (``.metadata``) holds every key's shape,
    so the directory can be checked against the model (``ckpt_check.mismatch``) when it is
    given, reading no tensor."""
    layout = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {key[len("model."):]: torch.empty(tuple(m.size), dtype=m.properties.dtype,
                                             device="meta")
            for key, m in layout.items()
            if key.startswith("model.") and isinstance(m, TensorStorageMetadata)}


def load_deferred(path: Any) -> tuple[dict[str, Any], DeferredRestore]:
    """A sharded directory for a model built without weights: the checkpoint without its
    tensors now (optimizers get their param groups only), and the tensors at the build, where
    each rank reads only those of the parameters it keeps (:mod:`.deferred_restore`)."""
    path = str(path)
    meta = torch.load(os.path.join(path, META), weights_only=False, map_location="cpu")
    optimizer_states = [{"state": {}, "param_groups": om["param_groups"]}
                        for om in meta["optimizers"]]
    checkpoint = {**meta["rest"], "state_dict": {}, "optimizer_states": optimizer_states}
    return checkpoint, DeferredRestore(path=path, non_tensor=dict(meta["non_tensor"]))
