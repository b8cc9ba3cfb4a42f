"""Weight units' messages within one step: fetch, serve, free, hand-off and receive of gradients.

A stage's weights (``FETCH_W s1 <-0``) and a tie's (``FETCH_W t0 <-0``) are both flat units
(:class:`.flat.FlatStage`) acted on by the same ops. The step (:mod:`.step`) has one
:class:`UnitTraffic` per kind and keeps what is particular to a kind (bucketed all-reduces of
stages, ``peak_resident_stages``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from lightning_gsched.errors import RuntimeConfigError
from lightning_gsched.runtime.flat import FlatStage
from lightning_gsched.runtime.layout import peer_of
from lightning_gsched.runtime.transport import Transport, label
from lightning_gsched.schedule.program import Action


class UnitTraffic:
    """One kind of weight unit (``kind``: "stage" or "tie") during one step on one rank."""

    def __init__(self, kind: str, units: Mapping[int, FlatStage], transport: Transport,
                 rank: int) -> None:
        self.kind = kind
        self.units = units
        self.transport = transport
        self.rank = rank
        self.fetches: dict[int, tuple[Any, str]] = {}  # unit -> (work, label) until waited
        self.grad_recvs: dict[int, list[tuple[Any, torch.Tensor, str]]] = {}
        self.reduced: set[int] = set()  # units whose all-reduce has started

    def drop(self) -> None:
        """Forget pending handles (after a failure, before the groups go)."""
        self.fetches.clear()
        self.grad_recvs.clear()

    def fetch(self, a: Action, index: int) -> None:
        """``FETCH_W``: post the receive of a unit's weights into its (re)allocated buffer."""
        unit = self.units[a.stage]
        if unit.resident:
            raise RuntimeConfigError(f"{a.op} of {self.kind} {a.stage}, which is already "
                                     "resident here")
        work = self.transport.post_flat(unit.fetch_buffer(), peer_of(a), "weights")
        self.fetches[a.stage] = (work, label(a, index))

    def serve(self, a: Action, index: int) -> None:
        """``SEND_W``: the owner sends the unit's weights."""
        unit = self.units[a.stage]
        if not unit.owned:
            raise RuntimeConfigError(f"{a.op} of {self.kind} {a.stage}, which rank {self.rank} "
                                     "does not own")
        assert unit.flat is not None  # an owned unit holds its weights
        self.transport.send_flat(unit.flat, peer_of(a), "weights", label(a, index))

    def land(self, key: int) -> None:
        """Wait for the unit's posted fetch, if any."""
        if key in self.fetches:
            work, what = self.fetches.pop(key)
            self.transport.wait(work, what)

    def ready(self, key: int, reader: str) -> None:
        """Before a compute that reads the unit (``reader`` names the reader in an error)."""
        self.land(key)
        unit = self.units[key]
        if not unit.resident:
            raise RuntimeConfigError(
                f"{self.kind} {key}{reader} is not resident on rank {self.rank} (neither owned "
                "nor fetched); the programs do not match this rank. Plan once and pass the same "
                "programs on every rank.")
        unit.materialize()

    def free(self, a: Action, index: int) -> None:
        """``FREE_W``: release a fetched unit (a fetch never used lands first)."""
        self.land(a.stage)
        unit = self.units[a.stage]
        if unit.grads.active:
            raise RuntimeConfigError(
                f"{a.op} of {self.kind} {a.stage} while its gradient was not sent to the owner "
                "(its REDUCE_G must come first); the programs are not from this planner.")
        unit.free()

    def hand_off(self, a: Action, index: int) -> None:
        """``REDUCE_G``: send the accumulated gradient to the owner, drop it."""
        grad = self.units[a.stage].take_grads()
        self.transport.send_flat(grad, peer_of(a), "grads", label(a, index))

    def post_grad(self, a: Action, index: int) -> None:
        """``RECV_G``: post the receive of a peer's gradient (summed in later)."""
        if a.stage in self.reduced:
            raise RuntimeConfigError(
                f"{a.op} of {self.kind} {a.stage} after its all-reduce started; gradients must "
                "be received before the owners reduce them.")
        unit = self.units[a.stage]
        buffer = torch.empty(unit.grads.numel, dtype=unit.dtype, device=unit.device)
        work = self.transport.post_flat(buffer, peer_of(a), "grads")
        self.grad_recvs.setdefault(a.stage, []).append((work, buffer, label(a, index)))

    def sum_received(self, key: int) -> None:
        """Add the gradients received for the unit into its own (waiting for each)."""
        pending = self.grad_recvs.pop(key, [])
        if not pending:
            return
        total = self.units[key].grads.sync()
        for work, buffer, what in pending:
            self.transport.wait(work, what)
            total.add_(buffer)

    def all_reduce(self, a: Action, index: int, launch: Callable[[torch.Tensor], Any]
                   ) -> tuple[torch.Tensor, list[tuple[Any, str]]]:
        """``ALLREDUCE_G`` without buckets: received gradients summed in, then one all-reduce
        (``launch`` starts it). Returns the gradient and the (work, label) to wait for."""
        self.sum_received(a.stage)
        grad = self.units[a.stage].grads.sync()
        self.reduced.add(a.stage)
        what = f"the all-reduce of {label(a, index)} among ranks {list(a.group or ())}"
        return grad, ([(launch(grad), what)] if grad.numel() else [])

    def finish(self) -> None:
        """End of step: gradients received for units no all-reduce summed in."""
        for key in sorted(self.grad_recvs):
            self.sum_received(key)

    def resident_bytes(self) -> int:
        return sum(u.resident_bytes() for u in self.units.values())

    def active_grad_bytes(self) -> int:
        return sum(u.grads.nbytes for u in self.units.values() if u.grads.active)

    def pending_buffers(self) -> list[torch.Tensor]:
        return [buffer for pending in self.grad_recvs.values() for _, buffer, _ in pending]
