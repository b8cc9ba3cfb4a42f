"""Small Python objects exchanged by every rank on a group whose waits end after a timeout.

Why: the checkpoint service's agreements (a checkpoint read and checked on every rank, a sharded
save's phases) must never wait longer than ``step_timeout``. On the default group a rank that
failed, or never arrived, leaves the others waiting for the launcher's timeout (30 minutes by
default). A :class:`BoundedExchange` is a gloo group of its own (the objects are small and live
on the host, so no device is involved) with ``step_timeout`` as its timeout. A wait that runs
out, or a peer that never joins or drops its connection, ends in the backend's RuntimeError
(torch's store time-out, gloo's closed connection); the exchange turns it into the caller's own
error, made by the caller's ``lost`` (which words it: a save, a load), here once for both.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

from lightning_gsched.runtime import gloo_group

Lost = Callable[[Optional[str], str], Exception]
"""``lost(during, reason)``: the caller's error for a peer that never joined the exchange
(``during`` None) or did not answer while ``during``; ``reason``: the backend's first line."""


def _reason(exc: BaseException) -> str:
    """A backend error's first line (torch's store and gloo messages run to many lines)."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


class BoundedExchange:
    """A gloo group over every rank (timeout ``timeout`` s); a world of one needs none. Made
    by every rank (collective, bounded): a peer that never makes it is ``lost(None, ...)``."""

    def __init__(self, timeout: float, lost: Lost) -> None:
        self.timeout = float(timeout)
        self.lost = lost
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.group: Any = None
        if self.world > 1:
            try:
                self.group = gloo_group(timeout=timedelta(seconds=timeout))
            except RuntimeError as exc:  # torch.distributed's DistStoreError: no peer joined
                raise lost(None, _reason(exc)) from exc

    def gather(self, value: Any, during: str) -> list[Any]:
        """Every rank's ``value``, in rank order (collective); a peer that does not answer
        within the timeout is ``lost(during, ...)``."""
        if self.group is None:
            return [value]
        values: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(values, value, group=self.group)
        except RuntimeError as exc:  # gloo: the timeout ran out, or a peer's connection went
            raise self.lost(during, _reason(exc)) from exc
        return values

    def close(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            dist.destroy_process_group(group)
