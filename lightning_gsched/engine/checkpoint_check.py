"""A checkpoint read on every rank, checked, and the verdict agreed: one CheckpointError for all.

Used only by :mod:`.checkpoint` (the checkpoint service), for ``ckpt_path`` (the Trainer) and
``fabric.load`` alike. Why: every rank reads the checkpoint itself. A truncated file (a save
that was killed), another model's checkpoint, or a sharded directory whose save never finished
would otherwise end in a backend error deep inside ``torch.load``/``load_state_dict``, or worse,
on some ranks only (a path that is not on a file system every rank shares) while the others go
on into the first step's collectives and wait there. Here each rank reads and checks the
checkpoint, the ranks exchange what they found on a group whose timeout is ``step_timeout``,
and if any rank found a problem every rank raises the same :class:`CheckpointError`, naming the
file and what is wrong.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from lightning_gsched.engine.checkpoint_sharded import META
from lightning_gsched.engine.rank_exchange import BoundedExchange
from lightning_gsched.errors import CheckpointError
from lightning_gsched.partition.tensor_parallel import shard_specs

TRAINER = "ckpt_path"  # how the messages name the argument read
FABRIC = "fabric.load path"
EARLIER = "resume from an earlier checkpoint, or start without ckpt_path"
SHOWN = 3  # how many missing parameter names a message lists

Check = Callable[[Any], Optional[str]]  # a read checkpoint -> what is wrong with it (None: ok)


def _short(exc: BaseException) -> str:
    """Type and first line of the error; for torch.distributed.checkpoint's exception (which
    gathers every rank's), the first rank's underlying error."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (inner, _) = next(iter(sorted(exc.failures.items())))
        return f"on rank {rank}: {_short(inner)}"
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first[:200]}"


def precheck(path: str, what: str) -> Optional[str]:
    """What is wrong with ``path`` before reading it (None: go on and read it)."""
    if not os.path.exists(path):
        if what != TRAINER:
            return f"{what} {path} does not exist: pass a file written by fabric.save"
        return (f"ckpt_path {path} does not exist: pass a .ckpt file or a sharded checkpoint "
                "directory (ckpt_path='last' needs a ModelCheckpoint with save_last=True)")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, META)):
            return (f"ckpt_path {path} is a directory without {META}: not a sharded checkpoint "
                    "of GeneralParallel, or one whose save never finished (the metadata is "
                    f"written last); {EARLIER}")
        if not os.path.isfile(os.path.join(path, ".metadata")):
            return (f"ckpt_path {path} is a sharded checkpoint without its "
                    "torch.distributed.checkpoint index (.metadata): it is incomplete; "
                    f"{EARLIER}")
    return None


def unreadable(path: str, exc: BaseException, what: str) -> str:
    """The message for a checkpoint that could not be read."""
    part = "a shard of the sharded checkpoint" if os.path.isdir(path) else "the file"
    earlier = EARLIER if what == TRAINER else "load an earlier checkpoint"
    return (f"{what} {path} is truncated or not a checkpoint: reading {part} failed "
            f"({_short(exc)}). Its save was interrupted or the file was damaged; {earlier}")


def lightning_problem(path: str, checkpoint: Any, module: Optional[nn.Module]) -> Optional[str]:
    """What makes ``checkpoint`` (read from ``ckpt_path``) unusable for ``module``."""
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        return (f"ckpt_path {path} is not a Lightning checkpoint (no 'state_dict' in it); pass "
                "a checkpoint written by Trainer.save_checkpoint or ModelCheckpoint")
    if module is None:
        return None
    return mismatch(f"ckpt_path {path}", checkpoint["state_dict"], module)


def fabric_problem(path: str, checkpoint: Any, state: Any, strict: bool) -> Optional[str]:
    """What makes ``checkpoint`` unusable for ``fabric.load(path, state)``. Each module in
    ``state`` must find its own parameters under its key; missing keys are Fabric's to report
    (``strict``)."""
    if not isinstance(checkpoint, dict):
        return (f"{FABRIC} {path} holds a {type(checkpoint).__name__}, not the dict "
                "fabric.save writes; pass a file written by fabric.save")
    if isinstance(state, nn.Module):
        return mismatch(f"{FABRIC} {path}", checkpoint, state) if strict else None
    if not isinstance(state, dict):
        return None
    for key, value in state.items():
        if isinstance(value, nn.Module) and key in checkpoint:
            saved = checkpoint[key]
            if not isinstance(saved, dict):
                return (f"{FABRIC} {path} holds a {type(saved).__name__} under {key!r}, not a "
                        "module's state_dict; pass a checkpoint of this model")
            if strict:
                found = mismatch(f"{FABRIC} {path} (under {key!r})", saved, value)
                if found:
                    return found
    return None


def mismatch(where: str, saved: Mapping[str, Any], module: nn.Module) -> Optional[str]:
    """What makes the state dict ``saved`` (found at ``where``) another model's (None: it is
    this model's)."""
    wanted = {k: v for k, v in module.state_dict().items() if hasattr(v, "shape")}
    missing = [k for k in wanted if k not in saved]
    name = type(module).__name__
    if missing:
        some = ", ".join(missing[:SHOWN]) + (", ..." if len(missing) > SHOWN else "")
        return (f"{where} does not hold this model's parameters: {len(missing)} of "
                f"{len(wanted)} entries of {name}'s state_dict are missing ({some}); it was "
                f"saved from another model. Pass a checkpoint of {name}")
    full = {name: spec.shape for name, spec in shard_specs(module).items()}  # of shards
    for key, value in wanted.items():
        got = saved[key]
        if value.numel() == 0 and value.dim() <= 1:
            continue  # a running pipeline released it on this rank: its shape is not known here
        shape = tuple(full.get(key, value.shape))  # a checkpoint holds the full tensor
        if hasattr(got, "shape") and tuple(got.shape) != shape:
            return (f"{where} holds {key} with shape {tuple(got.shape)}, but this "
                    f"{name} has {shape}: it was saved from a model of another "
                    f"size. Pass a checkpoint of this model")
    if getattr(module, "strict_loading", True):
        extra = [k for k in saved if k not in wanted and k not in module.state_dict()]
        if extra:
            some = ", ".join(extra[:SHOWN]) + (", ..." if len(extra) > SHOWN else "")
            return (f"{where} holds {len(extra)} entries {name} does not have "
                    f"({some}); pass a checkpoint of this model, or set "
                    "strict_loading = False on it to ignore them")
    return None


class Agreement:
    """The ranks exchange what each found; any problem becomes every rank's CheckpointError.
    The exchange is bounded by ``timeout``: a peer that never starts the load (it failed or was
    killed before it) or stops answering is a CheckpointError here too, not the backend's
    store or gloo time-out."""

    def __init__(self, timeout: float, path: str) -> None:
        self.path, self.timeout = path, timeout
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.exchange = BoundedExchange(timeout, self._lost)
        self.world = self.exchange.world

    def _lost(self, during: Optional[str], reason: str) -> CheckpointError:
        """The load's error for a peer that never started it or stopped answering."""
        if during is None:
            return CheckpointError(
                f"loading {self.path}: rank {self.rank} waited {self.timeout:g} s (step_timeout) "
                "for every rank to start loading it, and a peer never did: it failed before the "
                f"load (see that rank's error) or hangs ({reason})")
        return CheckpointError(
            f"loading {self.path}: rank {self.rank} heard nothing from a peer within "
            f"{self.timeout:g} s (step_timeout) while {during}: a rank died or hangs ({reason})")

    def __call__(self, problem: Optional[str]) -> None:
        problems: list[Optional[str]] = self.exchange.gather(
            problem, "the ranks compared what they read")
        found = [(rank, p) for rank, p in enumerate(problems) if p is not None]
        if not found:
            return
        first = found[0][1]
        if len(found) < self.world:  # some ranks read it fine
            first += (f" (found by rank(s) {[r for r, _ in found]}; the other ranks read it: is "
                      "the path on a file system every rank shares?)")
        raise CheckpointError(first)

    def close(self) -> None:
        self.exchange.close()


def load_checked(path: Any, read: Callable[[], Any], check: Check, timeout: float,
                 what: str) -> Any:
    """``read()`` the checkpoint at ``path`` on every rank, ``check(checkpoint)`` it, and agree
    (bounded by ``timeout``): any rank's problem is every rank's CheckpointError."""
    name = str(path)
    agree = Agreement(timeout, name)
    try:
        agree(precheck(name, what))  # before read(): a sharded read is collective
        checkpoint: Any = None
        try:
            checkpoint = read()
            problem = check(checkpoint)
        # CheckpointException (a sharded read, raised on every rank) is a BaseException
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported as such
            problem = unreadable(name, exc, what)
        agree(problem)
    finally:
        agree.close()
    return checkpoint
