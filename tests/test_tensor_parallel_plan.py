"""A tensor-parallel plan resolved on the stages of a split model: which modules each stage
shards, and every refused plan named before anything is sharded.

One process: torch's fake process group stands in for T ranks (its collectives move no data),
which is all that resolving, checking and sharding need; the numerics are checked where real
ranks run.
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch.distributed as dist
from torch import nn

from lightning_gsched.partition import partition
from lightning_gsched.partition.tensor_parallel import (
    TensorParallelPlanError,
    assign_plan,
    name_matches,
    parallelize_stages,
)
from models import gpt_inputs, make_gpt

T = 2


@pytest.fixture
def tp_mesh() -> Iterator[object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=T)
    try:
        yield init_device_mesh("cpu", (T,), mesh_dim_names=("tensor_parallel",))
    finally:
        dist.destroy_process_group()


def split_gpt(layers: int = 3) -> tuple[nn.Module, list[nn.Module]]:
    model = make_gpt(0, layers=layers)
    part = partition(model, 2, gpt_inputs(), verify=False)
    return model, list(part.stages)


MLP_PLAN = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}


def test_patterns_follow_parallelize_module() -> None:
    assert name_matches("blocks.*.mlp.0", "blocks.12.mlp.0")
    assert not name_matches("blocks.*.mlp.0", "blocks.1.mlp.0.weight")  # same number of parts
    assert not name_matches("blocks.*", "blocks.1.mlp")
    assert name_matches("blocks.1?.attn", "blocks.12.attn")


def test_each_stage_gets_the_entries_naming_its_modules(tp_mesh: object) -> None:
    from torch.distributed.tensor import DTensor

    model, stages = split_gpt()
    before = {n: p.shape for n, p in model.named_parameters()}
    assigned = parallelize_stages(stages, MLP_PLAN, tp_mesh)  # type: ignore[arg-type]
    # every block's two MLP layers, each in the stage that computes the block, none twice
    names = [n for found in assigned for n in found]
    assert sorted(names) == sorted(f"blocks.{i}.mlp.{j}" for i in range(3) for j in (0, 2))
    for stage, found in zip(stages, assigned, strict=True):
        mine = dict(stage.named_modules())
        assert all(n in mine for n in found)
    # the stages hold the model's own modules: the model is sharded in place, under its names
    for name, p in model.named_parameters():
        sharded = name.startswith("blocks.") and ".mlp." in name
        assert isinstance(p, DTensor) == sharded, name
        if sharded:
            local = p.to_local().shape
            if name.endswith("mlp.0.weight") or name.endswith("mlp.0.bias"):
                assert local[0] == before[name][0] // T  # column-wise: output rows
            elif name.endswith("mlp.2.weight"):
                assert local == (before[name][0], before[name][1] // T)  # row-wise: inputs
            else:  # a row-wise Linear's bias is replicated
                assert local == before[name]


def test_styles_by_name_and_by_object_are_the_same(tp_mesh: object) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    _, stages = split_gpt()
    names = [list(dict(s.named_modules())) for s in stages]
    by_name = assign_plan(MLP_PLAN, names)
    by_object = assign_plan({"blocks.*.mlp.0": ColwiseParallel(),
                             "blocks.*.mlp.2": RowwiseParallel()}, names)
    assert [{n: type(s) for n, s in st.items()} for st in by_name] == \
        [{n: type(s) for n, s in st.items()} for st in by_object]


def test_a_function_plan_is_called_once_per_stage(tp_mesh: object) -> None:
    _, stages = split_gpt()
    seen: list[tuple[nn.Module, object]] = []
    parallelize_stages(stages, lambda stage, mesh: seen.append((stage, mesh)), tp_mesh)  # type: ignore[arg-type]
    assert [s for s, _ in seen] == stages and all(m is tp_mesh for _, m in seen)


@pytest.mark.parametrize("plan, words", [
    ({"blocks.*.mlp.9": "colwise"}, ["'blocks.*.mlp.9' matches no module", "blocks."]),
    ({"blocks.*.ln1": "colwise"}, ["ColwiseParallel to 'blocks.0.ln1', a LayerNorm",
                                   "nn.Linear and nn.Embedding"]),
    ({"blocks.*.mlp.0": "diagonal"}, ["'diagonal' is not a tensor-parallel style", "'colwise'"]),
    ({"blocks.*.mlp.0": "colwise", "blocks.0.mlp.?": "rowwise"},
     ["'blocks.0.mlp.0' is matched by two tensor_parallel_plan patterns"]),
])
def test_a_refused_plan_names_the_problem_and_shards_nothing(
        tp_mesh: object, plan: dict[str, str], words: list[str]) -> None:
    model, stages = split_gpt()
    with pytest.raises(TensorParallelPlanError) as info:
        parallelize_stages(stages, plan, tp_mesh)  # type: ignore[arg-type]
    for w in words:
        assert w in str(info.value), str(info.value)
    from torch.distributed.tensor import DTensor

    assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_a_size_the_degree_does_not_divide_is_refused(tp_mesh: object) -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 4))
    with pytest.raises(TensorParallelPlanError, match=r"'0' \(Linear, out_features=3\) cannot "
                                                      r"be split column-wise into "
                                                      r"tensor_parallel_size=2"):
        parallelize_stages([model], {"0": "colwise", "2": "rowwise"}, tp_mesh)  # type: ignore[arg-type]
