"""When the strategy may drop last step's gradients before the schedule (zero_grad_ahead.py).

Dropping is right only when Lightning's loop will zero them before the hand-over and no user
code can look at them in between; every other case must keep them (an accumulation window
adds to them). The trained weights under accumulation are checked against one device by
test_lightning_equivalence.py; here each rule of the predicate is checked on its own, with
the attributes of Lightning's loop the predicate reads.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_gsched.lightning.zero_grad_ahead import loop_zeroes_grads


class Plain(pl.LightningModule):
    pass


class OwnZeroGrad(pl.LightningModule):
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        pass  # e.g. accumulating by hand


class WatchesGrads(pl.LightningModule):
    def on_before_zero_grad(self, optimizer: Any) -> None:
        pass


class GradCallback(pl.Callback):
    def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        pass


def trainer(batch_idx: int = 0, accumulate: int = 1, skip_backward: bool = False,
            callbacks: list[Any] | None = None) -> Any:
    epoch_loop = SimpleNamespace(batch_idx=batch_idx)
    fit_loop = SimpleNamespace(epoch_loop=epoch_loop, _skip_backward=skip_backward)
    return SimpleNamespace(fit_loop=fit_loop, accumulate_grad_batches=accumulate,
                           callbacks=callbacks or [pl.Callback()])


def test_dropped_when_the_loop_zeroes_them_and_nobody_looks() -> None:
    assert loop_zeroes_grads(trainer(batch_idx=5), Plain())


@pytest.mark.parametrize("batch_idx,expected", [(0, True), (1, False), (2, False), (3, True)])
def test_only_the_first_batch_of_an_accumulation_window(batch_idx: int, expected: bool) -> None:
    assert loop_zeroes_grads(trainer(batch_idx=batch_idx, accumulate=3), Plain()) is expected


def test_kept_under_manual_optimization() -> None:
    module = Plain()
    module.automatic_optimization = False
    assert not loop_zeroes_grads(trainer(), module)


def test_kept_when_backward_is_skipped() -> None:
    assert not loop_zeroes_grads(trainer(skip_backward=True), Plain())


@pytest.mark.parametrize("module", [OwnZeroGrad(), WatchesGrads()], ids=["own_zero_grad", "watches_grads"])
def test_kept_when_user_code_may_see_or_keep_them(module: pl.LightningModule) -> None:
    assert not loop_zeroes_grads(trainer(), module)


def test_kept_when_a_callback_watches_zero_grad() -> None:
    assert not loop_zeroes_grads(trainer(callbacks=[pl.Callback(), GradCallback()]), Plain())
