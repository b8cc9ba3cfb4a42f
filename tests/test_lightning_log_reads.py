"""``self.log`` in a pipelined training step costs no host read per microbatch.

A logged tensor stays a tensor until the step's one exchange (engine/logsync.py), where every
value of the step becomes a number in one transfer: on a GPU each ``.item()`` waits for the
device, and a step that logs k values on B microbatches would otherwise wait k x B times. The
check counts every host read (``item``, ``tolist``, ``cpu``, ``numpy``, ``float()``, ``int()``,
``bool()`` of a tensor: ``test_runtime_sync_free.SyncCounter``) inside the strategy's
``training_step`` (the whole schedule step: the batch's row exchange, the pipeline, the loss/log
exchange, the reduction and the replay to Lightning) on each rank of a W=2 fit that logs 5
values (4 of them tensors) on each of 4 microbatches. In a steady step (from the third on: the
first builds the pipeline, the second gathers the memory report once) there are two, whatever
is logged: the rows every rank loaded (read to cut the microbatches, before the step) and the
losses and logged values (after it); reading each logged tensor would add 16 on the last
stage's rank. With ``data_loading="per_replica"`` (every rank loads the global batch: one
replica) there is one, the issue's "at most one per step": the rows are read off the batch's
shapes, nothing is gathered before the step, and the batch's stamp rides with the losses. The
values logged are the single-device Trainer's, from a run in this test, for both loadings.
"""

from __future__ import annotations

import functools
import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dist_harness import WorkerContext
from lightning_models import LitGPT, as_worker, csv_metric, rank_loader, tokens, trainer
from models import seeded
from test_runtime_sync_free import SyncCounter

pytestmark = pytest.mark.distributed

STEPS, GLOBAL_BATCH = 4, 8
LOGGED = ["train_loss", "logit_max", "logit_mean", "token_loss_min", "rows"]
STEADY = 2  # steps before the steady state: the build, then the memory report's gather
ROW_READS = 1  # per step: the rows every rank loaded (engine/batches.rows_and_layouts)
WORLD_TIMEOUT = 300.0  # seconds per check: a whole Trainer fit


class LogsMany(LitGPT):
    """Logs five values per (micro)batch: tensors with each reduction, and a plain number."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (rows,) = batch
        logits = self(rows[:, :-1])
        per_token = F.cross_entropy(logits.reshape(-1, logits.size(-1)), rows[:, 1:].reshape(-1),
                                    reduction="none")
        loss = per_token.mean()
        self.log("train_loss", loss)
        self.log("logit_max", logits.max(), reduce_fx="max")
        self.log("logit_mean", logits.mean())
        self.log("token_loss_min", per_token.min(), reduce_fx="min")
        self.log("rows", float(rows.shape[0]), reduce_fx="sum")
        return loss


def _data() -> torch.Tensor:
    return tokens(GLOBAL_BATCH * STEPS)


def fit_counting_reads(ctx: WorkerContext, tmp: str, data_loading: str
                       ) -> list[dict[str, int]]:
    """Fit under GeneralParallel('1f1b'); the host reads of each training_step call, by kind."""
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    strategy = GeneralParallel("1f1b", microbatches=4, data_loading=data_loading)
    model = seeded(0, LogsMany)
    per_step: list[dict[str, int]] = []
    real_step = strategy.training_step

    def training_step(*args: Any, **kwargs: Any) -> Any:
        with SyncCounter() as reads:
            result = real_step(*args, **kwargs)
        per_step.append(dict(reads.calls))
        return result

    strategy.training_step = training_step  # type: ignore[method-assign]
    fit = trainer(ctx.world_size, strategy, tmp, max_steps=STEPS)
    whole = data_loading == "per_replica"  # every rank: each global batch whole
    fit.fit(model, rank_loader(_data(), GLOBAL_BATCH, 1 if whole else ctx.world_size,
                               0 if whole else ctx.rank))
    return per_step


def both_loadings(ctx: WorkerContext, tmp: str) -> dict[str, list[dict[str, int]]]:
    return {loading: fit_counting_reads(ctx, f"{tmp}/{loading}", loading)
            for loading in ("per_rank", "per_replica")}


@functools.lru_cache(maxsize=1)
def _reference() -> dict[str, list[tuple[int, float]]]:
    tmp = tempfile.mkdtemp()
    trainer(1, "auto", tmp, max_steps=STEPS).fit(seeded(0, LogsMany),
                                                 rank_loader(_data(), GLOBAL_BATCH, 1, 0))
    return {name: csv_metric(tmp, name) for name in LOGGED}


def test_logged_values_cost_one_host_read_per_step_and_equal_one_device(world, tmp_path) -> None:
    results = world.run(both_loadings, str(tmp_path))
    for loading, rows_read in (("per_rank", ROW_READS), ("per_replica", 0)):
        for rank, got in enumerate(results):
            per_step = got[loading]
            assert len(per_step) == STEPS, per_step
            # the rows, then the losses and logs: a read per value and microbatch would add 16
            for reads in per_step[STEADY:]:
                assert sum(reads.values()) <= rows_read + 1, f"{loading} rank {rank}: {per_step}"
        want = _reference()
        for name in LOGGED:
            got_log = csv_metric(str(tmp_path / loading), name)
            assert [s for s, _ in got_log] == [s for s, _ in want[name]], (loading, name)
            for (_, value), (_, expected) in zip(got_log, want[name], strict=True):
                assert value == pytest.approx(expected, rel=1e-5), (loading, name)
