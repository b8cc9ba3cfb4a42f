"""SIGTERM / SIGUSR1 recorded by a handler and agreed by every rank at a step's own exchange.

Why: a preemption notice reaches one rank (or the launcher) at any moment. Under a pipeline
schedule the other ranks are inside the step's traffic, so a rank that dies of the signal (the
default action) or acts on it alone (a collective in the handler, a save, leaving the loop)
leaves its peers waiting for messages that never come. Here the handler only records the
signal (:attr:`PreemptionNotice.pending`); the engine's training step and evaluation step carry
every rank's pending signal in the exchange they run anyway (``PipelineEngine.training_step``'s
``notice``: one slot per rank of the loss/log all-reduce), and :meth:`PreemptionNotice.agree`
turns the result, the same list on every rank, into :attr:`PreemptionNotice.agreed` after the
same step everywhere. A loop can then save (a collective) and stop on every rank together.

The Fabric strategy installs one (``GeneralParallelFabric.preempted``); the Trainer strategy
keeps its own connector (``lightning/preemption.py``), which holds a
:class:`PreemptionAgreement` and adds Lightning's loop flag and SLURM requeue to it.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Callable

Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def signal_name(code: int) -> str:
    """``SIGTERM`` for 15 (a number the platform does not name: ``signal <n>``)."""
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


class PreemptionAgreement:
    """A rank's pending notice and, after a step's exchange, the notices every rank agreed on:
    the state both front ends keep (the Trainer's connector holds one, Fabric's notice is one)."""

    def __init__(self) -> None:
        self.pending = 0  # the first notice signal this rank received (0: none)
        self.agreed: dict[int, int] = {}  # rank -> signal, once every rank has agreed
        self.agreed_at = ""  # where every rank learnt of it, e.g. "step 7"

    def record(self, signum: int) -> bool:
        """Note a signal from the handler (no collective, no I/O); True for the first."""
        if self.pending:
            return False
        self.pending = int(signum)
        return True

    def agree(self, notices: list[int], where: str) -> bool:
        """Every rank's pending signal after one exchange (the same list on every rank);
        ``where`` names the step. True at the step where the ranks first agree."""
        if self.agreed or not any(notices):
            return False
        self.agreed = {rank: code for rank, code in enumerate(notices) if code}
        self.agreed_at = where
        return True

    def describe(self, rank: int, then: str) -> str:
        """The line each rank prints when the notice is agreed; ``then``: what to do now."""
        who = ", ".join(f"{signal_name(code)} on rank {r}" for r, code in sorted(self.agreed.items()))
        return (f"rank {rank}: preemption notice ({who}) agreed by every rank in "
                f"{self.agreed_at}; {then}")


class PreemptionNotice(PreemptionAgreement):
    """SIGTERM (and SIGUSR1, unless the program handles it itself) as a preemption notice."""

    def __init__(self) -> None:
        super().__init__()
        self._previous: dict[int, Handler] = {}

    def install(self) -> None:
        """Record SIGTERM and SIGUSR1 from now on. A handler the program installed before is
        kept: SIGTERM's is called after recording, SIGUSR1 is left to it alone. Only the main
        thread can install handlers; elsewhere nothing is installed (signals act as before)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            previous = signal.getsignal(signum)
            if signum == signal.SIGUSR1 and callable(previous):
                continue  # the program's own SIGUSR1 (e.g. a requeue handler) stays in charge
            self._previous[signum] = previous
            signal.signal(signum, self._record)

    def uninstall(self) -> None:
        """Put back the handlers :meth:`install` replaced."""
        previous, self._previous = self._previous, {}
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        """The handler: record the first notice, then a program's own SIGTERM handler."""
        self.record(signum)
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
