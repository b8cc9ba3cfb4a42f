"""SIGTERM / SIGUSR1 as a preemption notice that every rank acts on at the same step boundary.

Why not Lightning's own handling: Lightning's ``_SignalConnector`` runs a ``dist.broadcast`` from
*inside* the SIGTERM handler. A signal interrupts the rank wherever it is; under a pipeline
schedule the other ranks are then inside the schedule's own traffic (a P2P wait, the batch
all-gather, the loss/log exchange), so the broadcast never meets its peers and the job hangs.
Its loops also read ``trainer.received_sigterm`` per rank (end of a training batch, end of each
evaluation batch), so a rank that got the signal leaves the loop alone.

Here (as for Fabric, :mod:`lightning_gsched.engine.preemption`) the handler only records the signal (:attr:`PreemptionSignals.pending`). The strategy hands
that number to the step's exchange that every rank runs anyway (the per-step loss/log all-reduce
in training, the log gather in evaluation; :mod:`.logsync`), and :meth:`agree` turns the result
into ``received_sigterm = True`` on every rank *after the same step*. Lightning's loops then raise
their ``SIGTERMException`` at the same place on every rank, so its ``on_exception`` callbacks
(``ModelCheckpoint(save_on_exception=True)``, ``OnExceptionCheckpoint``) run on all ranks
together and their collective saves complete. Lightning's per-batch broadcast of the flag
(``_broadcast_sigterm_tensor``, a world collective) is replaced by a local check: the flag is
already the same on every rank.

SIGUSR1 (or ``SLURMEnvironment.requeue_signal``) under ``SLURMEnvironment(auto_requeue=True)``
keeps Lightning's convention (save ``hpc_ckpt_<n>.ckpt``, ``scontrol requeue``), done at the agreed
boundary (:meth:`requeue_if_asked`) instead of inside the handler. Without SLURM, SIGUSR1 is a
preemption notice like SIGTERM (unless the program installed its own SIGUSR1 handler).
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any, Optional

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_gsched.engine import PreemptionAgreement, signal_name


class PreemptionSignals(_SignalConnector):
    """The Trainer's signal connector under GeneralParallel (see module doc)."""

    def __init__(self, trainer: Any) -> None:
        super().__init__(trainer)
        self.agreement = PreemptionAgreement()  # the state Fabric's notice keeps too
        self.registered = False  # handlers in place for this run (until teardown)

    @property
    def pending(self) -> int:
        """The first preemption signal this rank received (0: none)."""
        return self.agreement.pending

    @property
    def agreed(self) -> dict[int, int]:
        """Rank -> signal, once every rank has agreed."""
        return self.agreement.agreed

    # ------------------------------------------------------------------ handlers

    def register_signal_handlers(self) -> None:
        """Install the handlers, once per run. The strategy calls this at its
        ``setup_environment``, so a signal during the module's ``setup``, ``configure_model``,
        ``configure_optimizers`` or a checkpoint's restore is recorded (and agreed at the first
        step) instead of killing the rank; Lightning's own call, just before the loop starts,
        then keeps what was recorded."""
        if self.registered:
            return
        self.registered = True
        self.received_sigterm = False
        self.agreement = PreemptionAgreement()
        self._original_handlers = self._get_current_signal_handlers()
        for signum in self._notice_signals():
            handlers: list[Any] = [self._notice]
            if self._has_already_handler(signum):  # keep a program's own handler, as Lightning
                handlers.append(signal.getsignal(signum))
            self._register_signal(signum, _HandlersCompose(handlers))
        # the loop's per-batch SIGTERM broadcast becomes this connector's agreement
        loop = self.trainer.fit_loop.epoch_loop
        loop._broadcast_sigterm_tensor = self._check_at_batch_start  # type: ignore[method-assign]

    def _notice_signals(self) -> list[int]:
        signals: list[int] = [signal.SIGTERM]
        requeue = self._requeue_signal()
        if requeue is not None:
            signals.append(requeue)
        elif not self._has_already_handler(signal.SIGUSR1):
            signals.append(signal.SIGUSR1)
        return signals

    def _requeue_signal(self) -> Optional[int]:
        environment = self.trainer._accelerator_connector.cluster_environment
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            return int(environment.requeue_signal or signal.SIGUSR1)
        return None

    def _notice(self, signum: Any, _: Optional[FrameType]) -> None:
        """The handler: record the signal; no collective, no I/O beyond forwarding."""
        if self.agreement.record(int(signum)) and int(signum) == signal.SIGTERM:
            launcher = self.trainer.strategy.launcher
            if launcher is not None:  # the script launcher's children, as Lightning does
                launcher.kill(signum)

    def teardown(self) -> None:
        super().teardown()
        self.registered = False
        self.trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)

    # ------------------------------------------------------------------ agreement

    def agree(self, notices: list[int], where: str) -> None:
        """Every rank's pending signal after one exchange (the same list on every rank);
        ``where`` names the step, for the message."""
        if self.agreement.agree(notices, where):
            self.received_sigterm = True  # Lightning's loops stop at the same point everywhere

    def _check_at_batch_start(self) -> None:
        """Replaces Lightning's per-batch broadcast of the flag: it is the same everywhere."""
        if self.received_sigterm:
            raise SIGTERMException()

    def describe(self, rank: int) -> str:
        """The line each rank prints when the preemption stops it."""
        return self.agreement.describe(
            rank, "every rank stops after that step. Resume with "
            "trainer.fit(..., ckpt_path='last') (save one on the way out with "
            "ModelCheckpoint(save_last=True, save_on_exception=True))")

    def requeue_if_asked(self) -> bool:
        """Lightning's SLURM auto-requeue (save ``hpc_ckpt_<n>.ckpt``, ``scontrol requeue``),
        at the agreed boundary where every rank can take part in the save."""
        requeue = self._requeue_signal()
        if requeue is None or requeue not in self.agreed.values():
            return False
        rank_zero_info(f"Handling auto-requeue signal {signal_name(requeue)} at a step boundary")
        self._slurm_sigusr_handler_fn(requeue, None)  # type: ignore[arg-type]
        return True
