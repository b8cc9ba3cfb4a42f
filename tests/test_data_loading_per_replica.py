"""``data_loading="per_replica"``: at W=4 as P=2 x G=2 (``GeneralParallel("1f1b",
data_parallel_size=2, data_loading="per_replica")``) every rank of a replica loads the
replica's whole batch through Lightning's own distributed sampler, a training step after the
first moves no rows and asks no rank for its batch size, and the run is one device's.

One launched world, several checks (the suite's time budget): on the same 4 processes (the
last check: 2)

* the strategy's ``distributed_sampler_kwargs`` deal G = 2 shares, rank ``p * G + g`` getting
  replica g's (the Trainer builds the DistributedSampler from them: ``use_distributed_sampler``
  is on);
* ``trainer.predict`` returns on each rank one device's predictions of its replica's rows
  (every row of the replica: each of its ranks loaded them all), the short last batch included,
  and ``trainer.validate`` one device's loss;
* ``trainer.fit`` (3 SGD steps, clipping; the Trainer's sampler shuffles) deals the ranks of a
  replica the same rows and the two replicas disjoint halves of the data, and ends with one
  device's weights on the same global batches (replica 0's batch then replica 1's, as their
  samplers dealt them) and logs one device's losses; recorded from
  outside the engine, no rank received a row after the first step (the build's probe sends
  microbatch 0 to the other replica at the first) and the batch-size all-gather ran at the
  first step only;
* ``"auto"`` with ``data_parallel_size=2`` (the replicas known before its pick) reaches the
  same weights;
* a replica whose two ranks load the same rows at the first step and other values at the
  second fails on every rank with a StrategyConfigError naming the replica, its ranks and the
  fix, raised by the check that rides in the step's loss exchange;
* a replica whose batch is short at the second step (it does not split into its microbatches)
  fails its ranks with a BatchSplitError naming the replica's rows, and the other replica's
  ranks, already inside the step, end with a RuntimeFault quoting it: no rank hangs;
* at W=2 as two replicas of one rank each (P = 1), replicas whose batches split but hold
  unequal rows fail every rank with a BatchSplitError naming them (the step's stamps); and
  where one replica's loader has a batch more, the rank whose epoch ended waits in the end of
  fit's gather and stops there quoting the other's error.

Tolerance: ``assert_same_state``'s, for its stated reason (a replica's rows in another order
within the global batch reorder float32 sums, as microbatches and ranks already do).
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.bench_batch_bytes import ReceivedRows
from dist_harness import WorkerContext
from lightning_models import (
    VOCAB,
    as_worker,
    assert_same_state,
    csv_metric,
    make_lit_gpt,
    state_of,
    tokens,
    trainer,
)

pytestmark = pytest.mark.distributed

WORLD, G = 4, 2
STEPS, REPLICA_BATCH, CLIP = 3, 4, 0.5
STRATEGY = {"schedule": "1f1b", "data_parallel_size": G, "microbatches": 2,
            "data_loading": "per_replica"}


def _train_data() -> torch.Tensor:
    return tokens(G * REPLICA_BATCH * STEPS)


def _eval_data() -> torch.Tensor:
    """Two full batches per replica and a short one of one row per replica."""
    return tokens(G * (2 * REPLICA_BATCH + 1), seed=11)


def _loader(data: torch.Tensor) -> DataLoader:
    """A plain loader: the Trainer gives it the strategy's distributed sampler."""
    return DataLoader(TensorDataset(data), batch_size=REPLICA_BATCH, shuffle=False)


def _replica_rows(data: torch.Tensor, g: int) -> torch.Tensor:
    """Replica g's rows in its loading order: DistributedSampler(num_replicas=G, rank=g,
    shuffle=False) takes every G-th row from row g."""
    return data[g::G]


def _global_batches(data: torch.Tensor, dealt: list[list[int]]) -> torch.Tensor:
    """One device's data: each step's global batch is replica 0's batch, then replica 1's
    (``dealt[g]``: the rows replica g's sampler dealt, in order)."""
    per = [data[index].split(REPLICA_BATCH) for index in dealt]
    return torch.cat([torch.cat(step) for step in zip(*per, strict=True)])


class CountGathers:
    """Calls of the batch-size all-gather (``engine.batches``' single-tensor all-gather) per
    training step, patched from outside the engine."""

    def __init__(self) -> None:
        from lightning_gsched.engine import batches

        self.module, self.saved, self.calls = batches, batches._all_gather_single, 0

    def __enter__(self) -> CountGathers:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self.saved(*args, **kwargs)

        self.module._all_gather_single = counted
        return self

    def __exit__(self, *exc: object) -> None:
        self.module._all_gather_single = self.saved


class PerStep:
    """Per training step: the rows received (ReceivedRows) and the gathers counted; the rows
    the Trainer's sampler dealt this rank in the epoch."""

    def __init__(self, seen: ReceivedRows, gathers: CountGathers) -> None:
        import lightning.pytorch as pl

        outer = self

        class Recorder(pl.Callback):
            def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
                outer.mark = (len(seen.received), gathers.calls)
                if outer.dealt is None:  # Lightning's DistributedSampler, its epoch set
                    outer.dealt = list(trainer.train_dataloader.sampler)

            def on_train_batch_end(self, *args: Any) -> None:
                rows, calls = outer.mark
                outer.steps.append((len(seen.received) - rows, gathers.calls - calls))

        self.callback, self.mark, self.steps = Recorder(), (0, 0), []
        self.dealt: list[int] | None = None


def per_replica_on_worker(ctx: WorkerContext, tmp: str) -> dict:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    world = ctx.world_size
    out: dict[str, Any] = {}
    sampled = {"use_distributed_sampler": True}
    strategy = GeneralParallel(**STRATEGY)
    run = trainer(world, strategy, **sampled)
    out["predict"] = run.predict(make_lit_gpt(), _loader(_eval_data()))
    out["sampler"] = strategy.distributed_sampler_kwargs
    run = trainer(world, GeneralParallel(**STRATEGY), **sampled)
    out["val"] = run.validate(make_lit_gpt(), _loader(_eval_data()), verbose=False)
    model = make_lit_gpt(optimizer="sgd")
    with ReceivedRows() as seen, CountGathers() as gathers:
        steps = PerStep(seen, gathers)
        fit = trainer(world, GeneralParallel(**STRATEGY), tmp, max_steps=STEPS,
                      gradient_clip_val=CLIP, callbacks=[steps.callback], **sampled)
        fit.fit(model, _loader(_train_data()))
    out["state"], out["steps"], out["dealt"] = state_of(model), steps.steps, steps.dealt
    # "auto" with G fixed: the sampler's shares are known before the tuner's pick
    model = make_lit_gpt(optimizer="sgd")
    fit = trainer(world, GeneralParallel("auto", data_parallel_size=G, microbatches=2,
                                         data_loading="per_replica"),
                  max_steps=STEPS, gradient_clip_val=CLIP, **sampled)
    fit.fit(model, _loader(_train_data()))
    out["auto"] = state_of(model)
    return out


def _reference(dealt: list[list[int]]) -> dict:
    """One device: the same predictions, validation and fit on the global batches."""
    model = make_lit_gpt()
    data = _eval_data()
    with torch.no_grad():
        predicted = model(data[:, :-1])[:, -1]
    val = trainer(1, "auto").validate(model, _loader(data), verbose=False)
    tmp = tempfile.mkdtemp()
    model = make_lit_gpt(optimizer="sgd")
    trainer(1, "auto", tmp, max_steps=STEPS, gradient_clip_val=CLIP).fit(
        model, DataLoader(TensorDataset(_global_batches(_train_data(), dealt)),
                          batch_size=G * REPLICA_BATCH, shuffle=False))
    return {"predicted": predicted, "val": val, "state": state_of(model),
            "loss": csv_metric(tmp, "train_loss")}


def test_replicas_load_whole_batches_move_no_rows_and_train_like_one_device(worlds, tmp_path):
    results = worlds.get(WORLD).run(per_replica_on_worker, str(tmp_path))
    dealt = [results[g]["dealt"] for g in range(G)]  # ranks 0 and 1: replicas 0 and 1
    for rank, got in enumerate(results):
        assert got["dealt"] == dealt[rank % G], rank
    assert sorted(dealt[0] + dealt[1]) == list(range(len(_train_data())))
    want = _reference(dealt)
    for rank, got in enumerate(results):
        g = rank % G  # rank p * G + g
        assert got["sampler"] == {"num_replicas": G, "rank": g}, rank
        # predictions: every row of this rank's replica, batch by batch (the short one too)
        expected = _replica_rows(want["predicted"], g).split(REPLICA_BATCH)
        batches = [b for b in got["predict"]]
        assert len(batches) == len(expected) == 3, rank
        for batch, rows in zip(batches, expected, strict=True):
            torch.testing.assert_close(batch, rows, rtol=1e-5, atol=1e-6)
        for mine, single in zip(got["val"], want["val"], strict=True):
            assert mine.keys() == single.keys()
            for key in single:
                assert mine[key] == pytest.approx(single[key], rel=1e-5), (rank, key)
        assert_same_state(got["state"], want["state"], f"per-replica 2 x 2 rank {rank}")
        assert_same_state(got["auto"], want["state"], f"per-replica 'auto' rank {rank}")
        # (rows received, batch-size gathers) per step: both at the first step only
        received, gathers = zip(*got["steps"], strict=True)
        assert len(received) == STEPS and gathers[0] >= 1, (rank, got["steps"])
        assert all(n == 0 for n in received[1:]) and all(n == 0 for n in gathers[1:]), \
            (rank, got["steps"])
    got_log = csv_metric(str(tmp_path), "train_loss")
    assert [s for s, _ in got_log] == [s for s, _ in want["loss"]]
    for (_, got), (_, expected) in zip(got_log, want["loss"], strict=True):
        assert got == pytest.approx(expected, rel=1e-5)


def diverging_on_worker(ctx: WorkerContext) -> None:
    """Rank 3 (replica 1's second rank) loads its replica's first batch, then other values."""
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    g = ctx.rank % G
    rows = _replica_rows(_train_data(), g)[:2 * REPLICA_BATCH].clone()
    if ctx.rank == 3:
        rows[REPLICA_BATCH:] = (rows[REPLICA_BATCH:] + 1) % VOCAB  # same shape, other tokens
    fit = trainer(ctx.world_size, GeneralParallel(**STRATEGY), max_steps=2)
    fit.fit(make_lit_gpt(optimizer="sgd"), _loader(rows))


def test_a_replica_whose_ranks_load_other_rows_fails_every_rank_after_the_step(worlds):
    errors = worlds.get(WORLD).run(diverging_on_worker, expect_errors=True)
    for rank, error in enumerate(errors):
        assert getattr(error, "type_name", None) == "StrategyConfigError", (rank, error)
        message = error.message
        assert "ranks [1, 3] of data-parallel replica 1" in message, (rank, message)
        assert "as many rows, other values" in message and "num_replicas = G" in message, \
            (rank, message)


def short_replica_on_worker(ctx: WorkerContext) -> None:
    """Replica 1's ranks load a batch of 3 rows at the second step (2 microbatches per replica:
    it does not split); replica 0's load full batches."""
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    g = ctx.rank % G
    rows = _replica_rows(_train_data(), g)[:2 * REPLICA_BATCH]
    if g == 1:
        rows = rows[:REPLICA_BATCH + 3]
    fit = trainer(ctx.world_size, GeneralParallel(**STRATEGY), max_steps=2)
    fit.fit(make_lit_gpt(optimizer="sgd"), _loader(rows))


def test_a_short_replica_batch_ends_every_rank_with_its_cause(worlds):
    """A trusted step (after the first) cuts the replica's microbatches alone, before any
    collective: the short replica's ranks fail with the BatchSplitError naming the rows, and
    the other replica's ranks, already in the step, end with an error quoting it, none
    hanging (the world's timeout is the bound)."""
    errors = worlds.get(WORLD).run(short_replica_on_worker, expect_errors=True, timeout=120)
    cause = "data-parallel replica 1's batch has 3 rows"
    for rank, error in enumerate(errors):
        message = getattr(error, "message", str(error))
        assert cause in message and "2 microbatches" in message, (rank, message)
        kind = "BatchSplitError" if rank % G == 1 else "RuntimeFault"
        assert getattr(error, "type_name", None) == kind, (rank, error)
        if kind == "RuntimeFault":  # its own place in the program, and the job's first failure
            assert message.startswith(f"rank {rank} stopped at "), (rank, message)


def unequal_replicas_on_worker(ctx: WorkerContext) -> None:
    """W=2 as two replicas of one rank each (P = 1, plain data parallelism): replica 1 loads 2
    rows at the second step where replica 0 loads 4. Both split into the replica's 2
    microbatches, so no rank's own check can tell; only the step's stamps can."""
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    rows = _replica_rows(_train_data(), ctx.rank)[:2 * REPLICA_BATCH]
    if ctx.rank == 1:
        rows = rows[:REPLICA_BATCH + 2]
    fit = trainer(ctx.world_size, GeneralParallel(**STRATEGY), max_steps=2)
    fit.fit(make_lit_gpt(optimizer="sgd"), _loader(rows))


def test_replicas_of_one_rank_with_unequal_rows_fail_every_rank(worlds):
    """Without the stamps (once sent only where a replica's ranks share a batch) this trained
    on, each replica's microbatch weighted alike whatever its rows: not one device's step."""
    errors = worlds.get(2).run(unequal_replicas_on_worker, expect_errors=True, timeout=120)
    for rank, error in enumerate(errors):
        assert getattr(error, "type_name", None) == "BatchSplitError", (rank, error)
        message = error.message
        assert "the replicas hold [4, 2] rows" in message, (rank, message)
        assert "data_loading='per_replica'" in message, (rank, message)


def extra_batch_on_worker(ctx: WorkerContext) -> None:
    """W=2 as two replicas of one rank: replica 0's loader has a third batch (1 row, which
    does not split), replica 1's epoch ends after two."""
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    rows = _replica_rows(_train_data(), ctx.rank)[:2 * REPLICA_BATCH + (ctx.rank == 0)]
    fit = trainer(ctx.world_size, GeneralParallel(**STRATEGY), max_epochs=1)
    fit.fit(make_lit_gpt(optimizer="sgd"), _loader(rows))


def test_a_rank_that_ends_its_epoch_early_learns_why_its_peer_failed(worlds):
    """The end of fit's gather of the full model runs as the engine's collective: the rank
    that finished its epoch and waits there ends with the other rank's BatchSplitError, not
    only with a lost connection."""
    errors = worlds.get(2).run(extra_batch_on_worker, expect_errors=True, timeout=120)
    cause = "data-parallel replica 0's batch has 1 rows"
    assert getattr(errors[0], "type_name", None) == "BatchSplitError", errors[0]
    assert cause in errors[0].message, errors[0].message
    assert getattr(errors[1], "type_name", None) == "RuntimeFault", errors[1]
    message = errors[1].message
    assert message.startswith("rank 1 stopped in the gather of the full model at the end"), \
        message
    assert "First failure reported in the job: rank 0 failed in training_step" in message, \
        message
    assert cause in message, message
