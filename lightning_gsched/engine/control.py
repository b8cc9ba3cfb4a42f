"""The strategy's own process group and the job's failure notice, outside the runtime's steps.

Why: the runtime bounds every wait of a step and, on a failure, tears down its groups so peers
stop at once (``runtime/faults.py``). But between steps the ranks also meet in the front end's
collectives: the batch's row exchange, the loss/log exchange, the evaluation gather, the build's
broadcasts, Lightning's ``barrier``/``broadcast`` (``ModelCheckpoint``). On the default group those
wait for the launcher's ``timeout`` (30 minutes by default), and a rank that fails in a hook the
others never reach (a callback, the dataloader, ``validation_step`` on one rank) leaves them
there. :class:`ControlGroup` gives those collectives a group of their own whose timeout is
``step_timeout``, and :meth:`ControlGroup.abort` (called by the failing rank) writes
``"rank r failed in <hook>: ..."`` into the job's store and destroys that group, which closes its
connections: every peer waiting in one of these collectives fails within about a second, and
:meth:`ControlGroup.fault` turns the backend's error into a :class:`RuntimeFault` quoting the
first failure.
"""

from __future__ import annotations

import itertools
import os
import time
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from lightning_gsched.errors import GschedError, RuntimeFault, error_text
from lightning_gsched.runtime import (
    LOST_PEER_GRACE_S,
    FaultNotice,
    default_is_gloo,
    default_store,
    destroy_groups,
    gloo_group,
    new_group,
    release_frames,
)

T = TypeVar("T")
# the engine's ``collective(what, fn)``: ``fn()``, a backend failure in it a RuntimeFault naming
# ``what`` and quoting the job's first failure (:meth:`ControlGroup.run`)
Collective = Callable[[str, Callable[[], Any]], Any]
_SERIAL = itertools.count()  # same sequence on every rank: groups are built collectively



class ControlGroup:
    """One process group over every rank (timeout ``timeout`` s) and the failure notice."""

    def __init__(self, rank: int, timeout: float) -> None:
        self.rank = rank
        self.timeout = float(timeout)
        # on a gloo job it shares the default group's transport device (runtime/gloo_groups)
        self.group: Any = new_group(timeout=timedelta(seconds=self.timeout))
        # host numbers (every rank's batch rows) travel without the device: on a GPU job a
        # collective over the default backend's group takes device tensors, and reading its
        # result back waits for everything queued on the device (each step's start, otherwise)
        self.host_group: Any = self.group if default_is_gloo() else gloo_group(
            timeout=timedelta(seconds=self.timeout))
        self.store = default_store()
        self.key = f"lightning_gsched/control-fault/{next(_SERIAL)}"
        self.notice = FaultNotice(self.store, self.key)
        self.notice.publish(rank)
        self.closed = False
        self.failed = False  # a collective here failed, or this rank aborted: the job is ending
        self.host_pid = self._share_host_pid()

    def _share_host_pid(self) -> int | None:
        """Rank 0's process id, published through the store (every rank builds the group)."""
        if self.store is None:
            return None
        try:
            if self.rank == 0:
                self.store.set(self.key + "/host-pid", str(os.getpid()))
            return int(self.store.get(self.key + "/host-pid"))
        except Exception:  # noqa: BLE001 - only :meth:`outlive_host` reads it
            return None

    def report(self, message: str) -> None:
        """Record the job's first failure (a later report keeps the first)."""
        self.notice.report(message)

    def first_fault(self) -> str | None:
        return self.notice.first()

    def run(self, what: str, collective: Callable[[], T]) -> T:
        """``collective()``, with a backend failure turned into a RuntimeFault (see module doc)."""
        try:
            return collective()
        except GschedError:
            # this rank's own error (a fault, or a check every rank makes alike, e.g. a plan
            # that cannot shard the stages): raised as it is, whole, not as a lost connection;
            # the front end's failure handling reports it to the peers (abort)
            raise
        except RuntimeError as exc:  # gloo/nccl: lost connection, timeout, aborted group
            # the failed call's frames hold the group (an argument) while the error propagates:
            # destroying it would not close its connections (a peer would wait for step_timeout)
            release_frames(exc)
            raise self.fault(what, exc) from exc

    def barrier(self, name: str | None = None) -> None:
        """A barrier of every rank on this group (what a front end's ``barrier`` runs)."""
        self.run(f"barrier {name!r}" if name else "a barrier",
                 lambda: dist.barrier(group=self.group))

    def broadcast_object(self, obj: T, src: int = 0) -> T:
        """``src``'s ``obj`` on every rank (what a front end's ``broadcast`` runs)."""
        box = [obj]
        self.run("a broadcast", lambda: dist.broadcast_object_list(box, src, group=self.group))
        return box[0]

    def fault(self, what: str, exc: BaseException) -> RuntimeFault:
        from lightning_gsched.runtime import is_timeout, short_reason

        self.failed = True
        timed_out = is_timeout(exc)
        # a lost connection is often the first news of a peer's failure: its notice may
        # still be on its way (FaultNotice.first_within)
        first, exited = (self.notice.first(), "") if timed_out else \
            self.notice.after_lost_connection(LOST_PEER_GRACE_S, dist.get_world_size())
        how = (f"nothing arrived within {self.timeout:g} s (step_timeout)" if timed_out
               else f"lost the connection to a peer ({short_reason(exc)})")
        message = f"rank {self.rank} stopped in {what}: {how}"
        if first and not first.startswith(f"rank {self.rank} "):
            message += f". First failure reported in the job: {first}"
        elif not first and exited:  # killed outright: it could not report, but it is gone
            message += f". No rank reported a failure; {exited}"
        elif not first:
            message += (". No rank reported a failure: a peer is stuck or died (see its log); "
                        "raise step_timeout if a peer is only slower")
            if timed_out:
                message += ". Where the ranks wait: " + self.notice.positions(
                    self.rank, dist.get_world_size(), f"in {what}")
        self.report(message)
        return RuntimeFault(message)

    def abort(self, message: str) -> None:
        """This rank failed (or stopped for a peer's failure): tell the job, and close the
        group so peers stop waiting for it. A rank whose message is not the first failure
        acknowledges having read it (:meth:`linger`)."""
        self.failed = True
        self.report(message)
        first = self.first_fault()
        if first is not None and not first.startswith(f"rank {self.rank} ") \
                and self.store is not None:
            try:
                self.store.add(self.key + "/read", 1)
            except Exception:  # noqa: BLE001
                pass
        self.close(collect=True)

    def linger(self, peers: int, stop: Callable[[], bool] = lambda: False) -> None:
        """On the rank that hosts the job's store (rank 0) after it failed: wait until the
        ``peers`` others have read the failure, at most ``timeout`` s, before the process
        exits and takes the store with it (otherwise a peer can find the notice gone).

        Not under torchrun's agent store (the agent hosts it, not this process), and not once
        ``stop()`` (a SIGTERM: the launcher is ending the group, e.g. torchrun after a peer's
        kill -9, whose dead peer never reads the notice)."""
        if self.store is None or peers <= 0:
            return
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and not stop():
            try:
                if self.store.add(self.key + "/read", 0) >= peers:
                    return
            except Exception:  # noqa: BLE001
                return
            time.sleep(0.05)

    def outlive_host(self) -> None:
        """On a rank whose parent process is rank 0 (Lightning's own launcher started it),
        after a failure: wait until rank 0's process has ended, at most ``timeout`` s.

        Why: that launcher watches its children and SIGKILLs itself and all of them within
        5 s of one exiting non-zero (Lightning's ``_ChildProcessObserver``). A failed child
        that exits first can cut rank 0 off before rank 0 has printed its own error (the one
        naming the first failure) or before the user's script has written anything after
        ``fit``. Rank 0 never waits on its children, so the wait cannot deadlock. Not under
        torchrun or SLURM, where rank 0 is not the parent."""
        if self.host_pid is None or self.rank == 0 or os.getppid() != self.host_pid:
            return
        deadline = time.monotonic() + self.timeout
        while os.getppid() == self.host_pid and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self, collect: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        groups = [self.group] if self.host_group is self.group else [self.group, self.host_group]
        self.group = self.host_group = None
        destroy_groups(groups, collect)


class UncaughtExitReport:
    """While installed: an exception that ends this rank's process uncaught is told to the job,
    and a child of rank 0 then outlives rank 0.

    Why: in a user's own loop (Fabric) nothing of ours runs when the user's code raises between
    steps, or when our own error is not caught. Without this, the rank exits and its peers wait
    in the next collective until ``step_timeout``, learning only that a peer was lost; and
    Lightning's launcher, seeing a child exit non-zero, SIGKILLs rank 0 within 5 s, maybe before
    rank 0 has printed its own error (:meth:`ControlGroup.outlive_host`). Chained to
    ``sys.excepthook``, which Python calls after the traceback would be printed and before the
    interpreter ends: the previous hook prints it, then ``abort(message)`` (unless ``failed()``:
    the job already knows) closes this rank's connections with the message in the job's store,
    and the wait for rank 0 follows.
    """

    def __init__(self, control: ControlGroup, abort: Callable[[str], None],
                 failed: Callable[[], bool]) -> None:
        self.control = control
        self.abort = abort
        self.failed = failed
        self._previous: Callable[..., Any] | None = None

    def install(self) -> None:
        import sys

        if self._previous is None:
            self._previous, sys.excepthook = sys.excepthook, self._hook

    def uninstall(self) -> None:
        import sys

        if self._previous is not None and sys.excepthook == self._hook:
            sys.excepthook = self._previous
        self._previous = None

    def _hook(self, kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        import sys

        previous = self._previous or sys.__excepthook__
        previous(kind, value, traceback)
        try:
            sys.stderr.flush()
            if not self.failed():
                self.abort(f"rank {self.control.rank} ended by an uncaught {error_text(value)}")
            self.control.outlive_host()
        except Exception:  # noqa: BLE001 - the process is ending: never mask its own error
            pass
