"""Partitioned models compute exactly what the unsplit module computes, for every stage count.

Each test builds two bit-identical copies of a model: one is partitioned, the other is the
reference. Forward outputs must be equal (same ops in the same order), and the gradients of a
loss w.r.t. every parameter — backpropagated through the chained stages — must match the
reference's.
"""

from __future__ import annotations

import copy
import io
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils import _pytree as pytree

import models
from lightning_gsched.partition import Partition, partition

Case = tuple[Callable[[], torch.nn.Module], Callable[[], tuple[tuple, dict]]]

CASES: dict[str, Case] = {
    "mlp": (models.make_mlp, lambda: (models.mlp_inputs(), {})),
    "cnn": (models.make_cnn, lambda: (models.cnn_inputs(), {})),
    "gpt": (lambda: models.make_gpt(layers=2), lambda: (models.gpt_inputs(), {})),
    "gpt_module_tie": (
        lambda: models.make_gpt(layers=1, tie="module"),
        lambda: (models.gpt_inputs(), {}),
    ),
    "kwargs_dict": (models.make_kwargs_model, models.kwargs_inputs),
    "long_skip": (models.make_long_skip, lambda: (models.long_skip_inputs(), {})),
}


def assert_tree_equal(actual: Any, expected: Any) -> None:
    actual_leaves, actual_spec = pytree.tree_flatten(actual)
    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    assert actual_spec == expected_spec
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor) and torch.equal(a, e)
        else:
            assert a == e


def assert_grads_match(module: torch.nn.Module, reference: torch.nn.Module) -> None:
    got, want = models.parameter_grads(module), models.parameter_grads(reference)
    assert got.keys() == want.keys()
    for name, expected in want.items():
        assert expected is not None, name
        torch.testing.assert_close(got[name], expected, rtol=1e-5, atol=1e-6, msg=name)


def stage_counts(num_units: int) -> list[int]:
    """Every S from 1 to the maximum (the number of units); thinned above 100 units."""
    if num_units <= 100:
        return list(range(1, num_units + 1))
    return sorted(set(range(1, 13)) | set(range(13, num_units, 9)) | {num_units - 1, num_units})


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_stage_count_matches_unsplit_forward_and_gradients(name: str) -> None:
    make, inputs = CASES[name]
    args, kwargs = inputs()
    num_units = len(partition(make(), 1, args, kwargs).unit_names)
    assert num_units > 5
    for num_stages in stage_counts(num_units):
        module, reference = make(), make()
        part = partition(module, num_stages, args, kwargs)
        assert len(part.stages) == num_stages
        out = part(*args, **kwargs)
        expected = reference(*args, **kwargs)
        assert_tree_equal(out, expected)
        models.loss_of(out).backward()
        models.loss_of(expected).backward()
        assert_grads_match(module, reference)
        for (n1, b1), (n2, b2) in zip(
            module.named_buffers(), reference.named_buffers(), strict=True
        ):
            assert n1 == n2 and torch.equal(b1, b2)  # e.g. BatchNorm running stats


@pytest.mark.parametrize("name", sorted(CASES))
def test_stagewise_backward_like_a_pipeline_runtime(name: str) -> None:
    """Detach at each boundary and backprop stage by stage, as the runtime will."""
    make, inputs = CASES[name]
    args, kwargs = inputs()
    module, reference = make(), make()
    part = partition(module, 4, args, kwargs)
    out = models.run_stagewise(part.stages, args, kwargs)
    expected = reference(*args, **kwargs)
    assert_tree_equal(out, expected)
    models.loss_of(expected).backward()
    assert_grads_match(module, reference)


def test_stage_boundary_contract() -> None:
    module = models.make_long_skip()
    (x,) = models.long_skip_inputs()
    part = partition(module, 3, (x,), split_points=["blocks.1", "blocks.3"])
    first, middle, last = part.stages
    assert first.is_first_stage and not first.is_last_stage
    assert last.is_last_stage and not middle.is_first_stage and not middle.is_last_stage
    carried = first(x)  # stage 0: the original call
    assert isinstance(carried, tuple) and len(carried) == len(first.output_names)
    assert middle.input_names == first.output_names == tuple(part.boundary_names[0])
    after_middle = middle(carried)  # stage k > 0: ONE tuple from stage k - 1
    # the first block's output skips the middle stage: it is handed over at both boundaries
    assert "blocks_0_1" in part.boundary_names[0] and "blocks_0_1" in part.boundary_names[1]
    assert torch.equal(last(after_middle), module(x))  # last stage: the module's own output
    assert part.stage_units[1][0] == "blocks_1_0" and part.stage_units[2][0] == "blocks_3_0"


def test_skip_value_passes_through_middle_stage_as_same_object() -> None:
    module = models.make_long_skip()
    (x,) = models.long_skip_inputs()
    part = partition(module, 4, (x,), split_points=["blocks.1", "blocks.2", "blocks.3"])
    carried = part.stages[0](x)
    after = part.stages[1](carried)
    skip = part.stages[0].output_names.index("blocks_0_1")
    assert after[part.stages[1].output_names.index("blocks_0_1")] is carried[skip]


def test_parameters_keep_original_names_and_objects() -> None:
    module = models.make_gpt(layers=3)
    (idx,) = models.gpt_inputs()
    part = partition(module, 3, (idx,))
    originals = dict(module.named_parameters())
    seen = set()
    for index, stage in enumerate(part.stages):
        for name, param in stage.named_parameters():
            assert param is originals[name]
            seen.add(name)
        assert [n for n, _ in stage.named_parameters()] == part.stage_parameter_names[index]
    assert seen == set(originals)
    assert part.shared_parameters == {"wte.weight": [0, 2]}
    assert part.parameter_stages["wte.weight"] == [0, 2]
    assert part.stage_of_parameter["blocks.2.attn.qkv.weight"] == 2
    assert part.unused_parameters == []
    # the non-persistent causal-mask buffer keeps its name and stays out of the state dict
    assert dict(part.stages[0].named_buffers())["causal_mask"] is module.causal_mask
    assert "causal_mask" not in part.stages[0].state_dict()


def test_stage_state_dicts_line_up_with_the_unsplit_module() -> None:
    module = models.make_cnn()
    (x,) = models.cnn_inputs()
    part = partition(module, 3, (x,))
    full = module.state_dict()
    merged: dict[str, torch.Tensor] = {}
    for stage in part.stages:
        for key, value in stage.state_dict().items():
            assert key in full and value.data_ptr() == full[key].data_ptr()
            merged[key] = value
    assert merged.keys() == full.keys()


def test_tied_alias_parameter_is_shared_not_copied() -> None:
    module = models.make_gpt(layers=2, tie="module")
    (idx,) = models.gpt_inputs()
    part = partition(module, 2, (idx,))
    last = dict(part.stages[-1].named_parameters())
    assert last["head.weight"] is module.wte.weight
    assert part.canonical_name(last["head.weight"]) == "wte.weight"
    assert part.shared_parameters == {"wte.weight": [0, 1]}
    assert "wte.weight" in part.stage_parameter_names[1]


def test_optimizer_step_on_stages_equals_unsplit_step() -> None:
    module, reference = models.make_gpt(layers=2), models.make_gpt(layers=2)
    (idx,) = models.gpt_inputs()
    part = partition(module, 3, (idx,))
    params = {id(p): p for stage in part.stages for p in stage.parameters()}
    optimizer = torch.optim.SGD(list(params.values()), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        for opt, model_out in ((optimizer, part(idx)), (reference_optimizer, reference(idx))):
            opt.zero_grad()
            models.loss_of(model_out).backward()
            opt.step()
    for (name, p), (_, q) in zip(
        module.named_parameters(), reference.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_lightning_module_partitions_like_its_model() -> None:
    module, reference = models.make_gpt_lightning(layers=2), models.make_gpt_lightning(layers=2)
    (idx,) = models.gpt_inputs()
    part = partition(module, 3, (idx,))
    assert torch.equal(part(idx), reference(idx))
    names = {n for stage in part.stages for n, _ in stage.named_parameters()}
    assert names == {n for n, _ in module.named_parameters()}
    assert part.shared_parameters == {"model.wte.weight": [0, 2]}
    models.loss_of(part(idx)).backward()
    models.loss_of(reference(idx)).backward()
    assert_grads_match(module, reference)


def test_dropout_in_train_mode_matches_with_the_same_seed() -> None:
    module, reference = models.make_gpt(layers=2, dropout=0.3), models.make_gpt(layers=2, dropout=0.3)
    (idx,) = models.gpt_inputs()
    part = partition(module, 3, (idx,))
    torch.manual_seed(123)
    out = part(idx)
    torch.manual_seed(123)
    assert torch.equal(out, reference(idx))


def test_eval_mode_after_partitioning_still_matches() -> None:
    module, reference = models.make_cnn(), models.make_cnn()
    (x,) = models.cnn_inputs()
    part = partition(module, 3, (x,))
    module.eval()
    reference.eval()
    assert torch.equal(part(x), reference(x))


def test_partitioning_leaves_module_state_untouched() -> None:
    module, reference = models.make_cnn(), models.make_cnn()
    (x,) = models.cnn_inputs()
    rng = torch.get_rng_state()
    partition(module, 3, (x,), balance="time")
    assert torch.equal(torch.get_rng_state(), rng)
    for (name, a), (_, b) in zip(
        module.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert all(p.grad is None for p in module.parameters())


def test_lightning_demo_transformer_partitions_with_static_shapes() -> None:
    """``lightning.pytorch.demos.Transformer`` builds masks with ``torch.ones(t, t)`` (t from
    ``inputs.shape``), which symbolic fx cannot trace; the static-shape fallback can, and it
    even enters ``nn.Transformer`` so stages are cut between encoder/decoder layers."""
    from lightning.pytorch.demos import Transformer

    def make() -> torch.nn.Module:
        return models.seeded(
            0, lambda: Transformer(vocab_size=40, ninp=16, nhead=2, nhid=32, nlayers=2, dropout=0.0)
        )

    module, reference = make(), make()
    inputs = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(2))
    part = partition(module, 4, (inputs, target))
    assert part.static_shapes == ((2, 6), (2, 6))
    assert any("encoder.layers" in name for name in sum(part.stage_parameter_names, []))
    assert module.src_mask is None and module.pos_encoder.pe is None  # tracing left no caches
    out = part(inputs, target)
    assert torch.equal(out, reference(inputs, target))
    models.loss_of(out).backward()
    models.loss_of(reference(inputs, target)).backward()
    assert_grads_match(module, reference)


def test_report_lists_stages_nodes_params_and_costs() -> None:
    module = models.make_gpt(layers=3)
    (idx,) = models.gpt_inputs()
    part = partition(module, 3, (idx,))
    text = part.report()
    assert str(part) == text
    for index, names in enumerate(part.stage_units):
        assert f"Stage {index} units:" in text
        assert names[0] in text and names[-1] in text
        assert f"{part.stage_param_counts[index]:,}" in text
    assert "wte.weight: stages [0, 2]" in text
    assert "blocks.1 (38 units)" in text  # runs of one block are folded
    verbose = part.report(verbose=True)
    assert all(f"{name} = " in verbose for name in part.unit_names)
    assert sum(part.stage_costs) == sum(part.unit_costs)


def test_partition_is_a_plain_result_object() -> None:
    part = partition(models.make_mlp(), 2, models.mlp_inputs())
    assert isinstance(part, Partition) and len(part) == 2
    assert repr(part).startswith("Partition(MLP, num_stages=2")


@st.composite
def skip_topologies(draw: st.DrawFn) -> tuple[int, tuple[tuple[int, int], ...], int]:
    layers = draw(st.integers(2, 5))
    edges = [(src, dst) for dst in range(2, layers + 1) for src in range(0, dst - 1)]
    skips = tuple(draw(st.lists(st.sampled_from(edges), unique=True, max_size=4))) if edges else ()
    return layers, skips, draw(st.integers(1, 50))


@settings(max_examples=25, deadline=None)
@given(skip_topologies())
def test_random_skip_topologies_match_unsplit(topology: tuple[int, tuple, int]) -> None:
    layers, skips, wanted_stages = topology
    module = models.make_skipnet(layers=layers, skips=skips)
    reference = models.make_skipnet(layers=layers, skips=skips)
    x = models.seeded(1, lambda: torch.randn(3, 8))
    num_units = len(partition(models.make_skipnet(layers=layers, skips=skips), 1, (x,)).unit_names)
    part = partition(module, min(wanted_stages, num_units), (x,))
    out = models.run_stagewise(part.stages, (x,), {})
    expected = reference(x)
    assert_tree_equal(out, expected)
    models.loss_of(expected).backward()
    assert_grads_match(module, reference)


def test_varargs_kwargs_and_tuple_returning_leaf() -> None:
    class VarArgs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.mha = nn.MultiheadAttention(4, 2, batch_first=True)  # returns a tuple
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor, *rest: torch.Tensor, flag: bool = True, **extra: torch.Tensor):
            h = self.a(x) * self.scale
            attn, weights = self.mha(h, h, h)
            for r in rest:
                attn = attn + r
            out = attn + extra["z"] if flag else attn
            return out, x, {"weights": weights, "n": len(rest)}

    module = models.seeded(0, VarArgs)
    x, r, z = (models.seeded(i, lambda: torch.randn(2, 3, 4)) for i in range(3))
    for num_stages in range(1, 7):
        part = partition(module, num_stages, (x, r, r), {"z": z})
        out = part(x, r, r, z=z)
        assert_tree_equal(out, module(x, r, r, z=z))
        assert out[1] is x  # an input returned as output is the same object


def test_stages_deepcopy_and_pickle() -> None:
    module = models.make_gpt(layers=2)
    (idx,) = models.gpt_inputs()
    part = partition(module, 2, (idx,))
    copies = [copy.deepcopy(stage) for stage in part.stages]
    buffer = io.BytesIO()
    torch.save(part.stages, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    expected = module(idx)
    for stages in (copies, loaded):
        assert torch.equal(stages[1](stages[0](idx)), expected)
        assert dict(stages[0].named_parameters()).keys() == dict(part.stages[0].named_parameters()).keys()
