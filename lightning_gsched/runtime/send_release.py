"""Release each sent buffer when its send completes, on every backend.

A program never waits for its own sends, so the transport keeps each send's handle and buffer
until the send is done. NCCL's handles report completion by themselves (``is_completed``), but
gloo's point-to-point handles complete only inside ``wait()``: polled from the step's thread,
every sent buffer would live to the step's end (under ``fsdp``, every fetched stage's gradient at
once). So with ``threaded=True`` a thread of its own waits for the sends in issue order
(``Work.wait`` releases the GIL) and drops each buffer as its wait returns; with
``threaded=False`` each new send drops the completed ones at the head of the queue.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

import torch

from lightning_gsched.errors import RuntimeFault

# a send's wait, raising a RuntimeFault that names the message (faults.Waiter.wait)
WaitFn = Callable[[Any, str], None]


class SendReleaser:
    """This rank's outstanding sends, waited for off the step's thread."""

    def __init__(self, wait: WaitFn, timeout: float, threaded: bool = True) -> None:
        self._wait = wait
        self._threaded = threaded
        self._timeout = float(timeout)
        self._queue: deque[tuple[Any, tuple[torch.Tensor, ...], str]] = deque()
        self._lock = threading.Condition()
        self._failure: RuntimeFault | None = None
        self._busy: str | None = None  # the label of the send the thread is waiting for
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, work: Any, buffers: tuple[torch.Tensor, ...], label: str) -> None:
        """Hold ``buffers`` until ``work`` (their send) completed."""
        if not self._threaded:
            while self._queue and self._queue[0][0].is_completed():
                self._queue.popleft()
            self._queue.append((work, buffers, label))
            return
        with self._lock:
            self._queue.append((work, buffers, label))
            self._lock.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gsched-send-release",
                                            daemon=True)
            self._thread.start()

    @property
    def held(self) -> int:
        """Sends not yet known complete (their buffers still held)."""
        with self._lock:
            return len(self._queue) + int(self._busy is not None)

    def drain(self) -> None:
        """Return once every send so far completed, bounded by the timeout; raise the first
        failure of one (as the step's own :class:`RuntimeFault`)."""
        if not self._threaded:
            while self._queue:
                work, _, label = self._queue[0]
                self._wait(work, label)
                self._queue.popleft()
            return
        deadline = time.monotonic() + self._timeout
        with self._lock:
            while (self._queue or self._busy is not None) and self._failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(timeout=min(left, 1.0))
            failure, self._failure = self._failure, None
            pending = [label for _, _, label in self._queue]
            if self._busy is not None:
                pending.insert(0, self._busy)
        if failure is not None:
            raise failure
        if pending:  # the thread's own wait (same timeout, started earlier) usually fails first
            raise RuntimeFault(f"waiting for {pending[0]}: the step's sends did not complete "
                               f"within {self._timeout:g} s ({len(pending)} outstanding)")

    def clear(self) -> None:
        """Forget every handle (the channels are being aborted); the thread ends."""
        with self._lock:
            self._queue.clear()
            self._closed = True
            self._lock.notify_all()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                work, buffers, label = self._queue.popleft()
                self._busy = label
            try:
                self._wait(work, label)
            except RuntimeFault as fault:
                with self._lock:
                    self._failure = self._failure or fault
            except Exception as exc:  # noqa: BLE001 - reported on the step's thread
                with self._lock:
                    self._failure = self._failure or RuntimeFault(
                        f"the send of {label} failed: {exc}")
            del work, buffers  # the buffer goes with its last reference, now
            with self._lock:
                self._busy = None
                self._lock.notify_all()
