"""Data per replica: at W=4 as P=2 x G=2 (``GeneralParallel("1f1b", data_parallel_size=2)``)
every rank receives exactly the rows its program reads that it did not load, from its own
replica only, and the run is one device's.

One launched world, several checks (the suite's time budget): on the same 4 processes

* ``trainer.predict`` (the first batch builds the pipeline from an evaluation batch; the last
  batch is short, so microbatches are uneven) returns on each rank the single-device
  predictions of the rows that rank loaded, and ``trainer.validate`` the single-device loss;
* ``trainer.fit`` (3 SGD steps, clipping) ends with the single-device weights and logs the
  single-device losses, and during every step each rank received, through the row exchange
  (recorded from outside the engine: benchmarks.bench_batch_bytes.ReceivedRows), exactly the
  rows of the microbatches it reads (first-stage inputs, last-stage targets) that it did not
  load, each from the rank that loaded it, in its replica (at the first step also the rows of
  microbatch 0, which the build probes on every rank); no rank receives the global batch;
* no ``all_gather_into_tensor`` deprecation warning (torch 2.13) is raised.
"""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from benchmarks.bench_batch_bytes import ReceivedRows
from dist_harness import WorkerContext
from lightning_models import (
    as_worker,
    assert_same_state,
    csv_metric,
    make_lit_gpt,
    rank_loader,
    state_of,
    tokens,
    trainer,
)

pytestmark = pytest.mark.distributed

WORLD, G = 4, 2
STEPS, GLOBAL_BATCH, CLIP = 3, 8, 0.5
WORLD_TIMEOUT = 300.0  # seconds per check: whole Trainer runs (conftest.worlds)
STRATEGY = {"schedule": "1f1b", "data_parallel_size": G}


def _train_data() -> torch.Tensor:
    return tokens(GLOBAL_BATCH * 2 * STEPS)


def _eval_data() -> torch.Tensor:
    """Two full global batches and a short one of one row per rank."""
    return tokens(2 * GLOBAL_BATCH + WORLD, seed=11)


def _eval_loaders(world: int, rank: int) -> list:
    data = _eval_data()
    return [rank_loader(data[: 2 * GLOBAL_BATCH], GLOBAL_BATCH, world, rank),
            rank_loader(data[2 * GLOBAL_BATCH:], world, world, rank)]


class StepRows(pl.Callback):
    """Per training step: the rows this rank received, with their source rank, and the
    microbatches its program reads (engine.step_rows.needed_micros off the running plan)."""

    def __init__(self, seen: ReceivedRows) -> None:
        self.seen, self.mark, self.steps = seen, 0, []

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self.mark = len(self.seen.received)

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        from lightning_gsched.engine.step_rows import needed_micros

        plan = trainer.strategy.engine.train_plan
        got = [(source, row) for source, t in self.seen.received[self.mark:]
               for row in t.tolist()]
        self.steps.append({"received": got, "micro": plan.micro,
                           "needed": needed_micros(plan.table.compute, WORLD)})


def data_parallel_on_worker(ctx: WorkerContext, tmp: str) -> dict:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    world, rank = ctx.world_size, ctx.rank
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = make_lit_gpt()
        run = trainer(world, GeneralParallel(**STRATEGY))
        out["predict"] = run.predict(model, _eval_loaders(world, rank))
        run = trainer(world, GeneralParallel(**STRATEGY))
        out["val"] = run.validate(model, _eval_loaders(world, rank), verbose=False)
        model = make_lit_gpt(optimizer="sgd")
        with ReceivedRows() as seen:
            steps = StepRows(seen)
            fit = trainer(world, GeneralParallel(**STRATEGY), tmp, max_steps=STEPS,
                          gradient_clip_val=CLIP, callbacks=[steps])
            fit.fit(model, rank_loader(_train_data(), GLOBAL_BATCH, world, rank))
    out["state"], out["steps"] = state_of(model), steps.steps
    out["warnings"] = [str(w.message) for w in caught if "all_gather_into_tensor" in str(w.message)]
    return out


def _reference() -> dict:
    """One device: the same predictions, validation and fit."""
    model = make_lit_gpt()
    data = _eval_data()
    with torch.no_grad():
        rows = model(data[:, :-1])[:, -1]
    val = trainer(1, "auto").validate(model, _eval_loaders(1, 0), verbose=False)
    tmp = tempfile.mkdtemp()
    model = make_lit_gpt(optimizer="sgd")
    trainer(1, "auto", tmp, max_steps=STEPS, gradient_clip_val=CLIP).fit(
        model, rank_loader(_train_data(), GLOBAL_BATCH, 1, 0))
    return {"rows": rows, "val": val, "state": state_of(model),
            "loss": csv_metric(tmp, "train_loss")}


def _rows_read(step: int, rank: int, needed: list[int], micro: int) -> list[tuple[int, list]]:
    """(loading rank, row) of every row ``rank`` reads and did not load at ``step``, from the
    semantics alone: rank p*G + g loads rows [2r, 2r+2) of the global batch; replica g's batch
    is ranks g, g+G in that order, cut into micro / G microbatches; its m-th is g + G*m."""
    batch = _train_data()[step * GLOBAL_BATCH:][:GLOBAL_BATCH]
    per_rank = GLOBAL_BATCH // WORLD
    out = []
    for b in needed:
        g, m = b % G, b // G
        members = [p * G + g for p in range(WORLD // G)]
        replica = [(r, row) for r in members
                   for row in batch[r * per_rank:(r + 1) * per_rank].tolist()]
        size = len(replica) // (micro // G)
        out += [(r, row) for r, row in replica[m * size:(m + 1) * size] if r != rank]
    return out


def test_data_parallel_rows_travel_to_readers_only_and_training_is_one_device(worlds, tmp_path):
    want = _reference()
    results = worlds.get(WORLD).run(data_parallel_on_worker, str(tmp_path))
    per_rank = GLOBAL_BATCH // WORLD
    for rank, got in enumerate(results):
        assert got["warnings"] == [], rank
        # predictions: this rank's rows, every batch (the short last one included)
        expected = [want["rows"][i * GLOBAL_BATCH + rank * per_rank:][:per_rank]
                    for i in range(2)] + [want["rows"][2 * GLOBAL_BATCH + rank:][:1]]
        batches = [b for loader in got["predict"] for b in loader]
        assert len(batches) == len(expected)
        for batch, rows in zip(batches, expected, strict=True):
            torch.testing.assert_close(batch, rows, rtol=1e-5, atol=1e-6)
        for mine, single in zip(got["val"], want["val"], strict=True):
            assert mine.keys() == single.keys()
            for key in single:
                assert mine[key] == pytest.approx(single[key], rel=1e-5), (rank, key)
        # training: one device's weights
        assert_same_state(got["state"], want["state"], f"1f1b 2 x 2 rank {rank}")
        # every step: exactly the rows read and not loaded, each from its loader (its replica)
        assert len(got["steps"]) == STEPS
        for step, seen in enumerate(got["steps"]):
            needed = seen["needed"][rank]
            if step == 0:  # the build probes microbatch 0 on every rank (once per run)
                needed = sorted({0, *needed})
            read = _rows_read(step, rank, needed, seen["micro"])
            received = [(source, row) for source, row in seen["received"]]
            assert sorted(received) == sorted(read), f"rank {rank} step {step}"
            if step > 0:
                assert all(source % G == rank % G for source, _ in received)
            assert len(received) < GLOBAL_BATCH - per_rank  # never the rest of the global batch
    got_log = csv_metric(str(tmp_path), "train_loss")
    assert [s for s, _ in got_log] == [s for s, _ in want["loss"]]
    for (_, got), (_, expected) in zip(got_log, want["loss"], strict=True):
        assert got == pytest.approx(expected, rel=1e-5)


def other_layout_on_worker(ctx: WorkerContext) -> None:
    """W=2, 1f1b (each rank its share): rank 1's second batch holds its tokens as int32, rank
    0's as int64; rank 0 (the first stage) reads rank 1's rows."""
    from torch.utils.data import DataLoader

    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    rows = tokens(16)[ctx.rank * 8:(ctx.rank + 1) * 8]
    second = rows[4:].to(torch.int32) if ctx.rank == 1 else rows[4:]
    loader = DataLoader([(rows[:4],), (second,)], batch_size=None)
    fit = trainer(ctx.world_size, GeneralParallel("1f1b", microbatches=2), max_steps=2)
    fit.fit(make_lit_gpt(optimizer="sgd"), loader)


def test_a_batch_of_another_layout_fails_every_rank_naming_both_before_rows_move(worlds):
    """A receiver sizes its buffers from its own batch: another layout used to abort its
    process inside gloo (no rank, no cause) while the sender reported no failure. Both ranks
    refuse it now, before any row moves, naming both ranks."""
    errors = worlds.get(2).run(other_layout_on_worker, expect_errors=True, timeout=120)
    for rank, error in enumerate(errors):
        assert getattr(error, "type_name", None) == "BatchSplitError", (rank, error)
        # the first move whose ends differ: rank 0's targets to the last stage's rank 1
        assert ("ranks 0 and 1 loaded batches of different layouts, and rank 1 reads rows "
                "of rank 0's") in error.message, (rank, error.message)
