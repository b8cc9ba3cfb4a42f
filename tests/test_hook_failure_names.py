"""The hook a failure is reported from (``lightning/hook_failure.failed_hook``), one process.

Each rank's failure notice names the hook that raised (the peers quote it). A callback's
``on_save_checkpoint`` runs inside Lightning's loop over the callbacks' checkpoint hooks, which
keeps no hook name: it was reported as the hook that started the save
(``ModelCheckpoint.on_train_batch_end``; found by probing).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_gsched.lightning.hook_failure import failed_hook
from lightning_models import make_lit_gpt, rank_loader, tokens, trainer


class FailsToSave(pl.Callback):
    def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict) -> None:
        raise ValueError("cannot save my state")


class FailsAtBatchEnd(pl.Callback):
    def on_train_batch_end(self, *args: Any) -> None:
        raise ValueError("boom")


@pytest.mark.parametrize("callback, hook", [
    (FailsToSave(), "FailsToSave.on_save_checkpoint"),
    (FailsAtBatchEnd(), "FailsAtBatchEnd.on_train_batch_end"),
])
def test_the_failing_callback_hook_is_named(tmp_path, callback: pl.Callback, hook: str) -> None:
    saving = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1)
    fit = trainer(1, "auto", max_steps=2, callbacks=[saving, callback],
                  enable_checkpointing=True)
    with pytest.raises(ValueError) as caught:
        fit.fit(make_lit_gpt(), rank_loader(tokens(16), 8, 1, 0))
    assert failed_hook(caught.value) == hook
