"""Small Python objects exchanged by every rank on a group whose waits end after a timeout.

Why: the checkpoint service's agreements (a checkpoint read and checked on every rank, a sharded
save's phases) must never wait longer than ``step_timeout``. On the default group a rank that
failed, or never arrived, leaves the others waiting for the launcher's timeout (30 minutes by
default). A :class:`BoundedExchange` is a gloo group of its own (the objects are small and live
on the host, so no device is involved) with ``step_timeout`` as its timeout; a wait that runs
out ends in a RuntimeError from the backend, which the caller turns into its own error.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_gsched.runtime import gloo_group


def backend_reason(exc: BaseException) -> str:
    """A backend error's first line (torch's store and gloo messages run to many lines), for a
    caller's own message."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


class BoundedExchange:
    """A gloo group over every rank (timeout ``timeout`` s); a world of one needs none."""

    def __init__(self, timeout: float) -> None:
        self.timeout = float(timeout)
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.group: Any = None
        if self.world > 1:
            self.group = gloo_group(timeout=timedelta(seconds=timeout))

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (collective)."""
        if self.group is None:
            return [value]
        values: list[Any] = [None] * self.world
        dist.all_gather_object(values, value, group=self.group)
        return values

    def close(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            dist.destroy_process_group(group)
