"""bf16-mixed under the Fabric strategy with float inputs: the build runs under the precision.

Found by probing: Fabric casts a model's float inputs to bfloat16 before the call (bf16-mixed)
and runs the forward under autocast; the strategy captured the cast inputs but built the
pipeline (the probe, the trace's example run, the memory prediction) outside autocast, so a
float32 layer refused the bfloat16 input ("mat1 and mat2 must have the same dtype") on every
rank at the first step, as an ExampleInputError about the example. Models fed token ids (the
tests' GPT) never showed it. One process (the pipeline's two stages on one rank), against a
plain loop under the same autocast over the same two microbatches.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn


def test_bf16_mixed_with_float_inputs_trains_like_a_plain_autocast_loop(one_rank_job: None) -> None:
    from lightning.fabric import Fabric

    from lightning_gsched.fabric import GeneralParallelFabric

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                        nn.Linear(32, 4))
    ref = copy.deepcopy(net)
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(2)]

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float(), y)

    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed",
                    strategy=GeneralParallelFabric("1f1b", stages=2, microbatches=2))
    fabric.launch()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        losses.append(float(fabric.strategy.step(model, batch, loss_fn)))
        optimizer.step()

    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for x, y in batches:  # the step's microbatches, each loss over 2 (their mean)
        ref_optimizer.zero_grad()
        total = 0.0
        for rows in (slice(0, 4), slice(4, 8)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(ref, (x[rows].to(torch.bfloat16), y[rows])) / 2
            loss.backward()
            total += float(loss.detach())
        ref_losses.append(total)
        ref_optimizer.step()
    # the same bf16 operations on the same microbatches; float32 sums of two losses and of
    # two microbatches' gradients in either order: 1e-6 of magnitudes near 1
    assert losses == [pytest.approx(v, rel=1e-6, abs=1e-6) for v in ref_losses]
    for got, want in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

