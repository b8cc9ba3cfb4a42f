"""GeneralParallel as a drop-in replacement: a plain Lightning classifier, two strategies.

The model and data below are what a typical Lightning user writes (an MLP classifier in an
``nn.Sequential``, ``self(x)`` in ``training_step``, Adam); nothing in them knows about pipelines.
Only the ``strategy=`` argument of the ``Trainer`` changes between runs:

    python examples/drop_in.py --strategy ddp            # Lightning's DDP
    python examples/drop_in.py --strategy gsched_fslpp   # GeneralParallel("fslpp"), R=2 on 4 devices
    python examples/drop_in.py --strategy gsched_1f1b --microbatches 8

Each run prints its final validation loss; with the same seed the runs should agree closely
(the schedules compute the same gradients as DDP, up to floating-point summation order).
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import Strategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SCHEDULES = ["ddp", "fsdp", "gpipe", "1f1b", "lpp", "interleaved", "fslpp", "fslpp-seed"]


class Classifier(pl.LightningModule):
    """A 5-layer MLP over feature vectors."""

    def __init__(self, in_dim: int = 32, hidden: int = 256, n_classes: int = 10, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, n_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def synthetic_data(n: int, in_dim: int = 32, n_classes: int = 10, seed: int = 0) -> TensorDataset:
    """Inputs with labels from a fixed random 'teacher' network: non-linear, learnable, offline.

    The teacher uses its own generator with a fixed seed, so every rank and every run sees the
    same task; ``seed`` only chooses the input sample (train and validation differ).
    """
    teacher = torch.Generator().manual_seed(1234)
    w1 = torch.randn(in_dim, 64, generator=teacher) / in_dim**0.5
    w2 = torch.randn(64, n_classes, generator=teacher) / 8
    x = torch.randn(n, in_dim, generator=torch.Generator().manual_seed(seed))
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=-1)
    return TensorDataset(x, y)


def make_strategy(name: str, R: int | None, microbatches: int | None) -> str | Strategy:
    """Lightning's own strategy names pass through; ``gsched_<schedule>`` builds GeneralParallel."""
    if not name.startswith("gsched_"):
        return name
    from lightning_gsched import GeneralParallel

    options = {key: value for key, value in (("R", R), ("microbatches", microbatches)) if value is not None}
    return GeneralParallel(name.removeprefix("gsched_"), **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="gsched_fslpp",
                        help="a Lightning strategy (ddp, auto, ...) or gsched_<schedule>, schedule one of "
                             + ", ".join(SCHEDULES))
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--R", type=int, default=None, help="workers per looped group (lpp, fslpp, ...)")
    parser.add_argument("--microbatches", type=int, default=None, help="default: the schedule's")
    parser.add_argument("--batch-size", type=int, default=32, help="per device, as in DDP")
    parser.add_argument("--max-epochs", type=int, default=3)
    args = parser.parse_args()

    pl.seed_everything(0)  # same initial weights on every rank and for every strategy
    model = Classifier()
    train = DataLoader(synthetic_data(8192, seed=0), batch_size=args.batch_size, shuffle=True, drop_last=True)
    val = DataLoader(synthetic_data(1024, seed=1), batch_size=args.batch_size, drop_last=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=make_strategy(args.strategy, args.R, args.microbatches),  # the only line that differs
        max_epochs=args.max_epochs,
        default_root_dir=f"out/drop_in/{args.strategy}",
        log_every_n_steps=10,
    )
    trainer.fit(model, train, val)
    if trainer.is_global_zero:
        metrics = trainer.callback_metrics
        print(f"{args.strategy}: final val_loss {metrics['val_loss'].item():.4f}  "
              f"val_acc {metrics['val_acc'].item():.3f}")


if __name__ == "__main__":
    main()
