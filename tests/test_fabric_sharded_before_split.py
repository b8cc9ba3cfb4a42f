"""A model already sharded with DTensors (``parallelize_module`` called by the user, as under
Lightning's ModelParallelStrategy) is refused at the first step, naming the parameters and the
fix (``tensor_parallel_plan``). Found by probing: the split failed inside torch ("mixed
torch.Tensor and DTensor") with advice about the example. One process, Fabric on one rank.
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
