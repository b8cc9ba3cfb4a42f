"""What a step returns reaches the batch-end hooks of the rank that loaded the rows.

A user's callback reads ``outputs`` in ``on_train_batch_end``, ``on_validation_batch_end`` and
``on_test_batch_end``. Under GeneralParallel the step finishes per microbatch on the last
stage's rank; each rank's hooks must still get what one device returns for the rows that rank
loaded (engine/step_outputs.py): per-row tensors exactly those rows, a float mean the global
batch's (as the loss), a value that differs between microbatches without rows ``None``. The
microbatches here (3 of 4 rows from a global batch of 12, 6 per rank) put both ranks' rows in
the middle one, so a row handed to the wrong rank, or in the wrong order, shows.

Why rtol 1e-5 / atol 1e-6 holds on any CPU: the per-row values are the model's outputs after
the same steps, which differ from one device's only by float32 summation order (see
``lightning_models.assert_same_state``); the float means are weighted means of microbatch means,
exact up to the same reordering.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from dist_harness import WorkerContext
from lightning_models import LitGPT, as_worker, rank_loader, tokens, trainer
from models import seeded

pytestmark = pytest.mark.distributed

GLOBAL_BATCH = 12
# microbatches per schedule: the loss on one rank, on both (a V), each rank its own rows (fsdp:
# B a multiple of W)
SCHEDULES = {"1f1b": 3, "zbv": 3, "fsdp": 2}
WORLD_TIMEOUT = 300.0


class Returning(LitGPT):
    """LitGPT whose steps return more than the loss, as callbacks that read outputs expect."""

    def _step(self, batch: Any) -> dict[str, Any]:
        (toks,) = batch
        logits = self(toks[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), toks[:, 1:].reshape(-1))
        last = logits[:, -1]
        hits = (last.argmax(-1) == toks[:, -1]).float().mean()
        return {"loss": loss, "last": last, "hits": hits, "kind": "lm",
                "first_token": int(toks[0, 0]),
                "tags": [f"t{int(v)}" for v in toks[:, 0]]}  # a plain value per row

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        return self._step(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        out = self._step(batch)
        return {"val_last": out["last"], "val_loss": out["loss"]}

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch)["loss"]


class Recorder(pl.Callback):
    """A user's callback: keeps every batch-end hook's ``outputs``."""

    def __init__(self) -> None:
        self.seen: dict[str, list[Any]] = {"train": [], "val": [], "test": []}

    def _keep(self, kind: str, outputs: Any) -> None:
        self.seen[kind].append(_plain(outputs))

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._keep("train", outputs)

    def on_validation_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._keep("val", outputs)

    def on_test_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        self._keep("test", outputs)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    return value


def run(world: int, rank: int, strategy: Callable[[], Any]) -> dict[str, list[Any]]:
    model = seeded(0, lambda: Returning(layers=2))
    data = tokens(GLOBAL_BATCH * 2)
    recorder = Recorder()
    # a user's function given to one of Lightning's callbacks reads outputs too
    lambdas = pl.callbacks.LambdaCallback(
        on_validation_batch_end=lambda *args, **kwargs: recorder.seen.setdefault(
            "lambda", []).append(_plain(args[2])))
    fit = trainer(world, strategy(), max_steps=2, callbacks=[lambdas, recorder])
    fit.fit(model, rank_loader(data, GLOBAL_BATCH, world, rank),
            rank_loader(data, GLOBAL_BATCH, world, rank))
    trainer(world, strategy(), callbacks=[recorder]).test(
        model, rank_loader(data, GLOBAL_BATCH, world, rank), verbose=False)
    return recorder.seen


def on_worker(ctx: WorkerContext) -> dict[str, dict[str, list[Any]]]:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    return {s: run(ctx.world_size, ctx.rank,
                   functools.partial(GeneralParallel, s, microbatches=micro))
            for s, micro in SCHEDULES.items()}


@functools.lru_cache(maxsize=None)
def reference() -> dict[str, list[Any]]:
    return run(1, 0, lambda: "auto")


def test_hooks_get_the_step_outputs_of_their_rows(worlds) -> None:
    want = reference()
    per_rank = GLOBAL_BATCH // 2
    results = worlds.get(2).run(on_worker)
    for rank, by_schedule in enumerate(results):
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        for schedule, got in by_schedule.items():
            label = f"{schedule} rank {rank}"
            assert [len(got[k]) for k in ("train", "val", "test")] == [2, 2, 2], label
            for mine, single in zip(got["train"], want["train"], strict=True):
                assert set(mine) == set(single), label
                torch.testing.assert_close(mine["last"], single["last"][rows],
                                           rtol=1e-5, atol=1e-6)
                for key in ("loss", "hits"):
                    torch.testing.assert_close(mine[key], single[key], rtol=1e-5, atol=1e-6)
                assert mine["kind"] == "lm", label
                assert mine["first_token"] is None, label  # differs between microbatches
                assert mine["tags"] == single["tags"][rows], label
            assert len(got["lambda"]) == len(got["val"]) == 2, label
            for theirs, mine in zip(got["lambda"], got["val"], strict=True):
                assert theirs.keys() == mine.keys(), label
                assert all(torch.equal(theirs[k], mine[k]) for k in mine), label
            for mine, single in zip(got["val"], want["val"], strict=True):
                torch.testing.assert_close(mine["val_last"], single["val_last"][rows],
                                           rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(mine["val_loss"], single["val_loss"],
                                           rtol=1e-5, atol=1e-6)
            for mine, single in zip(got["test"], want["test"], strict=True):
                torch.testing.assert_close(mine, single, rtol=1e-5, atol=1e-6)
