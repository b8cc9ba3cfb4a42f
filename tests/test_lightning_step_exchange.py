"""The per-step fast paths of the strategy: rows moved point to point and the loss/log all-reduce.

Both replace a general collective (all-gather of the batch, pickled all-gather of losses and
logs) by something cheaper, so each is checked against what the general path gave: the rows a
rank holds are the single-device cut of the global batch (one replica) or its replica's cut, and
a rank receives exactly the rows of the microbatches it reads that it did not load.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_batch_bytes import ReceivedRows
from dist_harness import WorkerContext
from lightning_gsched.engine.batches import exchange_rows, local_outputs, rows_and_layouts
from lightning_gsched.engine.intercept import METRIC_OPTION, LogRecord
from lightning_gsched.engine.logsync import LossLogExchange, exchange, reduce_records
from lightning_gsched.engine.rows import check_rows, row_map, transfers
from lightning_gsched.engine.step_rows import needed_micros
from lightning_gsched.errors import BatchSplitError
from lightning_gsched.schedule.plan import plan


def _batches(rows: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A global batch whose row i holds i, and each rank's slice of it in rank order."""
    total = sum(rows)
    data = torch.arange(total * 3).reshape(total, 3)
    starts = [sum(rows[:r]) for r in range(len(rows))]
    return data, [data[s:s + n] for s, n in zip(starts, rows, strict=True)]


def _micro(pieces, locals_: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([locals_[p.source][p.start:p.stop] for p in pieces] or [locals_[0][:0]])


@pytest.mark.parametrize("rows", [[4, 4], [2, 6], [3, 3, 6], [0, 5, 3], [1, 1, 1, 1]])
@pytest.mark.parametrize("parts", [1, 3, 4])
def test_one_replica_is_the_global_batch_cut_as_before(rows, parts):
    """G = 1: microbatch b is rows of torch.tensor_split(global batch, B)[b], as before replicas."""
    data, locals_ = _batches(rows)
    cut = row_map(rows, [list(range(len(rows)))], parts)
    want = torch.tensor_split(data, parts)
    assert cut.micro_rows() == [len(w) for w in want]
    for b, pieces in enumerate(cut.micros):
        assert [p.offset for p in pieces] == [sum(q.rows for q in pieces[:i])
                                             for i in range(len(pieces))]
        assert torch.equal(_micro(pieces, locals_), want[b])


def test_replica_g_cuts_its_ranks_batches_in_position_order():
    """W=4 as P=2 x G=2 (rank p*G + g): replica 0 is ranks 0, 2 and replica 1 ranks 1, 3; replica
    g's m-th microbatch is the step's microbatch g + 2m."""
    rows = [3, 1, 2, 2]
    _, locals_ = _batches(rows)
    cut = row_map(rows, [[0, 2], [1, 3]], 4)
    replica0 = torch.cat([locals_[0], locals_[2]])  # 5 rows -> 3 + 2
    replica1 = torch.cat([locals_[1], locals_[3]])  # 3 rows -> 2 + 1
    want = {0: replica0[:3], 2: replica0[3:], 1: replica1[:2], 3: replica1[2:]}
    for b, rows_b in want.items():
        assert torch.equal(_micro(cut.micros[b], locals_), rows_b)
    assert cut.micro_rows() == [3, 2, 2, 1] and cut.replica_rows() == [5, 3]
    # where each rank's predictions come from: its rows in order, one piece per microbatch
    assert [(p.micro, p.offset, p.rows) for p in cut.loaded_by(3)] == [(1, 1, 1), (3, 0, 1)]


def test_transfers_carry_only_wanted_rows_from_their_loaders():
    cut = row_map([4, 4], [[0, 1]], 4)
    assert transfers(cut, [[0, 1], [2, 3]]) == []  # every rank reads only its own rows (ddp)
    (move,) = transfers(cut, [[0, 1], [0, 2, 3]])  # rank 1 reads microbatch 0 too
    assert (move.source, move.target, move.rows) == (0, 1, 2)
    assert [(p.micro, p.start, p.stop) for p in move.pieces] == [(0, 0, 2)]
    # 1f1b at W=4 as 2 x 2: every rank's needs come from its own replica only, and each rank
    # receives exactly the rows of the microbatches it reads that it did not load
    p = plan("1f1b", 4, data_parallel_size=2)
    needed = needed_micros(p.table.compute, 4)
    cut = row_map([2, 2, 2, 2], [p.replicas.members(g) for g in range(2)], p.micro)
    moves = transfers(cut, needed)
    assert moves and all(p.replicas.replica(t.source) == p.replicas.replica(t.target)
                         for t in moves)
    for rank in range(4):
        received = sorted((q.micro, q.source, q.start) for t in moves if t.target == rank
                          for q in t.pieces)
        read = sorted((q.micro, q.source, q.start) for b in needed[rank]
                      for q in cut.micros[b] if q.source != rank)
        assert received == read


@pytest.mark.parametrize("rows", [[3, 1, 2, 2], [2, 0, 2, 2]])
def test_outputs_go_back_to_the_rank_that_loaded_the_rows(rows):
    """Each microbatch's output rows (here 10 x its input rows) return to their loaders, in each
    loader's order; a rank that loaded nothing gets an empty output of the same structure."""
    _, locals_ = _batches(rows)
    cut = row_map(rows, [[0, 2], [1, 3]], 4)
    outputs = {b: {"y": _micro(pieces, locals_) * 10} for b, pieces in enumerate(cut.micros)}
    for rank in range(4):
        got = local_outputs(outputs, cut, rank, "predict_step")
        assert torch.equal(got["y"], locals_[rank] * 10)


def test_training_refuses_unequal_microbatches_and_says_why():
    check_rows(row_map([4, 4, 4, 4], [[0, 2], [1, 3]], 4), exact=True)
    with pytest.raises(BatchSplitError, match=r"replicas hold \[5, 3\] rows"):
        check_rows(row_map([3, 1, 2, 2], [[0, 2], [1, 3]], 4), exact=True)
    with pytest.raises(BatchSplitError, match="do not split into 4 equal microbatches"):
        check_rows(row_map([3, 4], [[0, 1]], 4), exact=True)  # one replica: as before
    # ranks handed batches of different sizes: named as the cause (the message gave only the
    # global batch's 7 rows), and not where they are equal
    with pytest.raises(BatchSplitError, match=r"the ranks' batches differ in size \(ranks' "
                       r"rows \[3, 4\], concatenated in order\)\. .* \(e\.g\. 4 rows each\)"):
        check_rows(row_map([3, 4], [[0, 1]], 4), exact=True)
    with pytest.raises(BatchSplitError) as equal:
        check_rows(row_map([3, 3], [[0, 1]], 4), exact=True)
    assert "differ" not in str(equal.value)
    check_rows(row_map([3, 1, 2, 2], [[0, 2], [1, 3]], 4), exact=False)  # evaluation: uneven


def test_a_per_replica_refusal_names_replicas_and_the_batch_size_they_load():
    """data_loading='per_replica': a row map's positions are replicas, each loaded whole by
    every one of its ranks, so the fix is the DataLoader's batch_size itself, not a share of
    it, and no ranks' shares are listed."""
    with pytest.raises(BatchSplitError) as refused:
        check_rows(row_map([4, 2], [[0], [1]], 4), exact=True, per_replica=True)
    message = str(refused.value)
    assert "replicas hold [4, 2] rows" in message and "data_loading='per_replica'" in message
    assert "batch_size 4 on every rank" in message and "ranks' rows" not in message
    with pytest.raises(BatchSplitError) as one_replica:  # G = 1: every rank loads the batch
        check_rows(row_map([4], [[0]], 6), exact=True, per_replica=True)
    assert "Make batch_size a multiple of microbatches=6" in str(one_replica.value)
    assert "devices" not in str(one_replica.value)


# --------------------------------------------------------------------------- distributed


def row_exchange_check(ctx: WorkerContext, rows: list[int], parts: int,
                       needed: list[list[int]]) -> dict:
    """Each rank's exchanged microbatches are the single-device cut; what it received."""
    data, locals_ = _batches(rows)
    local = (locals_[ctx.rank], "flag")  # a plain leaf rides along from the local batch
    counts, _, _ = rows_and_layouts(local, ctx.world_size)
    cut = row_map(counts, [list(range(ctx.world_size))], parts)
    with ReceivedRows() as seen:
        got = exchange_rows(local, cut, ctx.rank, needed)
    want = torch.tensor_split(data, parts)
    mismatched = [b for b in needed[ctx.rank]
                  if not torch.equal(got[b][0], want[b]) or got[b][1] != "flag"]
    return {"counts": counts, "received_rows": seen.rows(), "mismatched": mismatched,
            "held": sorted(got)}


def exchange_check(ctx: WorkerContext, steps: list[dict]) -> list[dict]:
    """Each step's result of the fast exchange (fed tensors) equals the pickled all-gather's
    (fed the same values as numbers)."""
    fast = LossLogExchange(ctx.world_size, ctx.rank, micro=4, device=torch.device("cpu"))
    out = []
    for step in steps:
        mine = step[str(ctx.rank)]
        losses = {int(b): v for b, v in mine["losses"].items()}
        records = [LogRecord(m, name, value, dict(options)) for m, name, value, options in mine["logs"]]
        # the step hands the fast path 0-dim tensors (read on the host once, by the exchange)
        as_tensors = [LogRecord(r.micro, r.name, torch.tensor(r.value), r.options)
                      for r in records]
        got_losses, got_records = fast({b: torch.tensor(v) for b, v in losses.items()},
                                       as_tensors)
        gathered = exchange((losses, records), ctx.world_size)
        want_losses = {b: v for part, _ in gathered for b, v in part.items()}
        want_records = [r for _, logs in gathered for r in logs]
        out.append({"losses_equal": got_losses == want_losses,
                    "records_equal": got_records == want_records,
                    "cached": fast.layout is not None,
                    "object_exchanges": fast.object_exchanges})
    return out


def test_a_dataclass_batch_is_refused_naming_the_dataclass_and_the_fix():
    """Lightning moves a dataclass batch; the split does not look into one (its tensors are
    one opaque leaf to torch's pytree): it said only "holds no tensor with a batch dimension"
    (found by probing)."""
    import dataclasses

    @dataclasses.dataclass
    class Batch:
        tokens: torch.Tensor

    with pytest.raises(BatchSplitError, match=r"Its Batch is a dataclass.*dataclasses\.asdict"):
        rows_and_layouts(Batch(torch.zeros(4, 3)), 1)


def test_ranks_receive_only_the_rows_they_read_that_they_did_not_load(worlds):
    world = worlds.get(2)
    results = world.run(row_exchange_check, [4, 4], 4, [[0, 1], [2, 3]])
    assert results[0]["counts"] == [4, 4]
    assert all(r["received_rows"] == 0 and not r["mismatched"] for r in results)
    # rank 1 reads microbatch 0 (rank 0's rows 0-1) too: only those two rows travel
    results = world.run(row_exchange_check, [4, 4], 4, [[0, 1], [0, 2, 3]])
    assert [r["received_rows"] for r in results] == [0, 2]
    assert all(not r["mismatched"] for r in results) and results[1]["held"] == [0, 2, 3]
    # uneven ranks: microbatch 1 (rows 2-3) was loaded by rank 1 and is read by rank 0
    results = world.run(row_exchange_check, [2, 6], 4, [[0, 1], [1, 2, 3]])
    assert [r["received_rows"] for r in results] == [2, 0]
    assert all(not r["mismatched"] for r in results)


def host_group_check(ctx: WorkerContext, rows: list[int]) -> dict:
    """A control group made as on a GPU job (the default backend not gloo): its host twin is
    a group of its own, the batch sizes travel over it as host tensors, and closing the control
    group destroys both."""
    from unittest import mock

    import torch.distributed as dist

    from lightning_gsched.engine import control

    with mock.patch.object(control, "default_is_gloo", lambda: False):
        group = control.ControlGroup(ctx.rank, timeout=30.0)
    twin = group.host_group
    batch = (torch.zeros(rows[ctx.rank], 3, device="meta"),)  # shapes only: nothing is read
    counts, _, _ = rows_and_layouts(batch, ctx.world_size, twin)
    made = twin is not group.group and dist.get_world_size(twin) == ctx.world_size
    group.close()
    try:  # torch's registry of groups no longer knows a destroyed one
        dist.get_process_group_ranks(twin)
        gone = False
    except Exception:  # noqa: BLE001 - torch's error for an unknown group
        gone = True
    return {"made": made, "counts": counts, "gone": gone, "closed": group.host_group is None}


def test_batch_sizes_travel_as_host_tensors_over_a_host_group(worlds):
    world = worlds.get(2)
    results = world.run(host_group_check, [3, 5])
    assert all(r["made"] and r["gone"] and r["closed"] for r in results), results
    assert all(r["counts"] == [3, 5] for r in results)


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


def test_one_rank_reads_losses_and_logged_tensors_as_numbers_in_one_read():
    """W=1: losses and records (tensors and numbers) come back as host numbers, the same
    values, read with one ``tolist`` (no ``item`` per value)."""
    from test_runtime_sync_free import SyncCounter

    fast = LossLogExchange(1, 0, micro=2, device=torch.device("cpu"))
    losses = {0: torch.tensor(1.5), 1: torch.tensor(2.25)}
    records = [LogRecord(0, "a", torch.tensor(0.5), {}), LogRecord(1, "a", 3.0, {}),
               LogRecord(1, "b", torch.tensor(-7.0, dtype=torch.bfloat16), {"reduce_fx": "max"})]
    with SyncCounter() as reads:
        got_losses, got_records = fast(losses, records)
    assert dict(reads.calls) == {"tolist": 1}
    assert got_losses == {0: 1.5, 1: 2.25}
    assert [(r.micro, r.name, r.value, r.options) for r in got_records] == [
        (0, "a", 0.5, {}), (1, "a", 3.0, {}), (1, "b", -7.0, {"reduce_fx": "max"})]
    assert all(type(r.value) is float for r in got_records)


def test_a_logged_metric_objects_step_value_is_its_forwards_row_weighted_mean() -> None:
    """``self.log(name, metric)`` records each microbatch's forward value (NaN where the step
    only called ``update``): the step's value is their row-weighted mean, NaN when there was
    none (replay then logs the Metric with no step value, as Lightning does)."""
    def record(micro: int, value: float) -> LogRecord:
        return LogRecord(micro, "acc", value, {METRIC_OPTION: "acc", "on_step": True})

    weights = [3, 1, 4]
    (reduced,) = reduce_records([record(0, 0.5), record(1, float("nan")), record(2, 1.0)],
                                weights)
    assert reduced[0] == "acc" and reduced[1] == pytest.approx((3 * 0.5 + 4 * 1.0) / 7)
    assert reduced[2][METRIC_OPTION] == "acc"
    (none,) = reduce_records([record(0, float("nan")), record(2, float("nan"))], weights)
    assert none[1] != none[1]  # NaN


def test_batch_size_none_is_lightnings_infer_it_not_a_number() -> None:
    """``self.log_dict(...)`` always passes ``batch_size=None`` (Lightning: infer it): summed
    over the microbatches it was a TypeError on every rank at the first step (found by
    probing). It reduces as if not given; a given one is still summed."""
    weights = [2, 2]
    records = [LogRecord(0, "val_loss", 1.0, {"batch_size": None}),
               LogRecord(1, "val_loss", 3.0, {"batch_size": None}),
               LogRecord(0, "n", 1.0, {"batch_size": 2, "reduce_fx": "sum"}),
               LogRecord(1, "n", 1.0, {"batch_size": 2, "reduce_fx": "sum"})]
    reduced = {name: (value, options) for name, value, options in
               reduce_records(records, weights)}
    assert reduced["val_loss"] == (2.0, {})
    assert reduced["n"] == (2.0, {"batch_size": 4, "reduce_fx": "sum"})
