"""Sharded checkpoints (torch.distributed.checkpoint directories) and a deferred model's restore.

Used by :mod:`.checkpoint` (the checkpoint service; nothing here decides what to write) and by
``gsched consolidate`` (:func:`consolidate`: a directory as one ``.ckpt`` for plain Lightning).

**Sharded.** For a model too large to gather on one rank, ``state_dict_type="sharded"`` lets
every rank write the stages and ties it is the first owner of (rank 0 adds buffers, extra
parameters and the non-tensor trainer state), in parallel, without a full copy anywhere. Keys
are the module's own parameter names (``model.<name>``) and ``optim.<i>.<name>.<state key>``
(``<name>``: a parameter's first name, :func:`saved_names`), never stage numbers, so the
directory resumes under any schedule, worker count and (P, G, T) layout (a tensor-parallel
rank writes its pieces of a sharded parameter as ``DTensor`` views, whose offsets the directory
records; partition/tensor_parallel_state.py): :func:`load` reads every
tensor on every rank (each rank still holds the full model before its stages are released) into
an ordinary full checkpoint dict. The layout is the Trainer's (``state_dict``,
``optimizer_states``, the rest); a directory ``fabric.save`` wrote records which of the user's
keys held the model and the optimizers, and is read back under them ("Fabric's keys" below).

**Deferred restore.** Lightning restores a checkpoint's weights before the strategy's setup and
its optimizer state before the first batch, while a model built without weights still has its
parameters on the meta device, where a copy is a no-op. So the tensors are kept aside
(:class:`DeferredRestore`) and applied at the build, once each rank has given storage to the
parameters it keeps: a sharded directory is read then, each rank asking ``dcp.load`` for its
kept parameters, their optimizer state and the buffers (every rank holds every buffer); a full
checkpoint was memory-mapped (``checkpoint_files.load_mapped``) and only its kept entries are
applied, so only their pages are read.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.optim import Optimizer

from lightning_gsched.engine import checkpoint_files
from lightning_gsched.engine.rank_exchange import BoundedExchange
from lightning_gsched.errors import CheckpointError, CheckpointWriteError, StrategyConfigError
from lightning_gsched.runtime import ModelRuntime, Piece, Pieces, parameter_names

# dcp.save / dcp.load are read off the module at each call (a test replaces dcp.save to inject
# a failing write); torch re-exports them without __all__: hence attr-defined ignores there
META = "gsched_meta.pt"  # rank 0's non-tensor part of a sharded directory, written last

# (optimizer index, parameter's saved name, state field) -> a non-tensor state value
NonTensor = dict[tuple[int, str, str], Any]
StateDict = dict[str, Any]


def is_sharded_checkpoint(path: Any) -> bool:
    return os.path.isdir(str(path)) and os.path.isfile(os.path.join(str(path), META))


def saved_names(module: nn.Module, optimizer: Optimizer) -> list[str]:
    """The name each of ``optimizer``'s parameters has in a sharded directory: its first
    state-dict name (``param<i>`` for one the module does not hold)."""
    names = parameter_names(module)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [names[id(p)][0] if id(p) in names else f"param{i}" for i, p in enumerate(params)]


def _index(path: str) -> dict[str, TensorStorageMetadata]:
    """Every tensor's key -> its shape and dtype, from the directory's ``.metadata``."""
    layout = FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: m for k, m in layout.items() if isinstance(m, TensorStorageMetadata)}


def _empty(meta: TensorStorageMetadata, device: str = "cpu") -> torch.Tensor:
    return torch.empty(tuple(meta.size), dtype=meta.properties.dtype, device=device)


def _meta_file(path: str) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(os.path.join(path, META), weights_only=False,
                                        map_location="cpu")
    return loaded


def _optimizer_state(i: int, tensors: Mapping[str, torch.Tensor], non_tensor: NonTensor,
                     index_of: Mapping[str, int]) -> dict[int, dict[str, Any]]:
    """Optimizer ``i``'s per-parameter state from the directory's ``optim.<i>.*`` tensors and
    its non-tensor values, for the parameters ``index_of`` names (saved name -> index)."""
    state: dict[int, dict[str, Any]] = {}
    prefix = f"optim.{i}."
    for key, value in tensors.items():
        if key.startswith(prefix):
            name, fld = key[len(prefix):].rsplit(".", 1)
            if name in index_of:
                state.setdefault(index_of[name], {})[fld] = value
    for (j, name, fld), value in non_tensor.items():
        if j == i and name in index_of:
            state.setdefault(index_of[name], {})[fld] = value
    return dict(sorted(state.items()))


def _kept_index(module: nn.Module, optimizer: Optimizer, kept_ids: set[int]) -> dict[str, int]:
    """Saved name -> index in ``optimizer`` of each kept parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {name: i for i, (name, p) in enumerate(zip(saved_names(module, optimizer), params,
                                                      strict=True)) if id(p) in kept_ids}


# ---------------------------------------------------------------------------- saving


def writer_of_names(module: nn.Module, runtime: ModelRuntime | None, rank: int,
                    world: int) -> Callable[[str], bool]:
    """Which state-dict keys this rank writes.

    While stages are distributed: a stage or tie parameter is written by its first owner,
    everything else (buffers, extra parameters) by rank 0. After a run (every rank holds the full
    model again) the keys are dealt round-robin, so the write is still spread over the ranks.
    """
    if runtime is None:
        keys = list(module.state_dict().keys())
        return {k for i, k in enumerate(keys) if i % world == rank}.__contains__
    names = parameter_names(module)
    stage_names = {n for p in runtime.stage_parameters() for n in names.get(id(p), [])}
    # frozen parameters too: primary_parameters() holds only those taking gradients (a frozen
    # stage parameter was written by no rank, and the directory could not be resumed)
    written = {n for p in runtime.written_parameters() for n in names.get(id(p), [])}
    return lambda key: key in written or (rank == 0 and key not in stage_names)


def local_model_state(module: nn.Module, is_mine: Callable[[str], bool]) -> StateDict:
    """The state-dict entries this rank writes (copies: stage views share one buffer)."""
    return {k: v.detach().clone() for k, v in module.state_dict().items() if is_mine(k)}


def local_optimizer_state(module: nn.Module, optimizer: Optimizer,
                          is_mine: Callable[[str], bool]) -> StateDict:
    """Optimizer state of the parameters whose (first) name this rank writes, keyed by name
    (each entry a copy: ``optimizer.state_dict()``'s entries are the optimizer's own dicts)."""
    index_names = saved_names(module, optimizer)
    state = optimizer.state_dict()
    local = {index_names[i]: dict(entry) for i, entry in state["state"].items()
             if is_mine(index_names[i])}
    return {"state": local, "param_groups": state["param_groups"], "index_names": index_names}


def save(checkpoint: StateDict, path: Any, rank: int, timeout: float = 300.0) -> None:
    """Write ``path/`` (collective): DCP shards plus rank 0's non-tensor metadata.

    Every rank writes into one staging directory next to ``path`` (same name on every rank);
    rank 0 swaps it in only after every rank finished, so an interrupted save leaves the
    previous checkpoint whole and its staging directory is removed (checkpoint_files). The
    ranks agree after each phase (:class:`_Phases`, bounded by ``timeout``, the
    ``step_timeout``): a rank that fails raises its own error, and every other rank raises a
    CheckpointWriteError naming it, instead of waiting in a barrier for the launcher's timeout.
    """
    path = str(path)
    staging = checkpoint_files.staging_name(path, unique=False)
    phases = _Phases(path, rank, timeout)
    try:
        with phases.phase("preparing the save"):
            tensors, others, optim_meta = _split(checkpoint)
            if rank == 0:
                checkpoint_files.check_replaceable(path)
                checkpoint_files.remove_stale(path)
                os.makedirs(staging)
        gathered = phases.exchange.gather(others, "gathering the optimizers' non-tensor state")
        with phases.phase("writing its shards"):
            dcp.save(tensors, checkpoint_id=staging)  # type: ignore[attr-defined]
            if rank == 0:
                merged: NonTensor = {}
                for part in gathered:
                    merged.update(part)
                rest = {k: v for k, v in checkpoint.items()
                        if k not in ("state_dict", "optimizer_states")}
                torch.save({"rest": rest, "optimizers": optim_meta, "non_tensor": merged},
                           os.path.join(staging, META))
        with phases.phase("putting the directory in place"):
            if rank == 0:
                checkpoint_files.put_in_place(staging, path)
    except BaseException:
        # rank 0 removes the staging directory (a peer may still be leaving it); a rank 0 that
        # was killed leaves it to the next save of this name (checkpoint_files.remove_stale)
        if rank == 0:
            checkpoint_files.discard(staging)
        raise
    finally:
        phases.exchange.close()


def _split(checkpoint: StateDict) -> tuple[dict[str, torch.Tensor], NonTensor, list[Any]]:
    """(the tensors DCP writes, the optimizers' non-tensor state, their groups and names)."""
    tensors: dict[str, torch.Tensor] = {}
    others: NonTensor = {}
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
    return tensors, others, optim_meta


class _Phases:
    """The phases of one sharded save, each ended by every rank's outcome (bounded)."""

    def __init__(self, path: str, rank: int, timeout: float) -> None:
        """Make the save's own group, every rank (bounded by ``timeout``): a peer that never
        starts the save (it failed before, e.g. in a checkpoint hook) is a
        CheckpointWriteError here, not the backend's store time-out."""
        self.path, self.rank, self.timeout = path, rank, timeout
        self.exchange = BoundedExchange(timeout, self._lost)

    def _lost(self, during: str | None, reason: str) -> CheckpointWriteError:
        """The save's error for a peer that never started it or stopped answering."""
        if during is None:
            return CheckpointWriteError(
                f"the sharded save of {self.path}: rank {self.rank} waited {self.timeout:g} s "
                "(step_timeout) for every rank to start the save, and a peer never did: it "
                f"failed before saving (see that rank's error) or hangs ({reason}). Nothing was "
                "written; the previous checkpoint under that name is kept")
        return CheckpointWriteError(
            f"the sharded save of {self.path}: rank {self.rank} heard nothing from a peer "
            f"within {self.timeout:g} s (step_timeout) while {during}: a rank died or hangs "
            f"({reason}). The previous checkpoint under that name is kept")

    @contextmanager
    def phase(self, what: str) -> Iterator[None]:
        """Run the body; then every rank learns every rank's outcome. This rank's own failure
        is re-raised as it was; a peer's becomes a CheckpointWriteError naming it."""
        error: BaseException | None = None
        try:
            yield
        # CheckpointException (dcp.save's, raised on every rank alike) is a BaseException
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - re-raised below
            error = exc
        mine = None if error is None else f"{type(error).__name__}: {error}"
        try:
            outcomes = self.exchange.gather(mine, what)
        except CheckpointWriteError:
            if error is None:
                raise
            outcomes = []  # this rank's own failure is the news: raised below
        if error is not None:
            raise error
        failed = [(r, outcome) for r, outcome in enumerate(outcomes) if outcome is not None]
        if failed:
            r, outcome = failed[0]
            raise CheckpointWriteError(
                f"the sharded save of {self.path} failed on rank {r} while {what} "
                f"({outcome}); this rank stopped with it. The previous checkpoint under that "
                "name is kept; fix the cause on that rank (e.g. its disk) and save again")


# ---------------------------------------------------------------------------- Fabric's keys

# In a directory fabric.save wrote: which of the user's keys held the model and the optimizers
ENTRIES = "gsched_entries"
_LAYOUT_KEYS = ("state_dict", "optimizer_states", ENTRIES)


def in_directory_layout(state: StateDict, model_key: str | None,
                        optimizer_keys: Sequence[str]) -> StateDict:
    """``fabric.save``'s ``state`` (the user's keys, each object already a state dict) in the
    directory's layout, the Trainer's: the model's entries as ``state_dict``, the optimizers'
    as ``optimizer_states`` (in ``optimizer_keys``' order), everything else as rank 0 writes
    it, and the user's keys recorded (:data:`ENTRIES`) so that :func:`in_user_layout` gives
    them back. Why one layout: a directory is the same whichever front end wrote it, and
    :func:`save` / :func:`load` know only it."""
    clash = [k for k in state if k in _LAYOUT_KEYS and k != model_key and k not in optimizer_keys]
    if clash:
        raise StrategyConfigError(
            f"fabric.save with state_dict_type='sharded': the key {clash[0]!r} is the sharded "
            "directory's own; store that entry under another name")
    rest = {k: v for k, v in state.items() if k != model_key and k not in optimizer_keys}
    return {**rest, "state_dict": state[model_key] if model_key is not None else {},
            "optimizer_states": [state[k] for k in optimizer_keys],
            ENTRIES: {"model": model_key, "optimizers": list(optimizer_keys)}}


def in_user_layout(checkpoint: StateDict) -> StateDict:
    """A directory read back under the keys ``fabric.save`` was given (a directory the
    Trainer wrote has no :data:`ENTRIES` and keeps Lightning's keys)."""
    entries = checkpoint.get(ENTRIES)
    if entries is None:
        return checkpoint
    out = {k: v for k, v in checkpoint.items() if k not in _LAYOUT_KEYS}
    if entries["model"] is not None:
        out[entries["model"]] = checkpoint["state_dict"]
    for key, state in zip(entries["optimizers"], checkpoint["optimizer_states"], strict=True):
        out[key] = state
    return out


# ---------------------------------------------------------------------------- loading


def load(path: Any) -> StateDict:
    """Read a sharded directory into an ordinary full checkpoint dict (collective)."""
    path = str(path)
    meta = _meta_file(path)
    tensors = {key: _empty(m) for key, m in _index(path).items()}
    dcp.load(tensors, checkpoint_id=path)  # type: ignore[attr-defined]
    state_dict = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    optimizer_states = []
    for i, om in enumerate(meta["optimizers"]):
        index_of = {name: index for index, name in enumerate(om["index_names"] or [])}
        optimizer_states.append({"state": _optimizer_state(i, tensors, meta["non_tensor"],
                                                           index_of),
                                 "param_groups": om["param_groups"]})
    return {**meta["rest"], "state_dict": state_dict, "optimizer_states": optimizer_states}


def consolidate(path: Any, out: Any) -> StateDict:
    """Write the sharded directory ``path`` as one full checkpoint file ``out`` (one process,
    no process group): what ``state_dict_type="full"`` would have written, in the keys the
    writer used (the Trainer's, or those ``fabric.save`` was given). Why: plain Lightning
    (``MyModule.load_from_checkpoint``, a one-device ``fit(ckpt_path=...)``) and ``torch.load``
    read a file, not a directory. It holds the whole model in memory. Returns what it wrote."""
    path = str(path)
    if not is_sharded_checkpoint(path):
        raise CheckpointError(
            f"{path} is not a sharded checkpoint directory of lightning_gsched (no {META} in "
            "it): give the directory that state_dict_type='sharded' wrote, e.g. "
            "checkpoints/last.ckpt")
    with warnings.catch_warnings():  # dcp: "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message=".*load in a single process.*")
        checkpoint = in_user_layout(load(path))
    checkpoint_files.atomic_save(checkpoint, out)
    return checkpoint


def saved_model_entries(path: Any) -> dict[str, torch.Tensor]:
    """The model entries of a sharded directory as meta tensors of their saved shapes.

    Why: a model built without weights reads the directory's tensors only at the build, but
    Lightning restores the optimizers' param groups before it, so another model's directory
    would fail there in torch's own words. The index holds every key's shape, so the directory
    can be checked against the model when it is given, reading no tensor."""
    return {key[len("model."):]: _empty(m, "meta") for key, m in _index(str(path)).items()
            if key.startswith("model.")}


def load_deferred(path: Any) -> tuple[StateDict, DeferredRestore]:
    """A sharded directory for a model built without weights: the checkpoint without its
    tensors now (optimizers get their param groups only), and the tensors at the build."""
    path = str(path)
    meta = _meta_file(path)
    optimizer_states = [{"state": {}, "param_groups": om["param_groups"]}
                        for om in meta["optimizers"]]
    checkpoint = {**meta["rest"], "state_dict": {}, "optimizer_states": optimizer_states}
    return checkpoint, DeferredRestore(path=path, non_tensor=dict(meta["non_tensor"]))


def _kept_params(optimizer: Optimizer, names: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """Saved name -> parameter, for the kept parameters ``names`` indexes in ``optimizer``."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {name: params[i] for name, i in names.items()}


def _buffer(like: torch.Tensor, piece: Piece | None, shape: torch.Size) -> torch.Tensor:
    """What ``dcp.load`` fills for a tensor shaped ``shape`` on this rank: a CPU buffer, seen
    as the full tensor when it holds a piece (only its region is read)."""
    local = torch.empty(shape, dtype=like.dtype, device="cpu")
    return local if piece is None or piece.view is None else piece.view(local)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A buffer ``dcp.load`` filled, as the local tensor it holds (a piece's view unwrapped)."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else cast(torch.Tensor, to_local())


def _cut(full: torch.Tensor, piece: Piece | None) -> torch.Tensor:
    """A saved full tensor as this rank keeps it (a mapped file: only the region's pages)."""
    return full if piece is None or tuple(full.shape) != tuple(piece.shape) else piece.cut(full)


class DeferredRestoreError(StrategyConfigError):
    """A checkpoint resumed into a model built without weights lacks a tensor the model has."""


@dataclass
class DeferredRestore:
    """A checkpoint's model and optimizer state, applied at the build (see the module doc).

    ``path``: a sharded directory, read at :meth:`apply` (``non_tensor``: its optimizers'
    non-tensor entries); else ``state_dict`` and ``optimizer_states``: a full checkpoint's,
    already in memory (mapped)."""

    path: str | None = None
    non_tensor: NonTensor = field(default_factory=dict)
    state_dict: Mapping[str, torch.Tensor] | None = None
    optimizer_states: list[StateDict] | None = None

    def apply(self, module: nn.Module, kept: Sequence[nn.Parameter],
              optimizers: Sequence[Optimizer], pieces: Pieces | None = None) -> None:
        """Fill ``kept`` (which have storage now), every persistent buffer and the kept
        parameters' optimizer state (collective for a sharded directory: ``dcp.load``).

        ``pieces``: kept parameters held as a region of the saved tensor (tensor-parallel
        shards): a sharded directory fills only that region (through the piece's global view),
        a full checkpoint's tensor is cut to it; their optimizer state likewise."""
        pieces = pieces or {}
        kept_ids = {id(p) for p in kept}
        index_of = [_kept_index(module, optimizer, kept_ids) for optimizer in optimizers]
        params_of = [_kept_params(optimizer, names) for optimizer, names in
                     zip(optimizers, index_of, strict=True)]
        if self.path is not None:
            index = _index(self.path)
            where = self._model_keys(module, kept, {k[len("model."):] for k in index
                                                    if k.startswith("model.")})
            tensors = {f"model.{key}": _buffer(t, pieces.get(id(t)), t.shape)
                       for key, t in where.items()}
            for i, names in enumerate(index_of):  # the kept parameters' optimizer tensors
                prefix = f"optim.{i}."
                for key, meta in index.items():
                    name = key[len(prefix):].rsplit(".", 1)[0]
                    if key.startswith(prefix) and name in names:
                        param = params_of[i][name]
                        piece = pieces.get(id(param))
                        shaped = piece is not None and tuple(meta.size) == tuple(piece.shape)
                        tensors[key] = (_buffer(param, piece, param.shape) if shaped
                                        else _empty(meta))
            dcp.load(tensors, checkpoint_id=self.path)  # type: ignore[attr-defined]
            tensors = {key: _local(t) for key, t in tensors.items()}
            values = {key: tensors[f"model.{key}"] for key in where}
            states = [_optimizer_state(i, tensors, self.non_tensor, names)
                      for i, names in enumerate(index_of)]
        else:
            assert self.state_dict is not None
            where = self._model_keys(module, kept, set(self.state_dict))
            values = {key: _cut(self.state_dict[key], pieces.get(id(t)))
                      for key, t in where.items()}
            # an optimizer the checkpoint has no state for is left as it is (its full-shaped
            # tensors are cut to the shards by the caller, one at a time)
            states = [{int(i): entry for i, entry in saved.get("state", {}).items()
                       if int(i) in names.values()}
                      for saved, names in zip(self.optimizer_states or [], index_of,
                                              strict=False)]
            # the whole checkpoint's tensors are not kept past the build
            self.state_dict, self.optimizer_states = None, None
        with torch.no_grad():
            for key, tensor in where.items():
                tensor.copy_(values[key])
        for optimizer, state in zip(optimizers, states, strict=False):
            # keep the param groups Lightning restored (and the LR scheduler's) with the rest
            groups = optimizer.state_dict()["param_groups"]
            optimizer.load_state_dict({"state": state, "param_groups": groups})

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
