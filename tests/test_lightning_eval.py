"""validate / test / predict under GeneralParallel: forward-only schedules, single-device results.

``trainer.validate`` and ``trainer.test`` must report the metrics one device reports on the same
global batches (the last batch is short on purpose: its microbatches are uneven, and so are
the ranks' shares of it, rank 0 loading one row more: each rank logs the global batch's value,
weighted in the epoch mean by the global batch's rows, not its own; a value logged with
``reduce_fx="sum"`` and ``sync_dist=True`` is summed once, not once per rank), and
``trainer.predict`` must return, on each rank, the single-device predictions of the rows that
rank loaded. Validation inside ``fit`` (with EarlyStopping on the reduced ``val_loss``) must not
disturb training.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from dist_harness import WorkerContext
from lightning_models import as_worker, make_lit_gpt, rank_loader, state_of, tokens, trainer

pytestmark = pytest.mark.distributed

SCHEDULES = ["ddp", "fsdp", "gpipe", "1f1b", "lpp", "interleaved", "fslpp", "fslpp-seed"]
GLOBAL_BATCH = 8

WORLD_TIMEOUT = 300.0  # seconds per check: whole Trainer fits (conftest.worlds)


def eval_data(world: int) -> torch.Tensor:
    """Two full global batches and a short one of ``world + 1`` rows (two on rank 0, one on
    each other rank)."""
    return tokens(2 * GLOBAL_BATCH + world + 1, seed=11)


def tail_rows(world: int, rank: int) -> slice:
    """The rows of the short batch that ``rank`` loads (of ``world`` ranks)."""
    return slice(0, 2) if rank == 0 else slice(rank + 1, rank + 2)


def loaders(data: torch.Tensor, world: int, rank: int) -> Any:
    full = rank_loader(data[: 2 * GLOBAL_BATCH], GLOBAL_BATCH, world, rank)
    tail = data[2 * GLOBAL_BATCH:]
    if world > 1:
        tail = tail[tail_rows(world, rank)]
    return [full, DataLoader(TensorDataset(tail), batch_size=len(tail))]


def evaluate_on_worker(ctx: WorkerContext, options: dict) -> dict:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    world, rank = ctx.world_size, ctx.rank
    model = make_lit_gpt(log_extra=True)
    data = eval_data(world)
    run = trainer(world, GeneralParallel(**options))
    val = run.validate(model, loaders(data, world, rank), verbose=False)
    run = trainer(world, GeneralParallel(**options))
    test = run.test(model, loaders(data, world, rank), verbose=False)
    run = trainer(world, GeneralParallel(**options))
    predictions = run.predict(model, loaders(data, world, rank))
    return {"val": val, "test": test, "predict": predictions, "state": state_of(model)}


@functools.lru_cache(maxsize=None)
def reference(world: int) -> dict:
    model = make_lit_gpt(log_extra=True)
    data = eval_data(world)
    val = trainer(1, "auto").validate(model, loaders(data, 1, 0), verbose=False)
    test = trainer(1, "auto").test(model, loaders(data, 1, 0), verbose=False)
    with torch.no_grad():
        rows = model(data[:, :-1])[:, -1]
    return {"val": val, "test": test, "rows": rows, "state": state_of(model)}


def _rank_rows(reference_rows: torch.Tensor, world: int, rank: int) -> list[torch.Tensor]:
    """Reference predictions per batch of this rank's loaders (same order as trainer.predict)."""
    per_rank = GLOBAL_BATCH // world
    full = [reference_rows[i * GLOBAL_BATCH + rank * per_rank:][:per_rank] for i in range(2)]
    return full + [reference_rows[2 * GLOBAL_BATCH:][tail_rows(world, rank)]]


# schedule innermost: the W=2 cases, then the W=4 ones (worker processes started twice)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("world_size", [2, 4])
def test_eval_matches_single_device(worlds, world_size: int, schedule: str) -> None:
    if world_size == 4 and schedule not in ("fsdp", "1f1b", "interleaved", "fslpp"):
        pytest.skip("W=4 covers one schedule per family (W=2 covers all)")
    want = reference(world_size)
    results = worlds.get(world_size).run(evaluate_on_worker, {"schedule": schedule})
    for rank, got in enumerate(results):
        for kind in ("val", "test"):
            assert len(got[kind]) == len(want[kind]) == 2  # two dataloaders
            for mine, single in zip(got[kind], want[kind], strict=True):
                assert mine.keys() == single.keys()
                for key in single:
                    assert mine[key] == pytest.approx(single[key], rel=1e-5), (kind, key)
        expected = _rank_rows(want["rows"], world_size, rank)
        batches = [b for loader in got["predict"] for b in loader]
        assert len(batches) == len(expected)
        for batch, rows in zip(batches, expected, strict=True):
            torch.testing.assert_close(batch, rows, rtol=1e-5, atol=1e-6)
        for name, value in want["state"].items():  # evaluation leaves the weights alone
            torch.testing.assert_close(got["state"][name], value)


def fit_with_validation_on_worker(ctx: WorkerContext, options: Any, tmp: str) -> dict:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    return fit_with_validation(ctx.world_size, ctx.rank, GeneralParallel(**options), tmp)


def fit_with_validation(world: int, rank: int, strategy: Any, tmp: str) -> dict:
    model = make_lit_gpt(optimizer="sgd")
    data = tokens(GLOBAL_BATCH * 4)
    val = eval_data(world)[: 2 * GLOBAL_BATCH]
    stopper = pl.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0)
    run = trainer(world, strategy, tmp, max_epochs=3, val_check_interval=2,
                  num_sanity_val_steps=1, callbacks=[stopper])
    run.fit(model, rank_loader(data, GLOBAL_BATCH, world, rank),
            rank_loader(val, GLOBAL_BATCH, world, rank))
    return {"state": state_of(model), "epoch": run.current_epoch, "step": run.global_step,
            "val_loss": float(run.callback_metrics["val_loss"])}


def test_validation_inside_fit_and_early_stopping(worlds, tmp_path) -> None:
    want = fit_with_validation(1, 0, "auto", str(tmp_path / "single"))
    results = worlds.get(2).run(fit_with_validation_on_worker, {"schedule": "fslpp"},
                                str(tmp_path / "ours"))
    for got in results:
        assert (got["epoch"], got["step"]) == (want["epoch"], want["step"])
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)
        for name, value in want["state"].items():
            torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-6)
