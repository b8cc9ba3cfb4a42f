"""One contiguous buffer per stage for its weights, one for its gradients.

Why: a stage's weight fetch or gradient reduction is then one message of a size both ends know,
and freeing a fetched stage one storage release. Parameters and gradients are views of the
buffers (autograd accumulates in place); a tie (the tied parameters of one home stage) is one
more :class:`FlatStage`. Freeing works like FSDP's reshard: the storage is resized to 0 bytes and
every parameter's ``.data`` becomes empty, so nothing outside a fetch..free window reads stale
weights. The *same* storage is refilled by the next fetch, so tensors autograd saved under an
earlier fetch (views of the weights) see the refetched values: a backward after a refetch is
correct.
"""

from __future__ import annotations

import itertools
from typing import Iterator, Sequence

import torch
from torch import nn

from lightning_gsched.errors import RuntimeConfigError


def set_storage(param: nn.Parameter, data: torch.Tensor) -> None:
    """``param.data = data``, also from or to the meta device, where ``.data`` cannot be set: the
    tensors are then swapped in place, so every holder of ``param`` sees the new storage."""
    if param.is_meta != data.is_meta:
        torch.utils.swap_tensors(  # type: ignore[no-untyped-call]
            param, nn.Parameter(data, requires_grad=param.requires_grad))
    else:
        param.data = data


class FlatLayout:
    """Where each of some parameters lives in one flat buffer of their concatenated elements;
    shapes and sizes are taken while the weights are present (a released stage's go empty)."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self.shapes = [p.shape for p in self.params]
        self.sizes = [p.numel() for p in self.params]
        self.offsets = list(itertools.accumulate(self.sizes, initial=0))[:-1]
        self.numel = sum(self.sizes)

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s piece of ``flat``, shaped like the parameter."""
        return flat[self.offsets[i] : self.offsets[i] + self.sizes[i]].view(self.shapes[i])

    def views(self, flat: torch.Tensor) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, its view of ``flat``) for every parameter, in buffer order."""
        return ((p, self.view(flat, i)) for i, p in enumerate(self.params))


class FlatStage(FlatLayout):
    """The weights and gradients of one stage (or tie: ``index`` its home stage) on one rank."""

    def __init__(self, index: int, params: Sequence[nn.Parameter], owned: bool,
                 kind: str = "stage", device: torch.device | None = None) -> None:
        self.index = index
        self.kind = kind
        params = list(params)
        dtypes = {p.dtype for p in params}
        # a deferred model's parameters of other ranks' stages stay on the meta device
        devices = {p.device for p in params if not p.is_meta}
        if len(dtypes) > 1 or len(devices) > 1:
            raise RuntimeConfigError(
                f"{kind} {index} mixes parameter dtypes/devices "
                f"{sorted(map(str, dtypes | devices))}; "
                "the runtime keeps one flat buffer per stage. Cast the model to one dtype and "
                "move it to one device before building the runtime.")
        super().__init__(params)
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self.device = devices.pop() if devices else (device or torch.device("cpu"))
        self.grads = FlatGrads(self.params, self.dtype, self.device)
        self.owned = owned
        self.flat: torch.Tensor | None = None  # weights; storage kept across fetches
        self.resident = False
        self.materialized = False
        if owned:  # copy the current weights into the flat buffer, params become its views
            with torch.no_grad():
                for p, view in self.views(self.fetch_buffer()):
                    view.copy_(p.data.reshape(view.shape))
            self.materialize()
        else:
            self._release_params()

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def _release_params(self) -> None:
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for p in self.params:
            set_storage(p, empty)  # from the meta device too (a deferred model)
        self.materialized = False

    def ensure_owned_views(self) -> None:
        """Owner: re-point params that something outside replaced (keeps their values)."""
        assert self.flat is not None
        start, end = self.flat.data_ptr(), self.flat.data_ptr() + self.nbytes
        for p, view in self.views(self.flat):
            if view.numel() and not (start <= p.data_ptr() < end):
                with torch.no_grad():
                    view.copy_(p.data.reshape(view.shape))
                p.data = view

    def fetch_buffer(self) -> torch.Tensor:
        """(Re)allocate the stage's storage; the returned tensor receives the weights."""
        if self.flat is None:
            self.flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        else:
            self.flat.untyped_storage().resize_(self.nbytes)
        self.resident = True
        return self.flat

    def materialize(self) -> None:
        """Non-owner, after the fetch completed: parameters become views of the fetched buffer."""
        if not self.materialized:
            assert self.flat is not None
            for p, view in self.views(self.flat):
                p.data = view
            self.materialized = True

    def free(self) -> None:
        """Non-owner: release the fetched weights for real (storage to 0 bytes)."""
        self._release_params()
        if self.flat is not None:
            self.flat.untyped_storage().resize_(0)
        self.resident = False

    def resident_bytes(self) -> int:
        return self.flat.untyped_storage().nbytes() if self.flat is not None else 0

    def zero_grads(self) -> None:
        self.grads.zero()

    def take_grads(self) -> torch.Tensor:
        """Non-owner: hand over the flat gradient for good (not kept for reuse: a fetched stage
        holds gradient storage from its first weight-gradient job to its ``REDUCE_G`` only)."""
        return self.grads.give_away()


class FlatGrads(FlatLayout):
    """Gradients of some parameters accumulated in one flat buffer (``param.grad`` are views)."""

    def __init__(self, params: Sequence[nn.Parameter], dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__([p for p in params if p.requires_grad])
        self.dtype, self.device = dtype, device
        self.flat: torch.Tensor | None = None
        # a buffer handed out by take() and given back once nothing uses it (recycle()):
        # reusing it saves allocating and first-touching a model-sized buffer every step
        self.spare: torch.Tensor | None = None
        # the per-parameter views of the buffers this object holds (flat, spare, the last one
        # taken), by buffer: a step folds and hands over every parameter two or three times,
        # and cutting a view costs about as much as the check it serves
        self._views: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        self._taken: torch.Tensor | None = None

    def grad_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view of ``flat``, cut once per buffer. Only buffers this object holds
        are remembered, so the cache keeps no buffer alive; another tensor gets fresh views."""
        for buffer, views in self._views:
            if buffer is flat:
                return views
        views = [self.view(flat, i) for i in range(len(self.params))]
        held = (self.flat, self.spare, self._taken)
        self._views = [(b, v) for b, v in self._views if any(b is h for h in held)]
        if any(flat is h for h in held):
            self._views.append((flat, views))
        return views

    def recycle(self, flat: torch.Tensor) -> None:
        """Give back a buffer from :meth:`take` that nobody reads or writes any more."""
        if flat is self._taken:
            self._taken = None
        if flat.numel() == self.numel and flat.dtype == self.dtype and flat.device == self.device:
            self.spare = flat

    @property
    def active(self) -> bool:
        return self.flat is not None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def zero(self) -> None:
        """Start accumulating in a zeroed flat buffer (allocated on first use, or recycled)."""
        if self.flat is None and self.spare is not None:
            self.flat, self.spare = self.spare, None
        if self.flat is None:
            self.flat = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        else:
            self.flat.zero_()
        for p, view in zip(self.params, self.grad_views(self.flat), strict=True):
            p.grad = view

    def sync(self) -> torch.Tensor:
        """The flat gradient, folding in any ``.grad`` autograd did not accumulate in place."""
        if self.flat is None:
            self.zero()
        for i in range(len(self.params)):
            self.fold(i)
        assert self.flat is not None
        return self.flat

    def fold(self, i: int) -> None:
        """Make parameter i's ``.grad`` a view of the active flat buffer again, keeping its value
        (autograd may replace a ``.grad`` instead of accumulating into it)."""
        assert self.flat is not None
        p, view = self.params[i], self.grad_views(self.flat)[i]
        grad = p.grad
        if grad is view:  # the common case: autograd accumulated in place
            return
        if grad is None:
            p.grad = view
        elif grad.data_ptr() != view.data_ptr():
            with torch.no_grad():
                view.copy_(grad.reshape(view.shape))
            p.grad = view

    def give_away(self) -> torch.Tensor:
        """:meth:`take`, then forget the buffer (no spare, no cached views) for good."""
        flat = self.take()
        self._taken = None
        self._views = [(b, v) for b, v in self._views if b is not flat]
        return flat

    def take(self) -> torch.Tensor:
        """Hand over the flat gradient and stop holding it (``param.grad`` becomes None)."""
        flat = self.sync()
        for p in self.params:
            p.grad = None
        self.flat = None
        self._taken = flat
        return flat
