"""The tie actions of one step: fetch, serve, free, reduce, receive and all-reduce a tie.

Why a module of its own: a tie (tied weights, one flat unit per home stage, see
``schedule/lower_ties.py``) behaves like a stage's weights with another residency rule, and
the step's stage actions (:mod:`.step`) stay as they are. :class:`TieSteps` is mixed into
:class:`~.step.StepRun`; it reads the executor's ``ties`` (``{home: FlatStage}``) and the step's
transport, channels and counters, and keeps its own per-step state (posted fetches, pending
gradient receives, started all-reduces).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lightning_gsched.errors import RuntimeConfigError
from lightning_gsched.runtime.counters import RuntimeCounters
from lightning_gsched.runtime.flat import FlatStage
from lightning_gsched.runtime.transport import Transport, label
from lightning_gsched.schedule.program import Action


class TieSteps:
    """Per-step tie state and one method per tie op (``FETCH_T`` -> ``_fetch_t``, ...)."""

    transport: Transport
    counters: RuntimeCounters
    allreduces: list[tuple[Any, str]]
    ex: Any  # the executor (ExecutorState in step.py)
    _note_bytes: Any  # StepRun's: the peak of resident parameter bytes

    def _begin_ties(self, ties: Mapping[int, FlatStage], owned: set[int],
                    read_by: dict[int, list[int]], forward_only: bool) -> None:
        self.tie_units = ties
        self.ties_of = read_by  # stage -> homes of the ties it reads
        self.tie_fetches: dict[int, tuple[Any, str]] = {}
        self.tie_grad_recvs: dict[int, list[tuple[Any, torch.Tensor, str]]] = {}
        self.tie_reduced: set[int] = set()  # ties whose ALLREDUCE_T has started
        for h in owned:
            ties[h].ensure_owned_views()
            if not forward_only:
                ties[h].zero_grads()

    def _drop_ties(self) -> None:
        self.tie_fetches.clear()
        self.tie_grad_recvs.clear()

    def _ties_ready(self, s: int) -> None:
        """Before a job of stage ``s``: the ties it reads are here (a posted fetch landed)."""
        for h in self.ties_of[s]:
            unit = self.tie_units[h]
            if h in self.tie_fetches:
                work, what = self.tie_fetches.pop(h)
                self.transport.wait(work, what)
            if not unit.resident:
                raise RuntimeConfigError(
                    f"tie {h} (read by stage {s}) is not resident on rank {self.ex.rank} "
                    "(neither owned nor fetched); the programs do not match this rank. Plan once "
                    "and pass the same programs on every rank."
                )
            unit.materialize()

    def _tie_weight_grads(self, s: int) -> None:
        """Before a job accumulates stage ``s``'s weight gradients (B, or W when split): the
        gradient buffers of the ties it reads too."""
        for h in self.ties_of[s]:
            if h in self.tie_reduced:
                raise RuntimeConfigError(
                    f"a weight-gradient job of stage {s} after ALLREDUCE_T of tie {h} started; "
                    "the all-reduce must come after the last weight-gradient job of a stage "
                    "reading the tie on this rank."
                )
            grads = self.tie_units[h].grads
            if not grads.active:
                grads.zero()  # a fetched tie's first weight-gradient job of the step

    def _fetch_t(self, a: Action, index: int) -> None:
        unit = self.tie_units[a.stage]
        if unit.resident:
            raise RuntimeConfigError(f"FETCH_T of tie {a.stage}, which is already resident here")
        work = self.transport.post_flat(unit.fetch_buffer(), a.peer, "weights")
        self.tie_fetches[a.stage] = (work, label(a, index))
        self._note_bytes()

    def _send_t(self, a: Action, index: int) -> None:
        unit = self.tie_units[a.stage]
        if not unit.owned:
            raise RuntimeConfigError(f"SEND_T of tie {a.stage}, which rank {self.ex.rank} does "
                                     "not own")
        self.transport.send_flat(unit.flat, a.peer, "weights", label(a, index))

    def _free_t(self, a: Action, index: int) -> None:
        unit = self.tie_units[a.stage]
        if a.stage in self.tie_fetches:  # fetched but never used: the receive must land first
            work, what = self.tie_fetches.pop(a.stage)
            self.transport.wait(work, what)
        if unit.grads.active:
            raise RuntimeConfigError(
                f"FREE_T of tie {a.stage} while its gradient was not sent to the owner "
                "(REDUCE_T must come first); the programs are not from this planner."
            )
        unit.free()

    def _reduce_t(self, a: Action, index: int) -> None:
        grad = self.tie_units[a.stage].take_grads()
        self.transport.send_flat(grad, a.peer, "grads", label(a, index))

    def _recv_t(self, a: Action, index: int) -> None:
        if a.stage in self.tie_reduced:
            raise RuntimeConfigError(
                f"RECV_T of tie {a.stage} after its ALLREDUCE_T started; gradients must be "
                "received before the owners reduce them."
            )
        unit = self.tie_units[a.stage]
        buffer = torch.empty(unit.grads.numel, dtype=unit.dtype, device=unit.device)
        work = self.transport.post_flat(buffer, a.peer, "grads")
        self.tie_grad_recvs.setdefault(a.stage, []).append((work, buffer, label(a, index)))

    def _add_received_tie_grads(self, h: int) -> None:
        pending = self.tie_grad_recvs.pop(h, [])
        if not pending:
            return
        total = self.tie_units[h].grads.sync()
        for work, buffer, what in pending:
            self.transport.wait(work, what)
            total.add_(buffer)

    def _allreduce_t(self, a: Action, index: int) -> None:
        h = a.stage
        self._add_received_tie_grads(h)
        grad = self.tie_units[h].grads.sync()
        what = f"the all-reduce of {label(a, index)} among ranks {list(a.group or ())}"
        if grad.numel():
            self.allreduces.append((self.ex.channels.all_reduce(grad, a.group), what))
        self.tie_reduced.add(h)
        self.counters.allreduce_bytes += grad.numel() * grad.element_size()

    def _finish_ties(self) -> None:
        """End of step: gradients received for ties that no all-reduce summed in."""
        for h in sorted(self.tie_grad_recvs):
            self._add_received_tie_grads(h)

    def _tie_bytes(self) -> tuple[int, int]:
        """(resident weight bytes, active gradient bytes) of the ties on this rank now."""
        units = self.tie_units.values()
        return (sum(u.resident_bytes() for u in units),
                sum(u.grads.nbytes for u in units if u.grads.active))
