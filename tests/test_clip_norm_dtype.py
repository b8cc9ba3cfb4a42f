"""Clipping by norm keeps the gradients' dtype: a float64 model's norm is not rounded to float32.

Found by probing a float64 model under ``gradient_clip_val``: 9.8e-10 off one device after three
steps against 8e-17 without clipping, because the strategy's global norm (summed in float64
over every rank) was returned as float32, and the clipping coefficient computed from it. torch's
``clip_grad_norm_`` computes and returns it in the gradients' dtype. One process, Fabric with the
pipeline on one rank (two stages, two microbatches), against torch on a copy of the model.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def test_a_float64_models_clipping_norm_and_gradients_equal_torchs(one_rank_job: None) -> None:
    from lightning.fabric import Fabric

    from lightning_gsched.fabric import GeneralParallelFabric

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                        nn.Linear(8, 1)).double()
    ref = copy.deepcopy(net)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    fabric = Fabric(accelerator="cpu", devices=1,
                    strategy=GeneralParallelFabric("1f1b", stages=2, microbatches=2))
    fabric.launch()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    fabric.strategy.step(model, (x, y), lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
    norm = fabric.clip_gradients(model, optimizer, max_norm=0.01)
    # one device: the mean of the two microbatches' losses, as the step computes it
    sum(((ref(x[i:i + 4]) - y[i:i + 4]) ** 2).mean() / 2 for i in (0, 4)).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    assert norm.dtype == want.dtype == torch.float64
    # float64 sums in another order: 1e-12 is 10**4 float64 ulps, 10**-3 of a float32 one
    torch.testing.assert_close(norm, want, rtol=1e-12, atol=0)
    for got, expected in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-12, atol=1e-15)
