"""Pytrees of tensors and plain values <-> one byte message.

Why one message: a stage boundary carries an arbitrary pytree (tensors, ints from ``x.size()``,
``torch.Size``, ``None``, nested tuples and dicts) whose shapes can change from step to step.
Sending one message per tensor would cost a message and a header per leaf; here a pytree is
one ``uint8`` payload: pickled metadata (the structure with every tensor replaced by a reference,
plus each tensor's shape, dtype, ``requires_grad`` and offset) followed by the tensor bytes, each
aligned to 16 bytes so that the receiver views them in place instead of copying.

Tensors are found by the pickler itself (``persistent_id``), so they may sit anywhere in a
picklable structure, not only in containers torch's pytree knows. The same tensor object appearing
twice is sent once and comes back as one object, which keeps aliasing (and therefore gradient
accumulation on it) identical on both sides. Payloads come from ranks of the same job and are
trusted like any pickled checkpoint.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from lightning_gsched.errors import RuntimeConfigError

ALIGN = 16
HEADER_LEN = 2  # int64 [meta_len, payload_len]


class _TensorPickler(pickle.Pickler):
    """Pickles a structure with tensors replaced by their index in ``self.tensors``."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, torch.Tensor):
            key = id(obj)
            if key not in self._index:
                self._index[key] = len(self.tensors)
                self.tensors.append(obj)
            return self._index[key]
        return None


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: Sequence[Any]) -> None:
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        return self._tensors[pid]


@dataclass
class Split:
    """A pytree taken apart: its structure (bytes) and its distinct tensors in a fixed order.

    The order is the same on every rank that joins the structure again, which is what lets the
    backward pair the i-th output tensor with the i-th gradient it receives.
    """

    structure: bytes
    tensors: list[torch.Tensor]


def split(obj: Any, what: str = "value") -> Split:
    """Take ``obj`` apart into structure and tensors (no tensor data is copied)."""
    buffer = io.BytesIO()
    pickler = _TensorPickler(buffer)
    try:
        pickler.dump(obj)
    except Exception as exc:  # noqa: BLE001 - re-raised with what to change
        raise RuntimeConfigError(
            f"cannot send the {what}: {type(exc).__name__}: {exc}. Stage outputs must be tensors, "
            "plain Python values or containers of them (picklable); return such values instead."
        ) from exc
    return Split(buffer.getvalue(), pickler.tensors)


def join(structure: bytes, tensors: Sequence[Any]) -> Any:
    """Rebuild a structure from :func:`split` with ``tensors`` in place of the originals."""
    return _TensorUnpickler(io.BytesIO(structure), tensors).load()


def detached_leaves(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """What a receiving stage gets: fresh leaves, requiring grad where the sender's did.

    A stage boundary is always cut (also between two stages on one rank), so each backward
    covers exactly one stage and yields the gradients of that stage's inputs in ``.grad``.
    """
    return [t.detach().requires_grad_(t.requires_grad) for t in tensors]


def _pad(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def encode(parts: Split, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) for one message carrying ``parts``."""
    specs = []
    offset = 0
    flat = []
    for t in parts.tensors:
        data = t.detach()
        if not data.is_contiguous():
            data = data.contiguous()
        nbytes = data.numel() * data.element_size()
        specs.append((tuple(data.shape), data.dtype, bool(t.requires_grad), offset, nbytes))
        flat.append(data)
        offset = _pad(offset + nbytes)
    meta = pickle.dumps((parts.structure, specs), protocol=pickle.HIGHEST_PROTOCOL)
    start = _pad(len(meta))
    payload = torch.empty(start + offset, dtype=torch.uint8, device=device)
    payload[: len(meta)].copy_(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
    for data, (_, _, _, off, nbytes) in zip(flat, specs, strict=True):
        if nbytes:
            payload[start + off : start + off + nbytes].copy_(data.reshape(-1).view(torch.uint8))
    header = torch.tensor([len(meta), payload.numel()], dtype=torch.int64, device=device)
    return header, payload


def decode(meta_len: int, payload: torch.Tensor) -> tuple[Any, list[torch.Tensor]]:
    """The pytree of a received payload and its tensors (views into the payload, fresh leaves)."""
    meta = payload[:meta_len].cpu().numpy().tobytes()
    structure, specs = pickle.loads(meta)
    start = _pad(meta_len)
    tensors = []
    for shape, dtype, requires_grad, off, nbytes in specs:
        raw = payload[start + off : start + off + nbytes]
        tensor = raw.view(dtype).view(shape).detach()
        tensors.append(tensor.requires_grad_(requires_grad))
    return join(structure, tensors), tensors
