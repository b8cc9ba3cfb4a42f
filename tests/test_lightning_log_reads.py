"""``self.log`` in a pipelined training step costs no host read per microbatch.

A logged tensor stays a tensor until the step's one exchange (engine/logsync.py), where every
value of the step becomes a number in one transfer: on a GPU each ``.item()`` waits for the
device, and a step that logs k values on B microbatches would otherwise wait k x B times. The
check counts every host read (``Tensor.item``, ``tolist``, ``float()``/``int()``/``bool()`` of
a tensor) inside the strategy's ``training_step`` (the whole schedule step: the batch's row
exchange, the pipeline, the loss/log exchange, the reduction and the replay to Lightning) on
each rank of a W=2 fit that logs 5 values on each of 4 microbatches. In a steady step (from the
third on: the first builds the pipeline, the second gathers the memory report once) there are
two, whatever is logged: the rows every rank loaded (read to cut the microbatches, before the
step) and the losses and logged values (after it); reading each logged value would add 20 on the
last stage's rank. The values logged are the single-device Trainer's, from a run in this test.
"""

from __future__ import annotations

import functools
import tempfile
import traceback
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from dist_harness import WorkerContext
from lightning_models import LitGPT, as_worker, csv_metric, rank_loader, tokens, trainer
from models import seeded

pytestmark = pytest.mark.distributed

STEPS, GLOBAL_BATCH = 4, 8
LOGGED = ["train_loss", "logit_max", "logit_mean", "token_loss_min", "rows"]
STEADY = 2  # steps before the steady state: the build, then the memory report's gather
ROW_READS = 1  # per step: the rows every rank loaded (engine/batches.rows_and_layouts)
READS = ("item", "tolist", "__float__", "__int__", "__bool__")
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


class HostReads:
    """Counts the host reads of tensors while active (patches ``torch.Tensor``'s methods)."""

    def __init__(self) -> None:
        self.count = 0
        self.active = False
        self.where: list[str] = []  # the caller of each read (for the failure message)
        self.saved = {name: getattr(torch.Tensor, name) for name in READS}
        for name, real in self.saved.items():
            setattr(torch.Tensor, name, self._counting(real))

    def _counting(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.active:
                self.count += 1
                caller = traceback.extract_stack(limit=3)[0]
                self.where.append(f"{caller.filename}:{caller.lineno} {caller.name}")
            return real(tensor, *args, **kwargs)

        return read

    def close(self) -> None:
        for name, real in self.saved.items():
            setattr(torch.Tensor, name, real)


def _data() -> torch.Tensor:
    return tokens(GLOBAL_BATCH * STEPS)


def fit_counting_reads(ctx: WorkerContext, tmp: str) -> tuple[list[int], list[str]]:
    """Fit under GeneralParallel('1f1b'); the host reads of each training_step call, and
    where those of the steady steps came from."""
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    strategy = GeneralParallel("1f1b", microbatches=4)
    model = seeded(0, LogsMany)
    per_step: list[int] = []
    reads = HostReads()
    real_step = strategy.training_step

    def training_step(*args: Any, **kwargs: Any) -> Any:
        reads.count, reads.active = 0, True
        try:
            return real_step(*args, **kwargs)
        finally:
            reads.active = False
            per_step.append(reads.count)
            if len(per_step) <= STEADY:
                reads.where.clear()

    strategy.training_step = training_step  # type: ignore[method-assign]
    try:
        fit = trainer(ctx.world_size, strategy, tmp, max_steps=STEPS)
        fit.fit(model, rank_loader(_data(), GLOBAL_BATCH, ctx.world_size, ctx.rank))
    finally:
        reads.close()
    return per_step, reads.where


@functools.lru_cache(maxsize=1)
def _reference() -> dict[str, list[tuple[int, float]]]:
    tmp = tempfile.mkdtemp()
    trainer(1, "auto", tmp, max_steps=STEPS).fit(seeded(0, LogsMany),
                                                 rank_loader(_data(), GLOBAL_BATCH, 1, 0))
    return {name: csv_metric(tmp, name) for name in LOGGED}


def test_logged_values_cost_one_host_read_per_step_and_equal_one_device(world, tmp_path) -> None:
    per_rank = world.run(fit_counting_reads, str(tmp_path))
    for rank, (per_step, where) in enumerate(per_rank):
        assert len(per_step) == STEPS, per_step
        # the rows, then the losses and logs: a read per value and microbatch would add 20
        assert all(n <= ROW_READS + 1 for n in per_step[STEADY:]), (
            f"rank {rank}: host reads per step {per_step}, from:\n" + "\n".join(where))
    want = _reference()
    for name in LOGGED:
        got = csv_metric(str(tmp_path), name)
        assert [s for s, _ in got] == [s for s, _ in want[name]], name
        for (_, value), (_, expected) in zip(got, want[name], strict=True):
            assert value == pytest.approx(expected, rel=1e-5), name
