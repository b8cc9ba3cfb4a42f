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
