"""Bounded waits and the errors a rank raises when it fails or a peer does.

A distributed step must never hang: every blocking wait of the runtime goes through
:meth:`Waiter.wait`, at most ``timeout`` seconds (one ``work.wait(timeout=...)``: gloo's
point-to-point work cannot be polled), turning a timeout or a lost connection into a
:class:`RuntimeFault` naming this rank, its action, the awaited message and the first failure any
rank reported. A failing rank destroys its groups, so its peers' waits fail at once with a lost
connection; a rank that hangs is caught by its peers' timeouts.
"""

from __future__ import annotations

import re
import time
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from lightning_gsched.errors import RuntimeFault
from lightning_gsched.runtime.channels import LOST_PEER_GRACE_S, Channels

_GLOO_PREFIX = re.compile(r"^\[[^\]]*\]\s*")


def is_timeout(exc: BaseException | None) -> bool:
    """Whether a backend error (None: a wait that returned unfinished) is a timeout rather than a
    lost connection (only the latter waits for the peer's notice, ``LOST_PEER_GRACE_S``)."""
    return exc is None or "timed out" in str(exc).lower() or "timeout" in str(exc).lower()


def is_backend_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came from the communication backend (a lost peer, a closed connection, a
    timeout), e.g. inside a tensor-parallel layer's collective, rather than from the compute."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("gloo" in text or "Connection closed" in text
                                              or "Connection reset" in text)


# frames of these files may hold process groups and pending work handles
_OWN_FRAMES = (str(Path(__file__).resolve().parents[1]), str(Path(dist.__file__).resolve().parent))


def release_frames(exc: BaseException) -> None:
    """Clear the locals of our and torch.distributed's frames that ``exc``'s traceback (and its
    causes') holds. Call it before destroying groups on a failure: while the error propagates,
    those frames keep a group or a pending work handle alive, the group's connections stay open,
    and a peer waiting on this rank learns of nothing until its own timeout. The user's frames
    keep their locals (for post-mortem debugging); a frame still running is skipped."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename.startswith(_OWN_FRAMES):
                with suppress(RuntimeError):  # a frame still executing
                    tb.tb_frame.clear()
            tb = tb.tb_next
        error = error.__cause__ or error.__context__


def short_reason(exc: BaseException) -> str:
    """One line of a backend error, without gloo's source-location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = _GLOO_PREFIX.sub("", text)
    text = text.split(" This is typically")[0].rstrip(".")  # gloo's generic advice
    if len(text) > 200:
        text = text[:200] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Waiter:
    """Waits on communication handles with a deadline; builds the fault messages. ``where``
    returns the current position, e.g. ``"'F s1 b0' (action 3)"``."""

    def __init__(self, rank: int, channels: Channels, timeout: float,
                 where: Callable[[], str]) -> None:
        self.rank = rank
        self.channels = channels
        self.timeout = float(timeout)
        self.where = where

    def wait(self, work: Any, what: str) -> None:
        """Block until ``work`` completes, at most ``timeout`` s; ``what`` names the message."""
        start = time.monotonic()
        try:
            done = work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as exc:  # noqa: BLE001 - every backend failure becomes a RuntimeFault
            raise self.fault(what, exc, time.monotonic() - start) from exc
        if done is False:
            raise self.fault(what, None, time.monotonic() - start)

    def fault(self, what: str, exc: BaseException | None, elapsed: float | None
              ) -> RuntimeFault:
        """The fault of a failed wait (``elapsed`` None: a collective not timed here)."""
        where = f"at {self.where()} waiting for {what}"
        if is_timeout(exc) or exc is None:  # (is_timeout(None) is True)
            message = (f"rank {self.rank} timed out {where}: nothing arrived within "
                       f"{self.timeout:g} s")
            first, exited = self.channels.first_fault(0.0), ""
        else:
            after = "" if elapsed is None else f" after {elapsed:.1f} s"
            message = (f"rank {self.rank} stopped {where}: lost the connection to a "
                       f"peer{after} ({short_reason(exc)})")
            first, exited = self.channels.after_lost_connection(LOST_PEER_GRACE_S)
        if exited and not first:  # killed outright: it could not report, but it is gone
            cause = f". No rank reported a failure; {exited}"
        elif not first:
            cause = (". No rank reported a failure: a peer is stuck, died, or runs different "
                     "programs (every rank must plan the same schedule, stages and microbatches); "
                     "raise timeout= if a peer is only slower")
            if is_timeout(exc) or exc is None:
                cause += ". Where the ranks wait: " + self.channels.positions(where)
        else:  # the job's first failure, unless it is this rank's own
            own = first.startswith(f"rank {self.rank} ")
            cause = "" if own else f". First failure reported in the job: {first}"
        fault = RuntimeFault(message + cause)
        fault.headline = message  # what peers quote as the root cause
        return fault
