"""A rank that lost its connection to a peer waits briefly for the peer's failure notice.

The race this closes (seen in ``test_lightning_faults.py``'s full runs): a failing rank records
its failure in the job's store and then drops its connections, but a peer can see the dropped
connection before the record is visible; it then recorded its own "lost the connection" as the
job's first failure, quoting no cause, and Lightning's launcher killed it while it waited for
acknowledgements. ``FaultNotice.first_within`` polls the store for a bounded time instead.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from lightning_gsched.runtime import FaultNotice


def _store() -> dist.HashStore:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    return store


def test_a_notice_recorded_during_the_grace_is_found() -> None:
    store = _store()
    notice = FaultNotice(store, "job/fault")
    assert notice.first() is None  # not recorded yet: the plain read does not wait

    def late_report() -> None:
        time.sleep(0.2)
        FaultNotice(store, "job/fault").report("rank 1 failed in the dataloader: ValueError")

    writer = threading.Thread(target=late_report)
    writer.start()
    try:
        assert notice.first_within(3.0) == "rank 1 failed in the dataloader: ValueError"
    finally:
        writer.join()


def test_without_a_notice_the_grace_is_bounded_and_the_first_report_stays() -> None:
    store = _store()
    notice = FaultNotice(store, "job/fault")
    start = time.monotonic()
    assert notice.first_within(0.3) is None
    assert 0.3 <= time.monotonic() - start < 3.0  # bounded: a dead peer never reports
    notice.report("rank 0 stopped: lost the connection to a peer")
    notice.report("rank 1 failed later")  # a later report keeps the first
    assert notice.first_within(0.0) == "rank 0 stopped: lost the connection to a peer"


_CHILD = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from lightning_gsched.runtime import peer_processes
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
                      timeout=timedelta(seconds=30))
peer_processes.publish(store, int(sys.argv[2]))
print("published", flush=True)
time.sleep(60)
"""


def test_a_rank_killed_outright_is_named_by_its_peers() -> None:
    """A SIGKILLed rank reports nothing; a peer that lost its connection names it from the
    process table: ranks 1 and 2 publish themselves from their own processes, rank 2 is killed
    (a zombie until its parent reaps it, then gone), rank 1 runs on; this process is rank 0."""
    import signal
    import subprocess
    import sys

    from lightning_gsched.runtime import peer_processes
    from lightning_gsched.runtime.faults import Waiter

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    notice = FaultNotice(store, "job/fault")
    notice.publish(0)
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, str(store.port), str(rank)],
                                 stdout=subprocess.PIPE, text=True) for rank in (1, 2)]
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline().strip() == "published"
        assert peer_processes.gone(store, 3) == []  # every rank running
        children[1].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while peer_processes.gone(store, 3) == [] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert peer_processes.gone(store, 3) == [(2, children[1].pid)]  # a zombie: not reaped
        children[1].wait()
        assert peer_processes.gone(store, 3) == [(2, children[1].pid)]  # reaped: no process
        assert peer_processes.gone(store, 5) == [(2, children[1].pid)]  # 3, 4 never published

        class Channels:  # what Waiter reads of the runtime's channels
            def after_lost_connection(self, grace: float) -> tuple[str | None, str]:
                return notice.after_lost_connection(grace, 3)

        lost = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                            "[127.0.0.1]:41234")
        start = time.monotonic()
        fault = Waiter(0, Channels(), 5.0, lambda: "'B s0 b1' (action 7)").fault(
            "the gradient of s1 b1 from rank 1", lost, 0.1)
        assert f"rank 2 (pid {children[1].pid}) has exited without reporting a failure" \
            in str(fault), fault
        assert "rank 1 " not in str(fault).split("No rank reported")[1]
        assert time.monotonic() - start < 1.5  # the peer is gone: no grace waited for its notice
    finally:
        for child in children:
            child.kill()
            child.wait()
