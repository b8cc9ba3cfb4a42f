"""Pretrained weights for a deferred model: each rank reads only the tensors it keeps.

A model built without weights (:mod:`.materialize`) must not be read whole by any rank either.
Safetensors as ``transformers`` saves them (one ``model.safetensors``, or an index whose
``weight_map`` names each tensor's shard) are read one tensor at a time, so each rank reads only
the parameters it keeps. ``prefix`` is what the model's state-dict names carry before the file's
(``"model."`` for a LightningModule holding the network as ``self.model``); parameters outside it
are initialised as without weights. A tied parameter is read under the first of its names the
file has. Every rank first checks every parameter under ``prefix`` against the headers (name and
shape), so a mismatch fails every rank alike. Every rank reads the persistent buffers the file
has (small, held by every rank); the others keep their built values.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection

import torch
from torch import nn

from lightning_gsched.errors import StrategyConfigError
from lightning_gsched.runtime.flat import set_storage
from lightning_gsched.runtime.fullstate import parameter_names
from lightning_gsched.runtime.materialize import Pieces, full_shape, initialize_parameters

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class PretrainedWeightsError(StrategyConfigError):
    """Pretrained weights (``init_weights``) cannot be found, read, or do not fit the model."""


@dataclass(frozen=True)
class PretrainedWeights:
    """A ``.safetensors`` file or index, and the ``prefix`` the model's names carry before its."""

    path: Path
    prefix: str = ""


def pretrained_weights(path: str | os.PathLike[str], prefix: str = "") -> PretrainedWeights:
    """Check ``path`` exists and resolve a directory to its index or single file (reading no
    weights: this runs where the strategy's arguments are checked)."""
    if not isinstance(prefix, str):
        raise PretrainedWeightsError(
            f"init_weights_prefix must be a string (the model's state_dict names before the "
            f"file's, e.g. 'model.'), got {prefix!r}")
    given = Path(path)
    if given.is_dir():
        for name in (INDEX, SINGLE):
            if (given / name).is_file():
                return PretrainedWeights(given / name, prefix)
        raise PretrainedWeightsError(
            f"init_weights={str(path)!r} is a directory without {INDEX} or {SINGLE}: give the "
            "directory transformers' save_pretrained wrote, or the .safetensors file itself")
    if not given.is_file():
        raise PretrainedWeightsError(
            f"init_weights={str(path)!r} does not exist: give a .safetensors file, a "
            f"{INDEX}, or a directory holding one")
    return PretrainedWeights(given, prefix)


def _open(file: Path) -> Any:
    """A lazy handle on one safetensors file: the header is read, tensors on request."""
    try:
        import safetensors
    except ImportError as exc:  # pragma: no cover - a dependency, only missing if removed
        raise PretrainedWeightsError(
            "init_weights reads safetensors files, and the safetensors package is not "
            "installed: pip install safetensors") from exc
    try:
        return safetensors.safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:  # noqa: BLE001 - safetensors' own error types vary by version
        # (a torch.save'd pytorch_model.bin gave a bare "header too large", naming no file)
        raise PretrainedWeightsError(
            f"init_weights: {file} is not a safetensors file ({type(exc).__name__}: {exc}). "
            "Give a .safetensors file, its index (model.safetensors.index.json) or the folder "
            "holding them; a torch.save'd checkpoint (pytorch_model.bin) can be re-saved with "
            "transformers' save_pretrained(..., safe_serialization=True) or "
            "safetensors.torch.save_file(state_dict, path)") from exc


def _where(weights: PretrainedWeights) -> dict[str, Path]:
    """Tensor name -> the file holding it (an index's ``weight_map``; a single file's header)."""
    if weights.path.name.endswith(".json"):
        try:
            weight_map = json.loads(weights.path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PretrainedWeightsError(
                f"{weights.path} is not a safetensors index (a JSON object with a "
                f"'weight_map' of tensor name -> shard file): {exc}") from exc
        return {name: weights.path.parent / shard for name, shard in weight_map.items()}
    with _open(weights.path) as f:
        return {name: weights.path for name in f.keys()}


def _check(module: nn.Module, weights: PretrainedWeights, where: dict[str, Path],
           pieces: Pieces, names: dict[int, list[str]]) -> dict[int, str]:
    """Every parameter under the prefix is in the files with its (full) shape (headers only);
    returns parameter id -> file key (its first name under the prefix the file has)."""
    params = {id(p): p for p in module.parameters()}
    keys: dict[int, str] = {}
    for pid, aliases in names.items():
        under = [n[len(weights.prefix):] for n in aliases if n.startswith(weights.prefix)]
        if not under:
            continue
        key = next((k for k in under if k in where), under[0])
        if key not in where:
            raise PretrainedWeightsError(
                f"the parameter {aliases[0]!r} is not in {weights.path} (looked for {key!r} with "
                f"init_weights_prefix={weights.prefix!r}); the file's first names are "
                f"{sorted(where)[:3]}. Set init_weights_prefix to the part of the model's names "
                "the file lacks (e.g. 'model.' for a LightningModule holding the network as "
                "self.model), or save the weights of this model")
        keys[pid] = key
    if not keys:  # a prefix no parameter starts with: nothing would be read, silently
        first = next(iter(names.values()), ["?"])[0]
        raise PretrainedWeightsError(
            f"init_weights_prefix={weights.prefix!r} starts no parameter name of "
            f"{type(module).__name__} (e.g. {first!r}), so nothing of {weights.path} would be "
            f"read; the file's first names are {sorted(where)[:3]}. Set init_weights_prefix to "
            "the part of the model's names the file lacks (e.g. 'model.' for a LightningModule "
            "holding the network as self.model)")
    for file in dict.fromkeys(where[key] for key in keys.values()):
        with _open(file) as f:
            for pid in (pid for pid, key in keys.items() if where[key] == file):
                shape = tuple(f.get_slice(keys[pid]).get_shape())
                want = tuple(full_shape(params[pid], pieces))
                if shape != want:
                    raise PretrainedWeightsError(
                        f"the tensor {keys[pid]!r} in {file} has shape {list(shape)} but the "
                        f"model's parameter {names[pid][0]!r} has "
                        f"{list(want)}: the weights are of another model or "
                        "configuration")
    return keys


def _warn_unused(module: nn.Module, weights: PretrainedWeights, where: dict[str, Path],
                 buffers: Collection[str], names: dict[int, list[str]]) -> None:
    """Warn of the file's tensors that no parameter or buffer reads, as transformers'
    ``from_pretrained`` does: expected for a pretraining head the model drops, a mistake for a
    file of a deeper model or another configuration (its extra layers would vanish silently)."""
    prefix = weights.prefix
    read = {n[len(prefix):] for aliases in names.values() for n in aliases
            if n.startswith(prefix)} | set(buffers)
    unused = sorted(k for k in where if k not in read)
    if unused:
        warnings.warn(
            f"{len(unused)} tensor(s) of {weights.path} are read by no parameter or buffer of "
            f"{type(module).__name__} under init_weights_prefix={prefix!r}, e.g. "
            f"{unused[:5]}; they are not loaded. Expected when the file holds more than the "
            "model uses (a pretraining head); otherwise check the model's configuration (a "
            "file of a deeper model) or the prefix", stacklevel=3)


@torch.no_grad()
def load_parameters(module: nn.Module, params: Collection[nn.Parameter],
                    weights: PretrainedWeights, device: torch.device,
                    pieces: Pieces | None = None, warn_unused: bool = True
                    ) -> list[nn.Parameter]:
    """Give ``params`` storage on ``device`` holding the file's values, reading only their
    tensors, and load the persistent buffers the file has. Returns the parameters of ``params``
    the file does not cover (outside the prefix), to be initialised.

    ``pieces``: parameters held as a region of the file's tensor (tensor-parallel shards):
    only that region is read (safetensors reads a slice without the rest of the tensor).
    ``warn_unused``: warn of the file's tensors the whole model reads nowhere (one rank
    warns: every rank would find the same)."""
    pieces = pieces or {}
    where = _where(weights)
    names = parameter_names(module)  # every parameter's names, tied ones all of theirs
    keys = _check(module, weights, where, pieces, names)
    read = [p for p in params if id(p) in keys]
    buffers = _persistent_buffers(module, weights.prefix, where)
    if warn_unused:
        _warn_unused(module, weights, where, buffers, names)
    for file in sorted({where[keys[id(p)]] for p in read} | {where[k] for k in buffers}):
        with _open(file) as f:
            for p in read:
                if where[keys[id(p)]] == file:
                    piece = pieces.get(id(p))
                    value = (f.get_tensor(keys[id(p)]) if piece is None
                             else f.get_slice(keys[id(p)])[piece.region])
                    set_storage(p, value.to(device=device, dtype=p.dtype))
            for key, (holder, bname) in buffers.items():
                if where[key] == file:
                    _load_buffer(holder, bname, f.get_tensor(key), key, file)
    return [p for p in params if id(p) not in keys]


def _persistent_buffers(module: nn.Module, prefix: str,
                        where: dict[str, Path]) -> dict[str, tuple[nn.Module, str]]:
    """File key -> (holding module, buffer name) of the persistent buffers the file has."""
    found = {}
    for mname, sub in module.named_modules():
        for bname, _ in sub.named_buffers(recurse=False):
            name = f"{mname}.{bname}" if mname else bname
            if (bname not in sub._non_persistent_buffers_set and name.startswith(prefix)
                    and name[len(prefix):] in where):
                found[name[len(prefix):]] = (sub, bname)
    return found


def _load_buffer(holder: nn.Module, bname: str, value: torch.Tensor, key: str, file: Path) -> None:
    buffer = holder._buffers[bname]
    assert buffer is not None
    if tuple(value.shape) != tuple(buffer.shape):
        raise PretrainedWeightsError(
            f"the tensor {key!r} in {file} has shape {list(value.shape)} but the model's "
            f"buffer has {list(buffer.shape)}: the weights are of another model or configuration")
    if buffer.is_meta:
        holder._buffers[bname] = value.to(dtype=buffer.dtype)
    else:
        buffer.copy_(value)


def load_pretrained(module: nn.Module, weights: PretrainedWeights | str | os.PathLike[str],
                    seed: int = 0, device: Any = "cpu") -> nn.Module:
    """The weights a deferred ``module`` gets under ``GeneralParallel(init_weights=...)``, on one
    device (as :func:`.materialize.initialize`, whose values those outside the prefix get)."""
    if not isinstance(weights, PretrainedWeights):
        weights = pretrained_weights(weights)
    rest = load_parameters(module, list(module.parameters()), weights, torch.device(device))
    if rest:
        initialize_parameters(module, rest, seed, torch.device(device))
    return module
