"""The per-step fast paths of the strategy: local microbatches and the loss/log all-reduce.

Both replace a general collective (all-gather of the batch, pickled all-gather of losses and
logs) by something cheaper when it is safe, so each is checked against the general path it
replaces, including the cases where it must fall back.
"""

from __future__ import annotations

import pytest
import torch

from dist_harness import WorkerContext
from lightning_gsched.engine.batches import (
    GlobalBatch,
    gather_batch,
    owns_its_micros,
    rows_and_layouts,
    split_batch,
)
from lightning_gsched.engine.intercept import LogRecord
from lightning_gsched.engine.logsync import LossLogExchange, exchange


def test_owns_its_micros_follows_row_ranges():
    # 2 ranks x 4 rows, 4 microbatches of 2 rows: rank 0 holds micros 0-1, rank 1 micros 2-3
    assert owns_its_micros([4, 4], 4, [[0, 1], [2, 3]])
    assert not owns_its_micros([4, 4], 4, [[0, 1, 2], [3]])  # rank 0 would need rank 1's rows
    # uneven rows: rank 0 has 2 rows, rank 1 has 6; micro 1 = rows 2-3 belongs to rank 1
    assert not owns_its_micros([2, 6], 4, [[0, 1], [2, 3]])
    assert owns_its_micros([2, 6], 4, [[0], [1, 2, 3]])
    # a microbatch straddling two ranks (3 micros over 2 x 3 rows: rows 2-3) belongs to neither
    assert not owns_its_micros([3, 3], 3, [[0, 1], [2]])


@pytest.mark.parametrize("rows", [[4, 4], [2, 6], [3, 3, 6]])
def test_local_micros_equal_the_split_of_the_global_batch(rows):
    world = len(rows)
    total = sum(rows)
    x = torch.arange(total * 3).reshape(total, 3)
    y = torch.arange(total)
    starts = [sum(rows[:r]) for r in range(world)]
    parts = 4 if total % 4 == 0 else 3
    reference = split_batch((x, y), parts, exact=False)
    for rank in range(world):
        local = (x[starts[rank]: starts[rank] + rows[rank]], y[starts[rank]: starts[rank] + rows[rank]])
        got = GlobalBatch(None, rows, local=local, rank=rank).micros(parts, exact=False)
        held = 0
        for b, micro in enumerate(got):
            if micro is None:
                continue
            held += 1
            assert torch.equal(micro[0], reference[b][0]) and torch.equal(micro[1], reference[b][1])
        assert held >= 1 or rows[rank] < total // parts


# --------------------------------------------------------------------------- distributed


def gather_check(ctx: WorkerContext, rows: list[int], parts: int, needed: list[list[int]]) -> dict:
    """Fast path and full gather agree on every microbatch a rank needs."""
    start = sum(rows[: ctx.rank])
    total = sum(rows)
    data = torch.arange(total * 2, dtype=torch.float32).reshape(total, 2)
    local = (data[start: start + rows[ctx.rank]],)
    counts, _ = rows_and_layouts(local, ctx.world_size)
    fast = gather_batch(local, counts, ctx.rank, parts, needed)
    full = gather_batch(local, counts, ctx.rank)
    want = full.micros(parts, exact=False)
    got = fast.micros(parts, exact=False)
    mismatched = [b for b in needed[ctx.rank] if got[b] is None or not torch.equal(got[b][0], want[b][0])]
    return {"counts": counts, "skipped": fast.value is None, "mismatched": mismatched}


def exchange_check(ctx: WorkerContext, steps: list[dict]) -> list[dict]:
    """Each step's result of the fast exchange equals the pickled all-gather's."""
    fast = LossLogExchange(ctx.world_size, ctx.rank, micro=4, device=torch.device("cpu"))
    out = []
    for step in steps:
        mine = step[str(ctx.rank)]
        losses = {int(b): v for b, v in mine["losses"].items()}
        records = [LogRecord(m, name, value, dict(options)) for m, name, value, options in mine["logs"]]
        got_losses, got_records = fast(losses, records)
        gathered = exchange((losses, records), ctx.world_size)
        want_losses = {b: v for part, _ in gathered for b, v in part.items()}
        want_records = [r for _, logs in gathered for r in logs]
        out.append({"losses_equal": got_losses == want_losses,
                    "records_equal": got_records == want_records,
                    "cached": fast.layout is not None,
                    "object_exchanges": fast.object_exchanges})
    return out


def test_gather_is_skipped_only_when_every_rank_owns_its_micros(worlds):
    world = worlds.get(2)
    results = world.run(gather_check, [4, 4], 4, [[0, 1], [2, 3]])
    assert all(r["skipped"] and not r["mismatched"] for r in results)
    assert results[0]["counts"] == [4, 4]
    # rank 1 needs micro 0 (rank 0's rows): every rank must take the gathering path together
    results = world.run(gather_check, [4, 4], 4, [[0, 1], [0, 2, 3]])
    assert all(not r["skipped"] and not r["mismatched"] for r in results)
    results = world.run(gather_check, [2, 6], 4, [[0], [1, 2, 3]])
    assert all(r["skipped"] and not r["mismatched"] for r in results)


def test_loss_log_exchange_equals_object_gather_across_layout_changes(worlds):
    world = worlds.get(2)

    def step(loss_scale: float, extra: bool, sync_dist: bool) -> dict:
        options = {"sync_dist": sync_dist}
        rank0 = {"losses": {"0": 1.5 * loss_scale, "1": 2.5 * loss_scale},
                 "logs": [(0, "train_loss", 1.5 * loss_scale, options),
                          (1, "train_loss", 2.5 * loss_scale, options)]}
        rank1 = {"losses": {"2": 3.25 * loss_scale, "3": 4.0 * loss_scale},
                 "logs": [(2, "train_loss", 3.25 * loss_scale, options),
                          (3, "train_loss", 4.0 * loss_scale, options)]}
        if extra:  # only rank 1 logs something new: only rank 1's layout changes
            rank1["logs"].append((3, "odd_batch", 7.0 * loss_scale, {}))
        return {"0": rank0, "1": rank1}

    steps = [step(1.0, False, False), step(0.5, False, False), step(0.25, True, False),
             step(0.125, True, False), step(2.0, False, False), step(3.0, False, True)]
    results = world.run(exchange_check, steps)
    for rank, per_step in enumerate(results):
        for i, r in enumerate(per_step):
            assert r["losses_equal"] and r["records_equal"], f"rank {rank} step {i}: {r}"
            assert r["cached"]
        # the pickled gather ran exactly on the steps whose layout changed on some rank: the
        # first, when rank 1 added a name, when it dropped it again, and when options changed
        assert [r["object_exchanges"] for r in per_step] == [1, 1, 2, 2, 3, 4]
