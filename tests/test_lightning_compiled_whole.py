"""A LightningModule passed to ``trainer.fit`` compiled whole is refused, naming the fix.

Found by probing: ``trainer.fit(torch.compile(model))`` makes Lightning run the module's forward
and steps as compiled graphs (``lightning.pytorch.utilities.compile.from_compiled``), which
torch.fx cannot enter; the split then failed with a ``TraceFailedError`` whose advice (a leaf
module, split points) does not apply. One process, the Trainer on one rank.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Small(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return ((self(x) - y) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_module_compiled_whole_is_refused_naming_the_blocks_fix(one_rank_job: None,
                                                                  tmp_path) -> None:
    from lightning_gsched import GeneralParallel
    from lightning_gsched.errors import StrategyConfigError

    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False,
                         strategy=GeneralParallel("1f1b", stages=2, microbatches=2),
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    compiled = torch.compile(Small(), backend="eager")
    with pytest.raises(StrategyConfigError) as refused:
        trainer.fit(compiled, DataLoader(data, batch_size=4))
    assert "Small was passed compiled whole (trainer.fit(torch.compile(model))" in str(refused.value)
    assert "self.blocks[i] = torch.compile(block)" in str(refused.value)
