"""``fabric.save`` written atomically, ``fabric.load`` checked on every rank first.

Why: Fabric's own ``TorchCheckpointIO`` writes through an fsspec transaction that stages the
file in the system temporary folder (a kill leaves it there; a move across file systems is a
copy, not atomic), and ``fabric.load`` of a truncated file or another model's checkpoint ends in
``torch.load``'s or ``load_state_dict``'s error, or on some ranks only. The Trainer strategy's
answers (:mod:`lightning_gsched.engine.ckpt_files`, :mod:`lightning_gsched.engine.ckpt_check`)
serve Fabric too: a temporary name next to the target renamed over it, and a
:class:`~lightning_gsched.errors.CheckpointError` naming the file and the problem, raised on
every rank.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch import nn

from lightning_gsched.engine import ckpt_files
from lightning_gsched.engine.ckpt_check import mismatch

WHAT = "fabric.load path"


def handled_here(checkpoint_io: Any, path: Any, storage_options: Any = None) -> bool:
    """Fabric's default CheckpointIO and a local path (a user's CheckpointIO or a remote URL
    keeps its own reader and writer)."""
    return ckpt_files.written_here(checkpoint_io, TorchCheckpointIO, path, storage_options)


def problem_of(path: Any, checkpoint: Any, state: Any, strict: bool) -> Optional[str]:
    """What makes ``checkpoint`` unusable for ``fabric.load(path, state)`` (None: nothing).
    Each module in ``state`` must find its own parameters under its key; missing keys are
    Fabric's to report (``strict``)."""
    if not isinstance(checkpoint, dict):
        return (f"{WHAT} {path} holds a {type(checkpoint).__name__}, not the dict fabric.save "
                "writes; pass a file written by fabric.save")
    if isinstance(state, nn.Module):
        return mismatch(f"{WHAT} {path}", checkpoint, state) if strict else None
    if not isinstance(state, dict):
        return None
    for key, value in state.items():
        if isinstance(value, nn.Module) and key in checkpoint:
            saved = checkpoint[key]
            if not isinstance(saved, dict):
                return (f"{WHAT} {path} holds a {type(saved).__name__} under {key!r}, not a "
                        "module's state_dict; pass a checkpoint of this model")
            if strict:
                found = mismatch(f"{WHAT} {path} (under {key!r})", saved, value)
                if found:
                    return found
    return None


class Preloaded:
    """A CheckpointIO stand-in whose ``load_checkpoint`` returns what was already read and
    checked, so Fabric's own ``load_checkpoint`` restores it without reading it again."""

    def __init__(self, checkpoint: dict) -> None:
        self.checkpoint = checkpoint

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict:
        return self.checkpoint
