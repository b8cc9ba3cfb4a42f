"""Pytrees of tensors and plain values <-> a structure and a list of tensors, and their spec.

A stage boundary carries an arbitrary pytree (tensors, ints from ``x.size()``, ``torch.Size``,
``None``, nested containers) whose shapes may change between steps. :mod:`.transport` sends its
tensors as they are and the *spec* (structure, per tensor shape, dtype, ``requires_grad``) only
when the receiver cannot know it. So a pytree is taken apart into a *structure*, a hashable
description with every tensor replaced by its index (tensors and tuples, lists and dicts of them
and of plain values are walked directly: a few microseconds, comparable by ``==`` with last
step's; anything else is pickled once, tensors found by the pickler's ``persistent_id``), and its
distinct tensors in a fixed order. A tensor appearing twice is sent once and comes back as one
object, which keeps aliasing (and gradient accumulation on it) identical on both sides; the order
lets the backward pair the i-th output tensor with the i-th gradient it receives. Pickled
structures and specs come from ranks of the same job and are trusted like a checkpoint.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from lightning_gsched.errors import RuntimeConfigError

# plain values a walked structure carries as they are (compared by type and value)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.Size, torch.memory_format, torch.layout)


class _Unwalkable(Exception):
    """A value the direct walk does not handle: the whole structure is pickled instead."""


class _TensorPickler(pickle.Pickler):
    """Pickles a structure with tensors replaced by their index in ``self.found.tensors``."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.found = _Walker()

    def persistent_id(self, obj: Any) -> int | None:
        return self.found.index_of(obj) if isinstance(obj, torch.Tensor) else None


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: Sequence[Any]) -> None:
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        return self._tensors[pid]


@dataclass
class Split:
    """A pytree taken apart: its structure and its distinct tensors in a fixed order."""

    structure: Any
    tensors: list[torch.Tensor]


# a walked node (see _Walker): a tuple whose first item is its tag
_Node = tuple[Any, ...]


class _Walker:
    """Direct walk of tensors / tuples / lists / dicts / plain values into a nested tuple:
    ``("t", i)`` tensor i; ``("v", type, value)`` a plain value (the type keeps ``1``, ``1.0`` and
    ``True`` apart); ``("tuple" | "list", children)``; ``("dict", keys, children)``. Only exact
    built-in container types are walked (a subclass may carry more)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.index: dict[int, int] = {}

    def index_of(self, t: torch.Tensor) -> int:
        key = id(t)
        if key not in self.index:
            self.index[key] = len(self.tensors)
            self.tensors.append(t)
        return self.index[key]

    def walk(self, obj: Any) -> _Node:
        if isinstance(obj, torch.Tensor):
            return ("t", self.index_of(obj))
        kind = type(obj)
        if kind is tuple or kind is list:
            return (kind.__name__, tuple(self.walk(x) for x in obj))
        if kind is dict:
            keys = tuple(obj)
            if not all(type(k) in (str, int) for k in keys):
                raise _Unwalkable
            return ("dict", keys, tuple(self.walk(obj[k]) for k in keys))
        if kind in _PLAIN:
            return ("v", kind, obj)
        raise _Unwalkable


def split(obj: Any, what: str = "value") -> Split:
    """Take ``obj`` apart into structure and tensors (no tensor data is copied)."""
    walker = _Walker()
    try:
        return Split(walker.walk(obj), walker.tensors)
    except _Unwalkable:
        pass
    buffer = io.BytesIO()
    pickler = _TensorPickler(buffer)
    try:
        pickler.dump(obj)
    except Exception as exc:  # noqa: BLE001 - re-raised with what to change
        raise RuntimeConfigError(
            f"cannot send the {what}: {type(exc).__name__}: {exc}. Stage outputs must be tensors, "
            "plain Python values or containers of them (picklable); return such values instead."
        ) from exc
    return Split(("pickle", buffer.getvalue()), pickler.found.tensors)


def join(structure: Any, tensors: Sequence[Any]) -> Any:
    """Rebuild a structure from :func:`split` with ``tensors`` in place of the originals."""
    if structure[0] == "pickle":
        return _TensorUnpickler(io.BytesIO(structure[1]), tensors).load()
    return _build(structure, tensors)


def _build(node: _Node, tensors: Sequence[Any]) -> Any:
    tag = node[0]
    if tag == "t":
        return tensors[node[1]]
    if tag == "v":
        return node[2]
    if tag == "tuple":
        return tuple(_build(child, tensors) for child in node[1])
    if tag == "list":
        return [_build(child, tensors) for child in node[1]]
    return {k: _build(child, tensors) for k, child in zip(node[1], node[2], strict=True)}


def detached_leaves(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """What a receiving stage gets: fresh leaves, requiring grad where the sender's did (a stage
    boundary is always cut, also between two stages on one rank: see :mod:`.compute`)."""
    return [t.detach().requires_grad_(t.requires_grad) for t in tensors]


TensorSpec = tuple[torch.Size, torch.dtype, bool]  # shape, dtype, requires_grad


@dataclass(frozen=True)
class Spec:
    """What a receiver must know to receive a message without a header (compared by ``==``)."""

    structure: Any
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the message's tensors (what travels on the fast path)."""
        return sum(shape.numel() * dtype.itemsize for shape, dtype, _ in self.tensors)

    def describe(self) -> str:
        """The tensors' shapes and dtypes, for error messages."""
        shapes = [f"{tuple(shape)} {str(dtype).replace('torch.', '')}"
                  for shape, dtype, _ in self.tensors]
        return "[" + ", ".join(shapes) + "]"


def spec_of(parts: Split) -> Spec:
    return Spec(parts.structure, tuple((t.shape, t.dtype, t.requires_grad) for t in parts.tensors))


def encode_spec(spec: Spec) -> bytes:
    """The described path's metadata: the pickled spec."""
    return pickle.dumps((spec.structure, spec.tensors), protocol=pickle.HIGHEST_PROTOCOL)


def decode_spec(meta: bytes) -> Spec:
    structure, tensors = pickle.loads(meta)
    return Spec(structure, tuple(tensors))


def wire_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The tensor as it goes on the wire: detached, on ``device``, contiguous (copied if needed)."""
    data = t.detach()
    if data.device != device:
        data = data.to(device)
    return data if data.is_contiguous() else data.contiguous()


def empty_like_spec(spec: Spec, device: torch.device) -> list[torch.Tensor]:
    """Receive buffers for a message of ``spec`` (one per distinct tensor)."""
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, _ in spec.tensors]


def received(spec: Spec, buffers: Sequence[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
    """The pytree a receiver gets from filled ``buffers``: fresh leaves requiring grad as the
    sender's tensors did, joined into the structure."""
    leaves = [buf.requires_grad_(flag)
              for buf, (_, _, flag) in zip(buffers, spec.tensors, strict=True)]
    return join(spec.structure, leaves), leaves


def received_copy(parts: Split, device: torch.device) -> tuple[Any, list[torch.Tensor]]:
    """What a receiver of ``parts`` gets, built locally (one fresh buffer per tensor)."""
    spec = spec_of(parts)
    buffers = empty_like_spec(spec, device)
    with torch.no_grad():
        for buf, t in zip(buffers, parts.tensors, strict=True):
            buf.copy_(t.detach())
    return received(spec, buffers)
