"""Bytes a rank really holds while it runs a step, in the planner's categories.

The runtime's side of checking the planner's per-rank prediction (``schedule/memory.py``), sampled
after every action as the planner samples its walk: weights (real storage of stage and tie
buffers), gradients (active gradient buffers), activations (per stash, the distinct storages
autograd saved during its forward, weights excluded: :class:`SavedTensorBytes`, which
``measure.measure_stage_bytes`` sizes a stash with too, so both count the same tensors) and
communication (posted receive buffers not yet consumed); the optimizer's state is read from the
optimizer.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, cast

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the storage a tensor views, so two views count once. A meta tensor
    has no address: its storage's identity stands in, its bytes are what it would hold. A
    wrapper tensor (a tensor-parallel layer's ``DTensor``) holds no storage of its own: its
    (first) inner tensor's is counted, the rank's shard."""
    while is_traceable_wrapper_subclass(cast(Any, t)):
        inner, _ = cast(Any, t).__tensor_flatten__()
        t = getattr(t, inner[0])
    storage = t.untyped_storage()
    return storage._cdata if t.device.type == "meta" else storage.data_ptr(), storage.nbytes()


def weight_storages(module: torch.nn.Module) -> list[int]:
    """Addresses of a stage's parameter and buffer storages (saved by autograd: not activations)."""
    return [storage_key(t)[0] for t in (*module.parameters(), *module.buffers()) if t.numel()]


class _Packed:
    """What the pack hook hands autograd for one saved tensor: referenced by autograd alone, so
    a weak reference to it says whether the node that saved it is alive."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class SavedTensorBytes:
    """Within the ``with`` block, the distinct storages autograd saves for the backward, but
    ``exclude`` (the stage's weights). :meth:`alive_storages` is what autograd still holds later:
    a storage counts while a node that saved it is alive (a split backward's B drops the nodes
    above every weight: :func:`held_until_w`); storages added by :meth:`count` (held by someone
    else, e.g. a checkpointed stage's inputs) always count."""

    def __init__(self, exclude: Iterable[int] = ()) -> None:
        self.exclude = set(exclude)
        self.storages: dict[int, int] = {}
        # storage address -> weak references to the packed objects of the tensors saved there
        self._saved_by: dict[int, list[weakref.ref[_Packed]]] = {}
        self._hooks: Any = None

    def count(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage (unless excluded), held whatever autograd does."""
        ptr, nbytes = storage_key(t)
        if ptr and ptr not in self.exclude:
            self.storages[ptr] = nbytes
            self._saved_by.pop(ptr, None)

    def _pack(self, t: torch.Tensor) -> _Packed:
        # detached: an op that saves its own output (exp, tanh) would otherwise hold it, whose
        # grad_fn is the op: a cycle through the autograd graph that Python's collector cannot
        # see, keeping a forward never followed by its backward (sizing a stage) alive
        packed = _Packed(t.detach())
        ptr, nbytes = storage_key(t)
        if ptr and ptr not in self.exclude:
            if ptr not in self.storages:
                self.storages[ptr] = nbytes
                self._saved_by[ptr] = []
            if ptr in self._saved_by:  # else pinned by count()
                self._saved_by[ptr].append(weakref.ref(packed))
        return packed

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda p: p.t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    def absorb(self, inner: "SavedTensorBytes") -> None:
        """Count what a nested counter saw (storages and who holds them) here too: nested hooks
        see only the innermost counter, so a part of a forward (the loss) counted apart is then
        followed here as one counter over the whole forward would."""
        for ptr, nbytes in inner.storages.items():
            if ptr not in inner._saved_by or (ptr in self.storages and ptr not in self._saved_by):
                self.storages[ptr] = nbytes  # pinned (by count()) in either counter
                self._saved_by.pop(ptr, None)
            else:
                self.storages.setdefault(ptr, nbytes)
                self._saved_by.setdefault(ptr, []).extend(inner._saved_by[ptr])

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def alive_storages(self) -> dict[int, int]:
        """The counted storages autograd still holds now (see the class docstring)."""
        return {ptr: nbytes for ptr, nbytes in self.storages.items()
                if ptr not in self._saved_by or any(r() is not None for r in self._saved_by[ptr])}


def held_until_w(saved: SavedTensorBytes, gradients: Iterable[torch.Tensor | None]
                 ) -> dict[int, int]:
    """What a (stage, microbatch) holds from its split B to its W, as {storage: bytes}: what its
    forward saved that autograd still holds (read after B's roots are dropped), and the gradients
    B recorded for W."""
    held = saved.alive_storages()
    for ptr, nbytes in (storage_key(g) for g in gradients if g is not None):
        if ptr and ptr not in saved.exclude:
            held.setdefault(ptr, nbytes)
    return held


@dataclass
class MeasuredBytes:
    """Peak bytes per category (``schedule.memory.Bytes``'s names) on one rank while recording:
    ``at_peak`` at the highest total, ``peaks`` each category's own highest value."""

    at_peak: dict[str, int] = field(default_factory=dict)
    peaks: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return self.at_peak.get("total", 0)

    def sample(self, now: dict[str, int]) -> None:
        now = {**now, "total": sum(now.values())}
        if now["total"] > self.peak:
            self.at_peak = now
        for name, value in now.items():
            self.peaks[name] = max(self.peaks.get(name, 0), value)


# optimizer state tensors the size of the parameter, by optimizer type (SGD keeps a momentum
# buffer only with momentum; RMSprop a square average, plus a momentum buffer and a mean if asked)
_STATE_PER_PARAM = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1,
                    "Adadelta": 2}


def optimizer_factor(optimizer: Any) -> float | None:
    """State bytes per parameter byte the optimizer will keep, known before its first step
    creates the state; None when not known (then measured after the first step)."""
    name, groups = type(optimizer).__name__, getattr(optimizer, "param_groups", [{}])
    if name in _STATE_PER_PARAM:
        return float(_STATE_PER_PARAM[name])
    if name == "SGD":
        return 1.0 if any(g.get("momentum", 0) for g in groups) else 0.0
    if name == "RMSprop":
        extra = any(g.get("momentum", 0) for g in groups) + any(g.get("centered") for g in groups)
        return 1.0 + extra
    return None


# where torch.optim picks its multi-tensor (foreach) kernels when not told (torch.optim.
# optimizer._default_to_fused_or_foreach in torch 2.13): never on CPU
_FOREACH_DEVICES = ("cuda", "xpu", "mtia")


def optimizer_step_factor(optimizer: Any, device_type: str | None = None) -> float:
    """Bytes ``optimizer.step()`` allocates for its own duration, per trainable parameter byte.

    Adam's and AdamW's multi-tensor step (torch's default where every parameter is on a CUDA-like
    device, or ``foreach=True``) builds ``sqrt(exp_avg_sq)`` for every parameter at once: 1.0 (its
    gradient copy for weight decay or ``maximize`` is deleted before). ``fused=True`` allocates
    nothing that size; the per-parameter loop (the CPU default) about three of the largest
    parameter, left out (0); other optimizers: 0 (not measured). ``device_type``: where the
    parameters will train (they may still be on meta), for torch's default; None: their devices.
    """
    if type(optimizer).__name__ not in ("Adam", "AdamW"):
        return 0.0
    return float(any(
        all((device_type or p.device.type) in _FOREACH_DEVICES for p in group["params"])
        if group.get("foreach") is None else bool(group["foreach"])
        for group in getattr(optimizer, "param_groups", [])
        if not (group.get("fused") or group.get("differentiable"))))


def optimizer_state_bytes(optimizer: Any, params: Iterable[torch.Tensor]) -> int:
    """Bytes of the optimizer's state tensors for ``params`` (distinct storages)."""
    return sum(dict(storage_key(value) for p in params
                    for value in optimizer.state.get(p, {}).values()
                    if isinstance(value, torch.Tensor) and value.numel() > 1).values())
