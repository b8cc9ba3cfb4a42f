"""Full checkpoint files: written atomically, streamed into torch's zip format, read mapped.

Used only by :mod:`.checkpoint` (the checkpoint service); nothing here decides what to write.

**Atomic.** Lightning's ``_atomic_save`` goes through an fsspec transaction, which for a local
path writes into the *system* temporary folder and moves the file at commit: a move across file
systems is a copy (not atomic), and a process killed mid-write leaves the temporary file in
``/tmp``. Here a file is written to a hidden ``.partial`` name next to its target, flushed and
renamed over it (``os.replace``, atomic within one directory); on any exception the temporary is
removed and the previous checkpoint stays untouched until the rename. A sharded checkpoint (a
directory several ranks write into) is staged the same way in a sibling directory and put in
place once every rank has written its part (:func:`put_in_place`). Either kind replaces an older
checkpoint of the other kind under the same name (a run resumed with another
``state_dict_type`` in the same ``ModelCheckpoint`` folder), as Lightning's FSDPStrategy does.

**Streamed.** ``torch.save`` needs every tensor of the object it writes, so a full checkpoint of
a model larger than one rank cannot be assembled on rank 0 first. The file ``torch.save`` writes
is a zip archive: ``data.pkl`` (each storage a persistent id naming a record ``data/<key>``), a
few small records and one record per storage. :func:`save_streamed` writes the pickle first,
each :class:`~lightning_gsched.runtime.StreamedTensor` placeholder pickled as the tensor it
stands for (``torch._utils._rebuild_tensor_v2`` over a storage id, as torch pickles a contiguous
tensor), then the real storages, then each streamed tensor as its own record when the transfer
hands it over, and drops it. ``torch.load`` (``weights_only``, ``mmap``, ``map_location``) reads
the file as one of its own. One difference: ``.format_version`` 1 (records in the pickle's
order) is left out, as streamed records come in transfer order. Why this is kept hand-written
rather than built from ``torch.distributed.checkpoint`` or ``torch.serialization.skip_data``:
measured in docs/memory.md ("Why the streamed writer is hand-written",
``benchmarks/bench_ckpt_writer.py``).

**Mapped.** :func:`load_mapped`: a full checkpoint resumed into a model built without weights,
with its tensors memory-mapped, so each rank reads only the pages of what it keeps.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import secrets
import shutil
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator, cast

import torch
from torch.types import Storage

from lightning_gsched.errors import CheckpointWriteError
from lightning_gsched.runtime import StreamedTensor

PARTIAL = ".partial"  # suffix of every staging name: a leftover is recognisable as one

Sink = Callable[[StreamedTensor, torch.Tensor], None]
# runs the transfer: calls the sink on rank 0 for each tensor, and the second argument with the
# bytes rank 0 holds for the transfer (a received buffer) whenever that changes
Stream = Callable[[Sink | None, Callable[[int], None]], object]


# ---------------------------------------------------------------------------- atomic


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
            discard(os.path.join(directory, entry))


def discard(path: str) -> None:
    """Remove a staging file or directory (never raises)."""
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
    check_replaceable(path)  # before anything is written
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
        put_in_place(staging, path)
    except BaseException:
        discard(staging)
        raise


def atomic_save(obj: Any, path: Any) -> None:
    """``torch.save(obj)`` to ``path``: readers see the old file or the whole new one."""
    with atomic_file(path) as f:
        torch.save(obj, f)


# what torch.distributed.checkpoint writes into every directory it completes (ours and
# Lightning's FSDPStrategy's sharded checkpoints alike)
DCP_METADATA = ".metadata"


def check_replaceable(path: str) -> None:
    """Refuse a save whose target is a directory holding files that is not a sharded checkpoint:
    putting the checkpoint in place replaces what is there, and a user's folder given as the
    checkpoint's path (a typo, ``.``) would be deleted with everything in it. An empty folder
    and an older sharded checkpoint are replaced (the documented behaviour)."""
    if (os.path.isdir(path) and not os.path.islink(path) and os.listdir(path)
            and not os.path.isfile(os.path.join(path, DCP_METADATA))):
        raise CheckpointWriteError(
            f"will not save a checkpoint to {path!r}: it is a directory that holds files and "
            f"is not a sharded checkpoint (it has no {DCP_METADATA}), and saving there would "
            "replace it and everything in it. Save to another path (a file name for a full "
            "checkpoint, a new directory for a sharded one), or remove the directory first")


def put_in_place(staging: str, path: str) -> None:
    """Put the fully written ``staging`` (a file or a directory) at ``path``, replacing what is
    there: nothing, or an older checkpoint of either kind (:func:`check_replaceable` refuses
    anything else).

    A file over a file is one atomic rename. A directory cannot be renamed over a non-empty
    one, nor a file over a directory or the reverse, so there the old entry is first renamed
    aside (another ``.partial`` name, removed by the next save if this process dies in between).
    """
    check_replaceable(path)
    aside = None
    if os.path.isdir(path) or (os.path.isdir(staging) and os.path.lexists(path)):
        aside = staging_name(path)
        os.rename(path, aside)
    try:
        os.replace(staging, path)
    except BaseException:
        if aside is not None:
            os.rename(aside, path)
        raise
    if aside is not None:
        discard(aside)
    _fsync_directory(os.path.dirname(os.path.abspath(path)))


def load_mapped(path: Any, weights_only: bool | None = None) -> Any:
    """A full checkpoint with its tensors memory-mapped from the file, not copied: a model
    built without weights applies only what its rank keeps, so each rank reads its own share of
    the pages. A file torch cannot map (the legacy, pre-zip format) is read whole."""
    try:
        return torch.load(str(path), map_location="cpu", mmap=True, weights_only=weights_only)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
        return torch.load(str(path), map_location="cpu", weights_only=weights_only)


# ---------------------------------------------------------------------------- streamed


@dataclass
class StreamStats:
    """What one streamed save held and wrote on rank 0."""

    peak_bytes: int = 0  # the most tensor bytes held at once for the save (received/copied)
    records: int = 0  # streamed tensors written

    def hold(self, nbytes: int) -> None:
        self.peak_bytes = max(self.peak_bytes, nbytes)


class _Slot:
    """The storage a placeholder's tensor will have: what ``persistent_id`` sees of it."""

    __slots__ = ("placeholder",)

    def __init__(self, placeholder: StreamedTensor) -> None:
        self.placeholder = placeholder


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, n = [], 1
    for size in reversed(shape):
        stride.append(n)
        n *= max(size, 1)
    return tuple(reversed(stride))


def _uses_v3(dtype: torch.dtype) -> bool:
    """Dtypes torch pickles over an untyped storage (``_rebuild_tensor_v3``)."""
    return dtype in torch.storage._new_dtypes()


class _Pickler(pickle.Pickler):
    """``torch.save``'s pickler, with placeholders pickled as the tensors they stand for.

    ``keys``: the record key of each storage (``id(placeholder)`` or a real storage's
    ``_cdata``); a key missing is numbered in the order met (the first pass) into ``met``.
    """

    def __init__(self, buffer: io.BytesIO, keys: dict[int, str]) -> None:
        super().__init__(buffer, protocol=torch.serialization.DEFAULT_PROTOCOL)
        self.keys = keys
        self.reals: dict[int, torch.UntypedStorage] = {}
        self.placeholders: dict[int, StreamedTensor] = {}

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, StreamedTensor):
            return NotImplemented
        shape = obj.shape
        args: tuple[Any, ...] = (_Slot(obj), 0, shape, _contiguous_stride(shape), False,
                                 OrderedDict())
        if _uses_v3(obj.dtype):
            return torch._utils._rebuild_tensor_v3, (*args, obj.dtype)
        return torch._utils._rebuild_tensor_v2, args

    def persistent_id(self, obj: Any) -> Any:
        # torch.save's own persistent_id for real storages (serialization.py); the private
        # helpers it calls are untyped, so they are reached through ``Any`` here
        serialization: Any = torch.serialization
        if isinstance(obj, _Slot):
            ph = obj.placeholder
            self.placeholders[id(ph)] = ph
            key = self.keys.get(id(ph), "?")
            if _uses_v3(ph.dtype):
                nbytes = ph.numel() * torch.empty((), dtype=ph.dtype).element_size()
                return ("storage", torch.UntypedStorage, key, "cpu", nbytes)
            typed = getattr(torch, torch.storage._dtype_to_storage_type_map()[ph.dtype])
            return ("storage", typed, key, "cpu", ph.numel())
        if isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj):
            real: Any = obj
            if isinstance(obj, torch.storage.TypedStorage):
                storage = real._untyped_storage
                storage_type = getattr(torch, real._pickle_storage_type())
                numel = real._size()
            else:
                storage = real
                storage_type = serialization.normalize_storage_type(type(obj))
                numel = storage.nbytes()
            key = self.keys.get(storage._cdata, "?")
            self.reals.setdefault(storage._cdata, storage)
            location = serialization.location_tag(storage)
            return ("storage", storage_type, key, location, numel)
        return None


def _pickled(checkpoint: Any) -> tuple[bytes, list[tuple[str, torch.UntypedStorage]],
                                       dict[int, str]]:
    """``data.pkl``'s bytes, the real storages as (key, storage) and each referenced
    placeholder's key: real storages first (keys 0...), then placeholders in transfer order."""
    survey = _Pickler(io.BytesIO(), {})
    survey.dump(checkpoint)
    keys: dict[int, str] = {}
    for cdata in survey.reals:
        keys[cdata] = str(len(keys))
    for ph in sorted(survey.placeholders.values(), key=lambda ph: ph.seq):
        keys[id(ph)] = str(len(keys))
    buffer = io.BytesIO()
    _Pickler(buffer, keys).dump(checkpoint)
    reals = [(keys[cdata], storage) for cdata, storage in survey.reals.items()]
    return buffer.getvalue(), reals, {i: keys[i] for i in survey.placeholders}


class _ZipStream:
    """One checkpoint archive being written: the pickle and real storages at once, then the
    streamed tensors through :meth:`sink`; the first error stops writing (kept in ``error``)."""

    def __init__(self, f: BinaryIO, checkpoint: Any, stats: StreamStats) -> None:
        self.stats = stats
        self.error: BaseException | None = None
        data, reals, self.keys = _pickled(checkpoint)
        self.pending = set(self.keys)  # placeholders whose record is still to come
        alignment = torch.serialization._get_storage_alignment()
        self.zip = torch._C.PyTorchFileWriter(f, torch.serialization.get_crc32_options(),
                                              alignment)
        self.zip.write_record("data.pkl", data, len(data))
        # no ".format_version" (version 1 promises records in the pickle's order, which lets a
        # reader compute offsets instead of reading them): records come in transfer order
        for name, text in ((".storage_alignment", str(alignment)), ("byteorder", sys.byteorder)):
            self.zip.write_record(name, text.encode(), len(text))
        for key, storage in reals:
            if storage.device.type != "cpu":
                storage = cast(torch.UntypedStorage, cast(Any, storage).cpu())
            self.zip.write_record(f"data/{key}", cast(Storage, storage), storage.nbytes())

    def sink(self, placeholder: StreamedTensor, tensor: torch.Tensor) -> None:
        if self.error is not None or id(placeholder) not in self.pending:
            return  # after a failure, or a placeholder the checkpoint no longer holds
        try:
            if tuple(tensor.shape) != placeholder.shape or tensor.dtype != placeholder.dtype:
                raise ValueError(f"received {tuple(tensor.shape)} {tensor.dtype} for "
                                 f"{placeholder!r}")
            data = tensor.detach()
            nbytes = data.numel() * data.element_size()
            if data.device.type != "cpu" or not data.is_contiguous():
                data = data.contiguous().cpu()
                self.stats.hold(nbytes)
            start = data.storage_offset() * data.element_size()
            # the tensor's own bytes: a slice of its storage (a view of a stage buffer), no copy
            self.zip.write_record(f"data/{self.keys[id(placeholder)]}",
                                  cast(Storage, data.untyped_storage()[start:start + nbytes]),
                                  nbytes)
            self.pending.discard(id(placeholder))
            self.stats.records += 1
        except Exception as exc:  # noqa: BLE001  (kept, raised once the transfer ended)
            self.error = exc

    def finish(self) -> None:
        if self.error is None and self.pending:
            self.error = RuntimeError(f"{len(self.pending)} streamed tensors never arrived (a "
                                      "checkpoint described by another save?)")
        if self.error is not None:
            raise self.error
        self.zip.write_end_of_file()


def save_streamed(checkpoint: Any, path: Any, stream: Stream) -> StreamStats:
    """Rank 0's side of a streamed save: ``checkpoint`` (placeholders included) written to
    ``path`` atomically while ``stream(sink, on_hold)`` runs the transfer.

    If the file cannot be written, the transfer still runs to its end (tensors received and
    dropped) so no sending rank waits forever, then :class:`CheckpointWriteError` names the
    file. A failing transfer itself (a rank gone) propagates as it is.
    """
    stats = StreamStats()
    streamed = False
    transfer_failed = False

    def run(sink: Sink | None) -> None:
        nonlocal streamed, transfer_failed
        streamed = True
        try:
            stream(sink, stats.hold)
        except BaseException:
            transfer_failed = True
            raise

    try:
        with atomic_file(path) as f:
            writer = _ZipStream(f, checkpoint, stats)
            run(writer.sink)
            writer.finish()
    except Exception as exc:
        if transfer_failed:
            raise
        if not streamed:
            run(None)  # receive and drop the rest: every sender finishes
        raise CheckpointWriteError(f"could not write the checkpoint {str(path)!r}: "
                                   f"{type(exc).__name__}: {exc}") from exc
    return stats
