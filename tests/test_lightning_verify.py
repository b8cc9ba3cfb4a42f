"""``GeneralParallel(verify=...)``: a split that computes something else stops setup on every
rank, naming the stage, instead of training a wrong model.

The split here is made wrong on purpose, the way plain torch.fx gets custom autograd Functions
wrong: with the partitioner's Function recording switched off in the worker, the
straight-through rounding in ``forward`` is inlined and its backward replaced by autograd of a
rounding (zero). Every rank partitions its own replica and verifies it, so every rank raises
the same ``SplitMismatchError``; with ``verify=False`` the same run trains without a word,
which is exactly what the check exists to prevent.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from dist_harness import RankError, WorkerContext
from lightning_models import LitGPT, as_worker, rank_loader, tokens, trainer
from models import StraightThrough, seeded

pytestmark = pytest.mark.distributed


class RoundedLogits(LitGPT):
    """LitGPT whose logits go through a straight-through rounding (a custom Function)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return StraightThrough.apply(self.model(idx))


def fit_with_fx_inlining(ctx: WorkerContext, verify: Any) -> int:
    import lightning_gsched.partition.tracer as tracer
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    recording = tracer.recording_autograd_functions
    tracer.recording_autograd_functions = contextlib.nullcontext  # plain fx's behaviour
    try:
        fit = trainer(ctx.world_size, GeneralParallel("1f1b", verify=verify), max_steps=1)
        fit.fit(seeded(0, RoundedLogits), rank_loader(tokens(8), 8, ctx.world_size, ctx.rank))
        return fit.global_step
    finally:
        tracer.recording_autograd_functions = recording



def test_a_wrong_split_stops_setup_on_every_rank(world) -> None:
    results = world.run(fit_with_fx_inlining, "auto", expect_errors=True)
    for result in results:
        assert isinstance(result, RankError), result
        assert result.type_name == "SplitMismatchError", (result.type_name, result.message)
        assert "does not compute what the model computes" in result.message
        assert "The first stage that differs is stage 0" in result.message
    # verify=False: the same wrong split trains a step without a word
    assert world.run(fit_with_fx_inlining, False) == [1, 1]
