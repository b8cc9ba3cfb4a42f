"""A plain Lightning Fabric training loop, pipelined by GeneralParallelFabric.

The model, data and loop are what a Fabric user writes (an MLP classifier, Adam, clipping,
``fabric.save``); the pipeline changes two lines: the strategy, and ``strategy.step`` instead of
``loss = loss_fn(model, batch); fabric.backward(loss)``. Runs on CPU with 2 processes (Fabric's
launcher re-runs this script once per rank):

    python examples/fabric_loop.py                       # 1F1B pipeline over 2 processes
    python examples/fabric_loop.py --schedule fslpp --devices 4
    python examples/fabric_loop.py --resume out/fabric.ckpt --schedule gpipe   # continue a run
    python examples/fabric_loop.py --sharded --out out/fabric_dir   # every rank writes its part

Each run prints the loss of every 20th step and the validation accuracy, and writes
``out/fabric.ckpt`` (the full model and optimizer state: it loads under any schedule, any number
of processes, or ``Fabric(devices=1)``); with ``--sharded`` a torch.distributed.checkpoint
directory instead, each rank writing the stages it owns (it loads under any schedule and number
of processes of this strategy: ``--resume out/fabric_dir``).
"""

from __future__ import annotations

import argparse
from itertools import pairwise
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gsched.fabric import GeneralParallelFabric


class Classifier(nn.Module):
    """A 5-layer MLP over feature vectors (any fx-traceable forward works)."""

    def __init__(self, in_dim: int = 32, hidden: int = 128, n_classes: int = 10) -> None:
        super().__init__()
        sizes = [in_dim] + [hidden] * 4
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in pairwise(sizes))
        self.head = nn.Linear(hidden, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def dataset(rows: int, seed: int) -> TensorDataset:
    """Points labelled by which of 10 random directions they are closest to."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 32, generator=g)
    centres = torch.randn(10, 32, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, (x @ centres.T).argmax(-1))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Calls the model once and returns the loss of the (micro)batch."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def predictions(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Per-row values for ``strategy.evaluate``: the predicted class of each row."""
    x, _ = batch
    return model(x).argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--resume", default=None, help="a checkpoint written by this script")
    parser.add_argument("--out", default="out/fabric.ckpt")
    parser.add_argument("--sharded", action="store_true",
                        help="save a directory every rank writes its part of")
    args = parser.parse_args()

    state_dict_type = "sharded" if args.sharded else "full"
    fabric = Fabric(accelerator="cpu", devices=args.devices,
                    strategy=GeneralParallelFabric(args.schedule,
                                                   state_dict_type=state_dict_type))
    fabric.launch()
    fabric.seed_everything(0)

    model = Classifier()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    train = fabric.setup_dataloaders(
        DataLoader(dataset(4096, seed=1), batch_size=args.batch_size, shuffle=True,
                   drop_last=True))
    val = fabric.setup_dataloaders(DataLoader(dataset(512, seed=2), batch_size=64))
    step = 0
    if args.resume:
        step = fabric.load(args.resume, {"model": model, "optimizer": optimizer})["step"]
        fabric.print(f"resumed from {args.resume} at step {step}")

    while step < args.steps:
        for batch in train:
            optimizer.zero_grad()
            loss = fabric.strategy.step(model, batch, loss_fn)  # forward + backward, pipelined
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            step += 1
            if step % 20 == 0:
                fabric.print(f"step {step:4d}  loss {loss.item():.4f}")
            if step == args.steps:
                break

    model.eval()
    correct = total = 0
    for batch in val:
        predicted = fabric.strategy.evaluate(model, batch, predictions)  # this rank's rows
        correct += int((predicted == batch[1]).sum())
        total += len(batch[1])
    counts = fabric.all_reduce(torch.tensor([correct, total]), reduce_op="sum")
    fabric.print(f"validation accuracy {int(counts[0]) / int(counts[1]):.3f} "
                 f"({args.schedule}, {fabric.world_size} processes)")

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fabric.save(args.out, {"model": model, "optimizer": optimizer, "step": step})
    fabric.strategy.finish()  # every rank holds the full trained model again
    fabric.print(f"saved {args.out}")


if __name__ == "__main__":
    main()
