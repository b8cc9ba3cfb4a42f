"""Models the build refuses at the first step, naming the cause and the fix (found by probing;
one process, Fabric on one rank):

* already sharded with DTensors (``parallelize_module`` called by the user, as under Lightning's
  ModelParallelStrategy): the split failed inside torch ("mixed torch.Tensor and DTensor") with
  advice about the example; the fix is ``tensor_parallel_plan``;
* holding a torchmetrics ``Metric(dist_sync_on_step=True)``: its per-step collective ran on the
  loss's rank only and every rank waited until ``step_timeout``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn


def test_a_model_sharded_before_the_split_is_refused_naming_the_plan(one_rank_job: None
                                                                      ) -> None:
    from lightning.fabric import Fabric
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from lightning_gsched.errors import StrategyConfigError
    from lightning_gsched.fabric import GeneralParallelFabric

    fabric = Fabric(accelerator="cpu", devices=1,
                    strategy=GeneralParallelFabric("1f1b", stages=2, microbatches=2))
    fabric.launch()
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    parallelize_module(net, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel()})
    model, _ = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    batch = (torch.randn(4, 4), torch.randn(4, 1))
    with pytest.raises(StrategyConfigError) as refused:
        fabric.strategy.step(model, batch, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
    message = str(refused.value)
    assert "parameters are already sharded as DTensors (0.weight, 0.bias)" in message
    assert "pass its plan as tensor_parallel_plan=" in message


def test_a_metric_synced_on_every_step_is_refused_naming_it(one_rank_job: None) -> None:
    from lightning.fabric import Fabric
    from torchmetrics import MeanMetric

    from lightning_gsched.errors import StrategyConfigError
    from lightning_gsched.fabric import GeneralParallelFabric

    fabric = Fabric(accelerator="cpu", devices=1,
                    strategy=GeneralParallelFabric("1f1b", stages=2, microbatches=2))
    fabric.launch()
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    net.seen = MeanMetric(dist_sync_on_step=True)  # type: ignore[assignment]
    model, _ = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    batch = (torch.randn(4, 4), torch.randn(4, 1))
    with pytest.raises(StrategyConfigError) as refused:
        fabric.strategy.step(model, batch, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
    assert "Metric(s) 'seen' of Sequential sync on every step" in str(refused.value)
    assert "Drop dist_sync_on_step" in str(refused.value)
