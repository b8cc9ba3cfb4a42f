"""LightningModules, data and Trainer plumbing shared by the GeneralParallel tests.

Why a module of its own: the tests run Trainers both in the pytest process (the single-device
reference) and inside :mod:`dist_harness` workers (GeneralParallel), and both sides must build
the same module, the same global batches and the same Trainer options.

Sampling is fixed on purpose: Lightning's DistributedSampler deals rows round-robin, so rank r's
batch i here is rows ``[i*G + r*G/W, i*G + (r+1)*G/W)`` of the dataset and the concatenation
over ranks is exactly the single-device batch i of size G.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset

from models import TinyGPT, seeded

VOCAB = 64
LENGTH = 9  # tokens per row: 8 inputs + 1 shifted target
ADAM_EPS = 1e-2  # see LitGPT.configure_optimizers


class LitGPT(pl.LightningModule):
    """A small GPT with tied weights, an optimizer choice, an LR schedule and logging."""

    def __init__(self, optimizer: str = "sgd", lr: float = 0.05, layers: int = 3,
                 tie: str = "functional", log_extra: bool = False,
                 shardable: bool = False, frozen: tuple[str, ...] = (),
                 metrics: bool = False, compile_backend: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyGPT(vocab=VOCAB, dim=32, heads=4, layers=layers, block_size=16, tie=tie,
                             shardable=shardable)
        if compile_backend is not None:  # each block compiled, as torchtitan does
            for i, block in enumerate(self.model.blocks):
                self.model.blocks[i] = torch.compile(block, backend=compile_backend)
        if metrics:  # torchmetrics state updated in the steps, computed at each epoch's end
            from torchmetrics import MeanMetric

            self.train_mean, self.val_mean = MeanMetric(), MeanMetric()
            # logged as objects (Lightning's idiom): each forward's value per step, computed
            # over the epoch by Lightning
            self.train_seen, self.val_seen = MeanMetric(), MeanMetric()
            self.epoch_means: list[tuple[str, float]] = []
        # fine-tuning: parameters whose names start with one of ``frozen`` get no gradient
        # (they are still handed to the optimizer, as many users do)
        for name, param in self.named_parameters():
            if name.startswith(frozen):  # (no prefix: startswith(()) is False)
                param.requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: Any) -> torch.Tensor:
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        if self.hparams.get("metrics"):  # weighted by rows: a microbatch's share of the batch
            self.train_mean.update(loss.detach(), weight=len(batch[0]))
            self.train_seen(loss.detach(), weight=len(batch[0]))
            self.log("train_seen", self.train_seen, on_step=True, on_epoch=True)
            # kept in float64 by Lightning (a third is not a float32 number)
            self.log("train_third", loss.detach().double() / 3)
        if self.hparams.log_extra:
            self.log("tokens", float(batch[0].numel()), reduce_fx="sum")
        return loss

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        loss = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        if self.hparams.log_extra:  # a count: summed over the batch and the dataloader's epoch
            self.log("val_rows", float(len(batch[0])), reduce_fx="sum", sync_dist=True)
        if self.hparams.get("metrics"):
            self.val_mean.update(loss, weight=len(batch[0]))
            self.val_seen(loss, weight=len(batch[0]))
            self.log("val_seen", self.val_seen)

    def on_validation_epoch_end(self) -> None:
        if self.hparams.get("metrics"):  # compute() gathers every rank's state (a collective)
            self.epoch_means.append(("val", float(self.val_mean.compute())))
            self.val_mean.reset()

    def on_train_epoch_end(self) -> None:
        if self.hparams.get("metrics"):
            mean = self.train_mean.compute()
            self.log("epoch_train_mean", mean)  # outside the steps: Lightning's own logging
            self.epoch_means.append(("train", float(mean)))
            self.train_mean.reset()

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        (tokens,) = batch
        return self(tokens[:, :-1])[:, -1]

    def configure_optimizers(self) -> Any:
        if self.hparams.optimizer == "adam":
            # eps = 1e-2 bounds how much Adam can amplify summation-order noise. A schedule sums
            # each gradient over microbatches and ranks in another order than one device, so an
            # element's gradient differs by float32 reordering noise delta_i (up to 2.4e-7 for
            # this model, whose gradients reach ~1). Adam's step lr * m / (sqrt(v) + eps) then
            # moves by at most about 2 * lr * delta_i / (|g_i| / sqrt(t) + eps) at step t: with
            # eps = 1e-2 that stays near 1e-8 per step, far inside the comparisons' atol of 1e-6
            # on any CPU (test_adam_premise_* measures the bound on the running CPU).
            # With the default eps = 1e-8 no such bound exists: an element whose gradient is
            # near zero (wte[36, 30] here has -2e-9 while its row has 1e-3) takes a full lr
            # step whose sign and size are noise (measured: 1.3e-5 apart after 3 steps).
            opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr / 10, eps=ADAM_EPS)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def make_lit_gpt(**kwargs: Any) -> LitGPT:
    return seeded(0, lambda: LitGPT(**kwargs))


def tokens(rows: int, seed: int = 3) -> torch.Tensor:
    return seeded(seed, lambda: torch.randint(0, VOCAB, (rows, LENGTH)))


def rank_loader(data: torch.Tensor | tuple[torch.Tensor, ...], global_batch: int, world: int,
                rank: int) -> DataLoader:
    """This rank's share of every global batch (see the module docstring). ``data`` is one
    tensor, or a tuple of tensors with the same rows (e.g. inputs and targets)."""
    tensors = data if isinstance(data, tuple) else (data,)
    per_rank = global_batch // world
    batches = len(tensors[0]) // global_batch
    index = [i * global_batch + rank * per_rank + j
             for i in range(batches) for j in range(per_rank)]
    return DataLoader(Subset(TensorDataset(*tensors), index), batch_size=per_rank,
                      shuffle=False)


def trainer(world: int, strategy: Any, tmp: str | None = None, **kwargs: Any) -> pl.Trainer:
    """A quiet CPU Trainer; inside a dist_harness worker the process group already exists."""
    options: dict[str, Any] = dict(
        accelerator="cpu", devices=world, strategy=strategy, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, use_distributed_sampler=False, log_every_n_steps=1,
    )
    if tmp is not None:
        options["logger"] = pl.loggers.CSVLogger(tmp, name="log", version=0)
    options.update(kwargs)
    return pl.Trainer(**options)


def as_worker(rank: int) -> None:
    """Make Lightning treat this dist_harness worker as an externally launched rank."""
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")


def state_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same_state(got: dict, want: dict, label: str, rtol: float = 1e-5,
                      atol: float = 1e-6) -> None:
    """Same keys, and every tensor close to the reference's (message names the key).

    Why rtol 1e-5 / atol 1e-6 holds on any CPU: a schedule computes the same float32 gradient
    with its sums in another order (microbatches, ranks, vector kernels), which moves each
    element by reordering noise of at most a few ulps of the gradient's summands (measured up to
    2.4e-7 for gradients of ~1). SGD with momentum is linear in the gradient, so 3 steps at
    lr 0.05 move a weight by under 1e-7 from that noise; Adam bounds it through eps (see
    ``LitGPT.configure_optimizers``). A wrong, stale or missing gradient moves weights by ~1e-3.
    """
    assert got.keys() == want.keys(), label
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{label}: {name}: {m}")


def csv_metric(tmp: str, name: str) -> list[tuple[int, float]]:
    """(step, value) rows of one column of a CSVLogger's metrics.csv."""
    import csv

    path = os.path.join(tmp, "log", "version_0", "metrics.csv")
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    return [(int(r["step"]), float(r[name])) for r in rows if r.get(name) not in (None, "")]


class RankSlices(pl.LightningDataModule):
    """``rank_loader`` as a DataModule: picks its rank's share once the Trainer knows the rank
    (for launchers that start the ranks themselves, e.g. spawn)."""

    def __init__(self, data: torch.Tensor, global_batch: int) -> None:
        super().__init__()
        self.data, self.global_batch = data, global_batch

    def train_dataloader(self) -> DataLoader:
        return rank_loader(self.data, self.global_batch, self.trainer.world_size,
                           self.trainer.global_rank)
