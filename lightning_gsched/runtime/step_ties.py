"""The tie actions of one step: fetch, serve, free, reduce, receive and all-reduce a tie.

Why a module of its own: a tie (tied weights, one flat unit per home stage, see
``schedule/lower_weights.py``) behaves like a stage's weights with another residency rule, and
the step's stage actions (:mod:`.step`) stay as they are. :class:`TieSteps` is mixed into
:class:`~.step.StepRun`; it reads the executor's ``ties`` (``{home: FlatStage}``) and the step's
transport, channels and counters; what a tie's messages do is shared with the stages'
(:class:`~.unit_traffic.UnitTraffic`, one instance per kind).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Mapping

from lightning_gsched.errors import RuntimeConfigError
from lightning_gsched.runtime.counters import RuntimeCounters
from lightning_gsched.runtime.flat import FlatStage
from lightning_gsched.runtime.transport import Transport
from lightning_gsched.runtime.unit_traffic import UnitTraffic
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
        self.tie_io = UnitTraffic("tie", ties, self.transport, self.ex.rank)
        self.ties_of = read_by  # stage -> homes of the ties it reads
        for h in owned:
            ties[h].ensure_owned_views()
            if not forward_only:
                ties[h].zero_grads()

    def _drop_ties(self) -> None:
        self.tie_io.drop()

    def _ties_ready(self, s: int) -> None:
        """Before a job of stage ``s``: the ties it reads are here (a posted fetch landed)."""
        for h in self.ties_of[s]:
            self.tie_io.ready(h, f" (read by stage {s})")

    def _tie_weight_grads(self, s: int) -> None:
        """Before a job accumulates stage ``s``'s weight gradients (B, or W when split): the
        gradient buffers of the ties it reads too."""
        for h in self.ties_of[s]:
            if h in self.tie_io.reduced:
                raise RuntimeConfigError(
                    f"a weight-gradient job of stage {s} after ALLREDUCE_T of tie {h} started; "
                    "the all-reduce must come after the last weight-gradient job of a stage "
                    "reading the tie on this rank."
                )
            grads = self.tie_io.units[h].grads
            if not grads.active:
                grads.zero()  # a fetched tie's first weight-gradient job of the step

    def _fetch_t(self, a: Action, index: int) -> None:
        self.tie_io.fetch(a, index)
        self._note_bytes()

    def _send_t(self, a: Action, index: int) -> None:
        self.tie_io.serve(a, index)

    def _free_t(self, a: Action, index: int) -> None:
        self.tie_io.free(a, index, "REDUCE_T")

    def _reduce_t(self, a: Action, index: int) -> None:
        self.tie_io.hand_off(a, index)

    def _recv_t(self, a: Action, index: int) -> None:
        self.tie_io.post_grad(a, index)

    def _allreduce_t(self, a: Action, index: int) -> None:
        grad, works = self.tie_io.all_reduce(
            a, index, partial(self.ex.channels.all_reduce, members=a.group))
        self.allreduces.extend(works)
        self.counters.allreduce_bytes += grad.numel() * grad.element_size()
