"""Resuming a model built without weights: each rank restores only what it keeps, at the build.

Why: Lightning restores a checkpoint's weights before the strategy's setup and its optimizer
state before the first batch, while a deferred model (runtime/materialize.py) still has its
parameters on the meta device, where a copy is a no-op: the weights and the optimizer state
would be silently dropped. So the strategy keeps the checkpoint's tensors aside
(:class:`DeferredRestore`) and the engine applies them once each rank has given storage to the
parameters it keeps. A sharded checkpoint (a torch.distributed.checkpoint directory,
``lightning_gsched.engine.sharded``) is read then, and each rank reads only the tensors of its
kept parameters, their optimizer state, and the buffers (every rank holds and runs every buffer); a full checkpoint is
memory-mapped on every rank (:func:`load_mapped`), and only its kept entries are applied, so
only their pages are read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.optim import Optimizer

from lightning_gsched.errors import StrategyConfigError
from lightning_gsched.runtime import parameter_names


def load_mapped(path: Any, weights_only: Any = None) -> Any:
    """Read a full checkpoint with its tensors memory-mapped from the file, not copied.

    Why: a model built without weights takes from a full checkpoint only the parameters and
    optimizer state its rank keeps. Mapped, the file's pages are read when a tensor is used, so
    each rank reads its own share of the file instead of all of it, and none of the rest
    becomes resident. A file torch cannot map (the legacy, pre-zip format) is read whole.
    """
    try:
        return torch.load(str(path), map_location="cpu", mmap=True, weights_only=weights_only)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
        return torch.load(str(path), map_location="cpu", weights_only=weights_only)


class DeferredRestoreError(StrategyConfigError):
    """A checkpoint resumed into a model built without weights lacks a tensor the model has."""


@dataclass
class DeferredRestore:
    """A checkpoint's model and optimizer state, applied at the build (see the module doc).

    ``path``: a sharded directory, read at :meth:`apply` (``non_tensor``: its optimizers'
    non-tensor entries by (optimizer, parameter name, field)); else ``state_dict`` and ``optimizer_states``: a full
    checkpoint's, already in memory."""

    path: str | None = None
    non_tensor: dict[tuple[int, str, str], Any] = field(default_factory=dict)
    state_dict: Mapping[str, torch.Tensor] | None = None
    optimizer_states: list[dict[str, Any]] | None = None

    def apply(self, module: nn.Module, kept: Sequence[nn.Parameter],
              optimizers: Sequence[Optimizer]) -> None:
        """Fill ``kept`` (which have storage now), every persistent buffer and the kept
        parameters' optimizer state (collective for a sharded directory: ``dcp.load``)."""
        if self.path is not None:
            self._apply_sharded(module, kept, optimizers)
        else:
            self._apply_full(module, kept, optimizers)
            # the whole checkpoint's tensors are not kept past the build
            self.state_dict, self.optimizer_states = None, None

    # ------------------------------------------------------------------ sharded

    def _apply_sharded(self, module: nn.Module, kept: Sequence[nn.Parameter],
                       optimizers: Sequence[Optimizer]) -> None:
        assert self.path is not None
        layout = dcp.FileSystemReader(self.path).read_metadata().state_dict_metadata
        available = {k[len("model."):] for k in layout if k.startswith("model.")}
        where = self._model_keys(module, kept, available)
        targets: dict[str, torch.Tensor] = {}
        for key, tensor in where.items():
            targets[f"model.{key}"] = torch.empty_like(tensor, device="cpu")
        per_optimizer = self._optimizer_keys(module, kept, optimizers)
        for keys in per_optimizer:
            for key in keys:
                meta = layout.get(key)
                if isinstance(meta, TensorStorageMetadata):
                    targets[key] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        dcp.load(targets, checkpoint_id=self.path)
        with torch.no_grad():
            for key, tensor in where.items():
                tensor.copy_(targets[f"model.{key}"])
        for i, (optimizer, keys) in enumerate(zip(optimizers, per_optimizer, strict=True)):
            state: dict[int, dict[str, Any]] = {}
            for key, (index, _name, fld) in keys.items():
                if key in targets:
                    state.setdefault(index, {})[fld] = targets[key]
            index_of = _index_of(optimizer, module, kept)
            for (j, name, fld), value in self.non_tensor.items():
                held = index_of.get(name)
                if j == i and held is not None:
                    state.setdefault(held, {})[fld] = value
            _load_optimizer_state(optimizer, state)

    def _optimizer_keys(self, module: nn.Module, kept: Sequence[nn.Parameter],
                        optimizers: Sequence[Optimizer]) -> list[dict[str, tuple[int, str, str]]]:
        """Per optimizer: DCP key -> (parameter index, saved name, state field) of the kept
        parameters' optimizer state (the fields a torch optimizer keeps per parameter are
        found in the directory's layout)."""
        assert self.path is not None
        layout = dcp.FileSystemReader(self.path).read_metadata().state_dict_metadata
        result = []
        for i, optimizer in enumerate(optimizers):
            keys: dict[str, tuple[int, str, str]] = {}
            for name, index in _index_of(optimizer, module, kept).items():
                prefix = f"optim.{i}.{name}."
                for key in layout:
                    if key.startswith(prefix) and "." not in key[len(prefix):]:
                        keys[key] = (index, name, key[len(prefix):])
            result.append(keys)
        return result

    # ------------------------------------------------------------------ full

    def _apply_full(self, module: nn.Module, kept: Sequence[nn.Parameter],
                    optimizers: Sequence[Optimizer]) -> None:
        assert self.state_dict is not None
        where = self._model_keys(module, kept, set(self.state_dict))
        with torch.no_grad():
            for key, tensor in where.items():
                tensor.copy_(self.state_dict[key])
        kept_ids = {id(p) for p in kept}
        for optimizer, saved in zip(optimizers, self.optimizer_states or [], strict=False):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            state = {int(i): entry for i, entry in saved.get("state", {}).items()
                     if int(i) < len(params) and id(params[int(i)]) in kept_ids}
            _load_optimizer_state(optimizer, state)

    # ------------------------------------------------------------------ both

    def _model_keys(self, module: nn.Module, kept: Sequence[nn.Parameter],
                    available: set[str]) -> dict[str, torch.Tensor]:
        """Checkpoint key -> the tensor it fills: each kept parameter (under the first of its
        names the checkpoint has) and every persistent buffer."""
        names = parameter_names(module)
        source = self.path or "the checkpoint"
        where: dict[str, torch.Tensor] = {}
        for p in kept:
            found = [n for n in names.get(id(p), []) if n in available]
            if not found:
                raise DeferredRestoreError(
                    f"the parameter {names.get(id(p), ['?'])[0]!r} is not in {source}: the "
                    "checkpoint was saved from another model. Resume from a checkpoint of this "
                    "model")
            where[found[0]] = p
        param_names = {n for ns in names.values() for n in ns}
        for key, buffer in module.state_dict(keep_vars=True).items():
            if key in param_names:
                continue
            if key not in available:
                raise DeferredRestoreError(
                    f"the buffer {key!r} is not in {source}: the checkpoint was saved from "
                    "another model. Resume from a checkpoint of this model")
            where[key] = buffer
        return where


def _index_of(optimizer: Optimizer, module: nn.Module,
              kept: Sequence[nn.Parameter]) -> dict[str, int]:
    """Saved name (a parameter's first name, :func:`.sharded.local_optimizer_state`) -> its
    index in ``optimizer``, for the kept parameters."""
    names = parameter_names(module)
    kept_ids = {id(p) for p in kept}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {names[id(p)][0] if id(p) in names else f"param{i}": i
            for i, p in enumerate(params) if id(p) in kept_ids}


def _load_optimizer_state(optimizer: Optimizer, state: dict[int, dict[str, Any]]) -> None:
    """Load per-parameter ``state`` keeping the optimizer's current param groups (Lightning
    restored them, and the LR scheduler's, with the rest of the checkpoint)."""
    groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
