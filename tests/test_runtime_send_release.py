"""Sent buffers are released when their send completes, not at the step's end.

``runtime/transport.py``'s ``SendReleaser`` waits for a rank's sends in a thread of its own. These checks hold
the buffers through weak references: a buffer the releaser still holds stays alive, one it
dropped dies with its last reference. On gloo (the point that motivated it: a gloo send only
completes inside ``wait()``) a real two-process send is released once the peer has received it,
while the sender never calls ``drain``.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import pytest
import torch

from dist_harness import WorkerContext
from lightning_gsched.errors import RuntimeFault
from lightning_gsched.runtime.transport import SendReleaser


class FakeWork:
    """A send handle that completes when the test says so (or fails)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: Exception | None = None

    def wait_for(self, label: str) -> None:
        if not self.done.wait(timeout=10):
            raise RuntimeFault(f"timed out waiting for {label}")
        if self.error is not None:
            raise RuntimeFault(f"lost the peer waiting for {label}: {self.error}")


def _wait(work: Any, label: str) -> None:
    work.wait_for(label)


def _until(condition: Any, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_each_buffer_goes_when_its_send_completes_in_issue_order() -> None:
    releaser = SendReleaser(_wait, timeout=10)
    works = [FakeWork(), FakeWork()]
    refs = []
    for i, work in enumerate(works):
        buffer = torch.zeros(1000)
        refs.append(weakref.ref(buffer))
        releaser.add(work, (buffer,), f"message {i}")
        del buffer
    time.sleep(0.05)
    assert all(r() is not None for r in refs) and releaser.held == 2
    works[0].done.set()
    assert _until(lambda: refs[0]() is None), "the completed send's buffer was kept"
    assert refs[1]() is not None and releaser.held == 1
    works[1].done.set()
    releaser.drain()
    assert refs[1]() is None and releaser.held == 0


def test_a_failed_send_is_raised_at_the_drain_naming_the_message() -> None:
    releaser = SendReleaser(_wait, timeout=10)
    work = FakeWork()
    work.error = ConnectionError("connection reset")
    releaser.add(work, (torch.zeros(4),), "'REDUCE_G s1 ->0' (action 7)")
    work.done.set()
    with pytest.raises(RuntimeFault, match=r"REDUCE_G s1 ->0.*connection reset"):
        releaser.drain()


def test_the_drain_is_bounded_by_the_timeout() -> None:
    releaser = SendReleaser(_wait, timeout=0.3)
    releaser.add(FakeWork(), (torch.zeros(4),), "'SEND_ACT s0 b0 ->1' (action 1)")
    start = time.monotonic()
    with pytest.raises(RuntimeFault, match="SEND_ACT s0 b0"):
        releaser.drain()
    assert time.monotonic() - start < 5
    releaser.clear()


class SelfCompletingWork:
    """An NCCL-like handle: it reports completion without being waited for."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def is_completed(self) -> bool:
        return self.done

    def wait_for(self, label: str) -> None:
        self.waited = True


def test_handles_that_complete_by_themselves_need_no_thread() -> None:
    """``threaded=False`` (NCCL): a new send drops the completed ones at the head of the queue;
    the drain waits for the rest, in order."""
    releaser = SendReleaser(_wait, timeout=10, threaded=False)
    first, second, third = SelfCompletingWork(), SelfCompletingWork(), SelfCompletingWork()
    buffer = torch.zeros(10)
    ref = weakref.ref(buffer)
    releaser.add(first, (buffer,), "first")
    del buffer
    first.done = True
    releaser.add(second, (torch.zeros(1),), "second")
    assert ref() is None and releaser.held == 1  # first went when second was sent
    releaser.add(third, (torch.zeros(1),), "third")
    releaser.drain()
    assert releaser.held == 0 and second.waited and third.waited and not first.waited


def gloo_release_check(ctx: WorkerContext) -> bool | None:
    """Rank 0 sends; rank 1 receives. Rank 0's buffer must die before rank 0 drains."""
    import torch.distributed as dist

    from lightning_gsched.runtime.faults import Waiter

    class Nowhere:
        def first_fault(self, grace: float = 0.0) -> None:
            return None

    group = dist.new_group([0, 1])
    if ctx.rank == 1:
        time.sleep(0.2)  # the send is issued well before the receive is posted
        buffer = torch.empty(1 << 20)
        dist.irecv(buffer, 0, group=group).wait()
        dist.barrier(group=group)
        return None
    waiter = Waiter(0, Nowhere(), 30.0, lambda: "test")  # type: ignore[arg-type]
    releaser = SendReleaser(waiter.wait, 30.0)
    payload = torch.ones(1 << 20)
    ref = weakref.ref(payload)
    releaser.add(dist.isend(payload, 1, group=group), (payload,), "the check's message")
    del payload
    released = _until(lambda: ref() is None, 20.0)
    dist.barrier(group=group)
    releaser.drain()
    return released


def test_a_gloo_send_buffer_is_released_before_the_step_drains(worlds: Any) -> None:
    results = worlds.get(2).run(gloo_release_check)
    assert results[0] is True, "gloo: the sent buffer lived until the drain"
