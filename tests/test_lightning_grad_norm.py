"""``lightning_gsched.grad_norm`` in ``on_before_optimizer_step`` gives one device's norms.

Lightning's ``grad_norm(self, 2)`` reads ``p.grad`` on the calling rank, which under a pipeline
holds only the stages that rank owns. Ours must return, on every rank, the same keys as one
device (a frozen parameter has no gradient and no key) and the same per-parameter and total
norms, for a schedule whose ranks own different stages (1f1b), one whose stages are sharded
over the ranks (fsdp) and a looped one with a tied weight fetched by another rank (fslpp), of
the whole LightningModule and of a submodule (``self.model.blocks``).

Why rtol 1e-5 holds on any CPU: the gradients differ from one device's by float32 summation
order only (see ``lightning_models.assert_same_state``), and a norm is a sum of squares of
them, reordered again.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from dist_harness import WorkerContext
from lightning_models import LitGPT, as_worker, rank_loader, tokens, trainer
from models import seeded

pytestmark = pytest.mark.distributed

GLOBAL_BATCH = 8
SCHEDULES = ["1f1b", "fsdp", "fslpp"]
WORLD_TIMEOUT = 300.0


class NormLogging(LitGPT):
    """LitGPT recording the gradient norms its hook computes, with one frozen parameter and one
    that ``forward`` never reads (``spare``: on one device its ``.grad`` stays None, so it has
    no norm, and SGD's weight decay leaves it as it is)."""

    def __init__(self) -> None:
        super().__init__(layers=2, frozen=("model.blocks.0.ln1",))
        self.spare = torch.nn.Parameter(torch.ones(3))
        self.norms: list[dict[str, float]] = []

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=0.5)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        from lightning_gsched import grad_norm

        self.norms.append({k: float(v) for k, v in grad_norm(self, norm_type=2).items()})
        # a submodule's norms (Lightning's grad_norm takes any module)
        self.norms.append({k: float(v) for k, v in grad_norm(self.model.blocks, 2).items()})


def run(world: int, rank: int, strategy: Any) -> list[dict[str, float]]:
    model = seeded(0, NormLogging)
    trainer(world, strategy, max_steps=2).fit(
        model, rank_loader(tokens(GLOBAL_BATCH * 2), GLOBAL_BATCH, world, rank))
    state = model.trainer.optimizers[0].state
    return [*model.norms, {"spare_sum": float(model.spare.sum()),
                           "spare_optimizer_state": float(len(state.get(model.spare, {})))}]


def on_worker(ctx: WorkerContext) -> dict[str, list[dict[str, float]]]:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    return {s: run(ctx.world_size, ctx.rank, GeneralParallel(s)) for s in SCHEDULES}


@functools.lru_cache(maxsize=None)
def reference() -> list[dict[str, float]]:
    """One device, where ``lightning_gsched.grad_norm`` is Lightning's own."""
    return run(1, 0, "auto")


def test_grad_norm_counts_every_rank_s_gradients(worlds) -> None:
    want = reference()
    assert want and not any("ln1" in k and "blocks.0" in k for k in want[0])  # frozen: no key
    for rank, by_schedule in enumerate(worlds.get(2).run(on_worker)):
        for schedule, got in by_schedule.items():
            assert len(got) == len(want), (schedule, rank)
            for step, (mine, single) in enumerate(zip(got, want, strict=True)):
                assert mine.keys() == single.keys(), (schedule, rank, step)
                for key, value in single.items():
                    assert mine[key] == pytest.approx(value, rel=1e-5), (schedule, rank, key)


def test_outside_a_trainer_it_is_lightning_s_own() -> None:
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm

    from lightning_gsched import grad_norm

    module = torch.nn.Linear(3, 2)
    module(torch.ones(4, 3)).sum().backward()
    assert grad_norm(module, 2).keys() == lightning_grad_norm(module, 2).keys()
    model = seeded(0, NormLogging)  # a LightningModule not attached to a Trainer
    assert grad_norm(model, 2) == {}
    with pytest.raises(ValueError, match="norm_type"):
        grad_norm(pl.LightningModule(), 0)
