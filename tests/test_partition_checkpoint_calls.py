"""A forward calling torch.utils.checkpoint (non-reentrant) is split with a warning naming it.

Found by probing: the split traced through the checkpoint, so the activations the user meant to
recompute were kept, silently (and a BatchNorm inside was updated once per step, where one
device's recompute updates it twice). The split still computes what the model computes (the
recompute would give the same values): what is lost is the memory saving, so a warning names
the module and the ways to keep it. The reentrant form is one autograd Function call in the
graph (it runs as written in its stage): no warning.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from lightning_gsched.partition import partition
from lightning_gsched.partition.checkpoint_calls import CheckpointTracedWarning


class Block(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.utils.checkpoint.checkpoint(self.inner, x,
                                                     use_reentrant=self.reentrant)


class Net(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(reentrant) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_non_reentrant_checkpoint_is_named_in_a_warning() -> None:
    torch.manual_seed(0)
    with pytest.warns(CheckpointTracedWarning, match=r"module 'blocks\.0'.*module 'blocks\.1'"
                      r".*checkpoint_activations=True"):
        part = partition(Net(reentrant=False), 2, (torch.randn(4, 8),))
    assert part.verified  # same values: only the memory saving is lost


def test_a_reentrant_checkpoint_splits_without_a_warning() -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointTracedWarning)
        partition(Net(reentrant=True), 2, (torch.randn(4, 8),))

