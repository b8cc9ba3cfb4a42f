"""A full checkpoint written by rank 0 while its tensors arrive, never whole in memory.

Why: ``torch.save`` needs every tensor of the object it writes, so a full checkpoint of a model
larger than one rank cannot be assembled on rank 0 first. The file ``torch.save`` writes is a zip
archive: ``data.pkl`` (the object, each tensor's storage a persistent id naming a record
``data/<key>``), a few small records (``.storage_alignment``, ``byteorder``; the writer adds
``version`` and ``.data/serialization_id`` at the end) and one record per storage. Here the pickle is written first, with each
:class:`~lightning_gsched.runtime.StreamedTensor` placeholder pickled as the tensor it stands
for (``torch._utils._rebuild_tensor_v2`` over a storage id, as torch pickles a contiguous
tensor), then the real tensors' storages (buffers, small optimizer values), then each streamed
tensor as its own record when the transfer hands it over, and dropped. Keys are numbered in
the order records are written, so ``torch.load`` (``weights_only``, ``mmap``,
``map_location``) reads the file as one of its own. One difference: ``torch.save`` also writes
``.format_version`` 1, which promises records in the order the pickle names them (a reader
may then compute offsets instead of reading them, e.g. for ``map_location="meta"``); streamed
records come in transfer order, so that record is left out and readers look offsets up.

A placeholder that several names share (tied parameters) is one record. The file is written to
a temporary name next to the target and renamed when complete (:func:`.ckpt_files.atomic_file`).
"""

from __future__ import annotations

import io
import pickle
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Mapping

import torch

from lightning_gsched.engine import ckpt_files
from lightning_gsched.errors import CheckpointWriteError
from lightning_gsched.runtime import ModelRuntime, StreamedTensor

Sink = Callable[[StreamedTensor, torch.Tensor], None]
# runs the transfer: calls the sink on rank 0 for each tensor, and the second argument with the
# bytes rank 0 holds for the transfer (a received buffer) whenever that changes
Stream = Callable[[Sink | None, Callable[[int], None]], None]


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


def _storage_type(dtype: torch.dtype) -> Any:
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class _Pickler(pickle.Pickler):
    """``torch.save``'s pickler, with placeholders pickled as the tensors they stand for.

    ``keys``: the record key of each storage (``id(placeholder)`` or a real storage's
    ``_cdata``); a key missing is numbered in the order met (the first pass) into ``met``.
    """

    def __init__(self, buffer: io.BytesIO, keys: dict[int, str]) -> None:
        super().__init__(buffer, protocol=torch.serialization.DEFAULT_PROTOCOL)
        self.keys = keys
        self.reals: dict[str, torch.UntypedStorage] = {}
        self.placeholders: dict[int, StreamedTensor] = {}

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, StreamedTensor):
            return NotImplemented
        shape = obj.shape
        args = (_Slot(obj), 0, shape, _contiguous_stride(shape), False, OrderedDict())
        if _uses_v3(obj.dtype):
            return torch._utils._rebuild_tensor_v3, (*args, obj.dtype)
        return torch._utils._rebuild_tensor_v2, args

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Slot):
            ph = obj.placeholder
            self.placeholders[id(ph)] = ph
            key = self.keys.get(id(ph), "?")
            if _uses_v3(ph.dtype):
                return ("storage", torch.UntypedStorage, key, "cpu",
                        ph.numel() * _element_size(ph.dtype))
            return ("storage", _storage_type(ph.dtype), key, "cpu", ph.numel())
        if isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj):
            if isinstance(obj, torch.storage.TypedStorage):
                storage = obj._untyped_storage
                storage_type = getattr(torch, obj._pickle_storage_type())
                numel = obj._size()
            else:
                storage = obj
                storage_type = torch.serialization.normalize_storage_type(type(obj))
                numel = storage.nbytes()
            key = self.keys.get(storage._cdata, "?")
            self.reals.setdefault(storage._cdata, storage)
            location = torch.serialization.location_tag(storage)
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
    final = _Pickler(buffer, keys)
    final.dump(checkpoint)
    reals = [(keys[cdata], storage) for cdata, storage in survey.reals.items()]
    placeholder_keys = {i: keys[i] for i in survey.placeholders}
    return buffer.getvalue(), reals, placeholder_keys


class _ZipStream:
    """One checkpoint archive being written: the pickle and real storages at once, then the
    streamed tensors through :meth:`sink`; the first error stops writing (kept in ``error``)."""

    def __init__(self, f: BinaryIO, checkpoint: Any, stats: StreamStats) -> None:
        self.stats = stats
        self.error: BaseException | None = None
        data, reals, self.keys = _pickled(checkpoint)
        self.pending = set(self.keys)  # placeholders whose record is still to come
        self.zip = torch._C.PyTorchFileWriter(f, torch.serialization.get_crc32_options(),
                                              torch.serialization._get_storage_alignment())
        self.zip.write_record("data.pkl", data, len(data))
        # no ".format_version" (torch's version 1 promises records in the pickle's order, which
        # lets a reader compute offsets instead of reading them): records come in transfer order
        alignment = str(torch.serialization._get_storage_alignment())
        self.zip.write_record(".storage_alignment", alignment, len(alignment))
        self.zip.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key, storage in reals:
            if storage.device.type != "cpu":
                storage = storage.cpu()
            self.zip.write_record(f"data/{key}", storage, storage.nbytes())

    def sink(self, placeholder: StreamedTensor, tensor: torch.Tensor) -> None:
        if self.error is not None or id(placeholder) not in self.pending:
            return  # after a failure, or a placeholder the checkpoint no longer holds
        try:
            if tuple(tensor.shape) != placeholder.shape or tensor.dtype != placeholder.dtype:
                raise ValueError(f"received {tuple(tensor.shape)} {tensor.dtype} for "
                                 f"{placeholder!r}")
            data = tensor.detach()
            if data.device.type != "cpu" or not data.is_contiguous():
                data = data.contiguous().cpu()
                self.stats.peak_bytes = max(self.stats.peak_bytes,
                                            data.numel() * data.element_size())
            nbytes = data.numel() * data.element_size()
            name = f"data/{self.keys[id(placeholder)]}"
            start = data.storage_offset() * data.element_size()
            # the tensor's own bytes: a slice of its storage (a view of a stage buffer), no copy
            self.zip.write_record(name, data.untyped_storage()[start:start + nbytes], nbytes)
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
    ``path`` atomically while ``stream(sink)`` runs the transfer.

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
        with ckpt_files.atomic_file(path) as f:
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


def streams(stream_checkpoint: Any, deferred: bool) -> bool:
    """Whether a full checkpoint of a built pipeline goes to rank 0 streamed
    (``stream_checkpoint``, checked by :func:`.options.check_stream_checkpoint`): ``"auto"``
    streams a model built without weights, which must never be whole on one rank; a bool
    decides. Both front ends ask here, so they cannot drift apart."""
    if stream_checkpoint == "auto":
        return deferred
    return bool(stream_checkpoint)


def save_described(runtime: ModelRuntime, checkpoint: Any, path: Any, *, rank_zero: bool,
                   local: bool, hand_on: Callable[[Any], None]) -> StreamStats | None:
    """Both front ends' save of a checkpoint described with placeholders
    (``runtime.streamed_state_dict`` / ``streamed_optimizer_state``), on every rank
    (collective): every rank sends its tensors to rank 0 in one order; rank 0 writes each into
    ``path`` as it arrives (:func:`save_streamed`; its stats returned). ``local`` False (a
    user's CheckpointIO or a remote path, which need the real tensors): rank 0 keeps them all,
    fills the placeholders in, and every rank calls ``hand_on(checkpoint)`` (the front end's
    own writer, which writes on rank 0)."""
    if not local:
        if rank_zero:
            fill_placeholders(checkpoint, collect(runtime.stream))
        else:
            runtime.stream(None)
        hand_on(checkpoint)
        return None
    if rank_zero:
        return save_streamed(checkpoint, path, runtime.stream)
    runtime.stream(None)
    return None


def collect(stream: Stream) -> dict[int, torch.Tensor]:
    """Rank 0: every streamed tensor kept (copies), by ``id(placeholder)``: for a checkpoint
    written by other means (a user's CheckpointIO, a remote path); this holds them all."""
    tensors: dict[int, torch.Tensor] = {}

    def keep(placeholder: StreamedTensor, tensor: torch.Tensor) -> None:
        tensors[id(placeholder)] = tensor.detach().clone()

    stream(keep, lambda nbytes: None)
    return tensors


def fill_placeholders(checkpoint: Any, tensors: Mapping[int, torch.Tensor]) -> Any:
    """``checkpoint`` with every placeholder replaced by ``tensors[id(placeholder)]``, in place
    for dicts and lists (a state dict keeps its type and ``_metadata``)."""
    if isinstance(checkpoint, StreamedTensor):
        return tensors[id(checkpoint)]
    if isinstance(checkpoint, dict):
        for key, value in checkpoint.items():
            checkpoint[key] = fill_placeholders(value, tensors)
        return checkpoint
    if isinstance(checkpoint, list):
        checkpoint[:] = [fill_placeholders(v, tensors) for v in checkpoint]
        return checkpoint
    if isinstance(checkpoint, tuple) and not hasattr(checkpoint, "_fields"):
        return tuple(fill_placeholders(v, tensors) for v in checkpoint)
    return checkpoint
