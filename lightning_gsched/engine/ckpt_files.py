"""Checkpoint files written so that an interrupted save leaves nothing behind.

Why: Lightning's ``_atomic_save`` goes through an fsspec transaction, which for a local path
writes into the *system* temporary folder and moves the file at commit: a move across file
systems is a copy (not atomic), and a process killed mid-write leaves the temporary file in
``/tmp``. Here a full checkpoint is written to a temporary name next to its target, flushed to
disk and renamed over it (``os.replace``, atomic within one directory); on any exception the
temporary file is removed, and the previous checkpoint under that name is untouched until the
rename. A sharded checkpoint (a directory several ranks write into) is staged the same way in
a sibling directory and swapped in once every rank has written its part.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from typing import Any, BinaryIO, Iterator

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

PARTIAL = ".partial"  # suffix of every staging name: a leftover is recognisable as one


def staging_name(path: str, unique: bool = True) -> str:
    """The hidden sibling a save of ``path`` writes first (``.<name>.<token>.partial``)."""
    directory, name = os.path.split(os.path.abspath(path))
    token = f".{os.getpid()}-{secrets.token_hex(4)}" if unique else ""
    return os.path.join(directory, f".{name}{token}{PARTIAL}")


def remove_stale(path: str) -> None:
    """Remove what an earlier save of ``path`` that was killed (SIGKILL, power loss) left."""
    directory, name = os.path.split(os.path.abspath(path))
    if not os.path.isdir(directory):
        return
    for entry in os.listdir(directory):
        if entry.startswith(f".{name}.") and entry.endswith(PARTIAL):
            _remove(os.path.join(directory, entry))


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)


def _fsync_directory(directory: str) -> None:
    """Make the rename durable (best effort: not every file system allows opening a folder)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_file(path: Any) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into: a temporary name next to it, flushed
    to disk and renamed over ``path`` when the block ends; removed if the block raises."""
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    remove_stale(path)
    staging = staging_name(path)
    # mode 0o666 (less the umask), as a plain open() would give the checkpoint
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(staging, path)
    except BaseException:
        _remove(staging)
        raise
    _fsync_directory(directory)


def atomic_save(obj: Any, path: Any) -> None:
    """``torch.save(obj)`` to ``path``: readers see the old file or the whole new one."""
    with atomic_file(path) as f:
        torch.save(obj, f)


def swap_in_directory(staging: str, path: str) -> None:
    """Put the fully written directory ``staging`` at ``path`` (replacing an older one).

    A directory cannot be renamed over a non-empty one, so the old one is first renamed aside
    (another ``.partial`` name, removed by the next save if this process dies in between).
    """
    aside = None
    if os.path.isdir(path):
        aside = staging_name(path)
        os.rename(path, aside)
    try:
        os.rename(staging, path)
    except BaseException:
        if aside is not None:
            os.rename(aside, path)
        raise
    if aside is not None:
        _remove(aside)
    _fsync_directory(os.path.dirname(os.path.abspath(path)))


def discard(staging: str) -> None:
    """Remove a staging file or directory after a failed save (never raises)."""
    _remove(staging)


def written_here(checkpoint_io: Any, default_io: type, path: Any,
                 storage_options: Any = None) -> bool:
    """Whether the strategy reads and writes ``path`` itself: the front end's default
    CheckpointIO (``default_io``: Lightning's ``TorchCheckpointIO``, which this package does not
    import) and a local path, as Lightning's ``get_filesystem`` resolves it. A user's
    CheckpointIO, storage options or a remote URL keep their own reader and writer."""
    if type(checkpoint_io) is not default_io or storage_options is not None:
        return False
    filesystem, _ = url_to_fs(str(path))
    return isinstance(filesystem, LocalFileSystem)
