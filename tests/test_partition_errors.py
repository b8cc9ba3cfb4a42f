"""Bad models and bad arguments fail with PartitionError naming the problem and the fix."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch import nn

import models
from lightning_gsched.errors import GschedError, PartitionError
from lightning_gsched.partition import (
    BalanceError,
    ModeMismatchError,
    SplitMismatchError,
    StageInputError,
    TooManyStagesError,
    TraceFailedError,
    UnknownNameError,
    partition,
)


def line_of(cls: type, text: str) -> int:
    source, start = inspect.getsourcelines(cls)
    return start + next(i for i, line in enumerate(source) if text in line)


# ----------------------------------------------------------------------------- tracing


def test_data_dependent_root_forward_names_module_line_and_leaf_modules() -> None:
    with pytest.raises(TraceFailedError) as info:
        partition(models.DataDependentModel(), 2, (torch.randn(2, 8),))
    message = str(info.value)
    assert isinstance(info.value, PartitionError) and isinstance(info.value, GschedError)
    assert "DataDependentModel.forward" in message
    assert f"models.py:{line_of(models.DataDependentModel, 'if x.sum() > 0')}" in message
    assert "if x.sum() > 0:" in message
    assert "branches on a tensor's value" in message
    assert "leaf_modules=" in message and "split_points" in message


def test_data_dependent_submodule_without_auto_leaf_suggests_its_class() -> None:
    with pytest.raises(TraceFailedError) as info:
        partition(models.RoutedModel(), 2, (torch.randn(2, 8),), auto_leaf=False)
    message = str(info.value)
    assert "Router.forward (module 'router' of RoutedModel)" in message
    assert f"models.py:{line_of(models.Router, 'if x.mean() > 0')}" in message
    assert "leaf_modules=(Router,)" in message and "leaf_modules=('router',)" in message


def test_untraceable_submodule_becomes_a_leaf_automatically() -> None:
    module, reference = models.seeded(0, models.RoutedModel), models.seeded(0, models.RoutedModel)
    x = torch.randn(2, 8)
    part = partition(module, 3, (x,))
    assert list(part.auto_leaf_modules) == ["router"]
    assert "Router" in part.auto_leaf_modules["router"]
    assert "router" in part.report()
    assert part.stage_units == [["pre"], ["router", "relu"], ["post"]]
    assert torch.equal(part(x), reference(x))
    for leaf_modules in ((models.Router,), ("router",), ("Router",)):
        named = partition(models.seeded(0, models.RoutedModel), 2, (x,), leaf_modules=leaf_modules)
        assert named.auto_leaf_modules == {} and "router" in named.unit_names


def test_lightning_demo_transformer_without_static_shapes_fails_clearly() -> None:
    from lightning.pytorch.demos import Transformer

    module = Transformer(vocab_size=40, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.0)
    x = torch.randint(0, 40, (2, 6))
    with pytest.raises(TraceFailedError) as info:
        partition(module, 2, (x, x), static_shapes=False)
    message = str(info.value)
    assert "Transformer.forward" in message
    pattern = r"demos[/\\]transformer\.py:\d+: mask = torch\.triu\(torch\.ones\(size, size\)"
    assert re.search(pattern, message)
    assert "concrete Python number" in message and "static_shapes=True" in message
    assert module.src_mask is None  # the failed trace did not leave a Proxy behind


def test_mode_dependent_trace_runs_the_graph_of_the_current_mode() -> None:
    """A forward that reads ``self.training`` gets one graph per mode, cut at the same place."""
    module = models.seeded(0, models.ModeDependentModel)
    x = torch.randn(4, 8)
    part = partition(module, 2, (x,))
    assert part.mode_dependent and "depends on train()/eval()" in part.report()
    assert all(stage.has_graph_per_mode for stage in part.stages) and part.graph_per_mode
    assert "a train-mode and an eval-mode graph" in part.report()
    for training in (True, False, True):
        module.train(training)
        torch.manual_seed(1)
        want = module(x)
        torch.manual_seed(1)
        assert torch.equal(part(x), want), training


class _Outer(torch.nn.Module):
    """Two traced modules that read the mode: they can be put in different modes."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = models.ModeDependentModel(), models.ModeDependentModel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def test_traced_modules_in_different_modes_are_refused() -> None:
    module = _Outer()
    x = torch.randn(4, 8)
    part = partition(module, 2, (x,))
    module.first.eval()  # the second stays in train mode: neither graph is the model's code
    with pytest.raises(ModeMismatchError, match="different modes"):
        part(x)


class _TrainOnlyBranch(torch.nn.Module):
    """A module called only in train mode: a cut before it has no counterpart in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.extra, self.b = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if self.training:
            x = self.extra(x)
        return self.b(x)


def test_mode_dependent_trace_that_cannot_be_cut_alike_refuses_the_other_mode() -> None:
    module = _TrainOnlyBranch()
    x = torch.randn(4, 8)
    part = partition(module, 2, (x,), split_points=["extra"])  # no "extra" unit in eval mode
    assert not any(stage.has_graph_per_mode for stage in part.stages)
    assert "traced mode only" in part.report()
    part(x)  # the traced mode runs
    module.eval()
    with pytest.raises(ModeMismatchError, match="could not be cut at the same stage boundaries"):
        part(x)
    # cut before b, the same module gets a graph per mode; stage 0 holds "extra", which only
    # train mode reads
    module.train()
    part = partition(module, 2, (x,), split_points=["b"])
    assert all(stage.has_graph_per_mode for stage in part.stages)
    assert "extra.weight" in dict(part.stages[0].named_parameters())
    for training in (False, True):
        module.train(training)
        assert torch.equal(part(x), module(x)), training


# ----------------------------------------------------------------------------- stage counts and names


def test_too_many_stages_names_the_maximum() -> None:
    args = models.mlp_inputs()
    maximum = len(partition(models.make_mlp(), 1, args).unit_names)
    assert len(partition(models.make_mlp(), maximum, args).stages) == maximum
    with pytest.raises(TooManyStagesError, match=f"at most {maximum} stages"):
        partition(models.make_mlp(), maximum + 1, args)
    with pytest.raises(BalanceError, match="positive int"):
        partition(models.make_mlp(), 0, args)


def test_unknown_split_point_lists_close_matches() -> None:
    args = models.long_skip_inputs()
    with pytest.raises(UnknownNameError) as info:
        partition(models.make_long_skip(), 2, args, split_points=["blokcs.2"])
    assert "'blokcs.2' is not in the model" in str(info.value)
    assert "'blocks.2'" in str(info.value)
    with pytest.raises(UnknownNameError, match="'blocks.1'"):
        partition(models.make_long_skip(), 2, args, split_points=["blocks.9"])


def test_bad_split_points() -> None:
    args = models.long_skip_inputs()
    with pytest.raises(BalanceError, match="makes 2 stages, but num_stages=3"):
        partition(models.make_long_skip(), 3, args, split_points=["blocks.2"])
    with pytest.raises(BalanceError, match="stage 0 would be empty"):
        partition(models.make_long_skip(), 2, args, split_points=["blocks.0"])
    with pytest.raises(BalanceError, match="cut at the same place"):
        partition(models.make_long_skip(), 3, args, split_points=["blocks.2", "blocks.2.0"])
    with pytest.raises(BalanceError, match="inside leaf module 'blocks.1'"):
        partition(models.make_cnn(), 2, models.cnn_inputs(), leaf_modules=(models.ResidualBlock,),
                  split_points=["blocks.1.conv2"])
    with pytest.raises(BalanceError, match="not both"):
        partition(models.make_long_skip(), 2, args, balance=[5, 6], split_points=["blocks.2"])


def test_unknown_leaf_module_name_and_balance_mode() -> None:
    args = models.mlp_inputs()
    with pytest.raises(UnknownNameError, match="'layers.1'"):
        partition(models.make_mlp(), 2, args, leaf_modules=("layers.l",))
    with pytest.raises(BalanceError, match="'flops' is not one of"):
        partition(models.make_mlp(), 2, args, balance="flops")


# ----------------------------------------------------------------------------- calling the stages


def test_stage_zero_rejects_calls_shaped_unlike_the_example() -> None:
    args, kwargs = models.kwargs_inputs()
    part = partition(models.make_kwargs_model(), 2, args, kwargs)
    with pytest.raises(StageInputError, match="traced for arguments shaped like"):
        part(*args)  # no mask/extras: different structure
    with pytest.raises(StageInputError, match="plain value 0.5"):
        part(*args, **{**kwargs, "scale": 2.0})
    with pytest.raises(StageInputError, match="takes one positional argument"):
        part.stages[1](*part.stages[0](*args, **kwargs))


def test_static_shape_partition_rejects_other_shapes() -> None:
    from lightning.pytorch.demos import Transformer

    module = Transformer(vocab_size=40, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.0)
    x = torch.randint(0, 40, (2, 6))
    part = partition(module, 2, (x, x))
    assert "static shapes" in part.report()
    y = torch.randint(0, 40, (2, 7))
    with pytest.raises(StageInputError, match=r"must have shape \(2, 6\), got \(2, 7\)"):
        part(y, y)


def test_unsupported_argument_type_is_rejected() -> None:
    class Holder:
        tensor = torch.randn(2, 16)

    with pytest.raises(PartitionError, match="register_pytree_node"):
        partition(models.make_mlp(), 2, (Holder(),))


# ----------------------------------------------------------------------------- torch.compile


def test_compiled_blocks_are_units_and_a_compiled_whole_is_told_to_compile_its_blocks() -> None:
    """torch.fx cannot enter compiled code: each compiled block is one unit that its stage runs
    compiled (aot_eager: AOTAutograd's graphs without code generation, the same
    decomposed ops as every backend runs), and a compiled whole model is one unit, refused
    with the fix."""
    args = models.long_skip_inputs()
    model = models.make_long_skip()
    want = model(*args)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend="aot_eager")
    part = partition(model, 3, args)  # verified against the unsplit model on ``args``
    assert len(part.unit_names) == len(model.blocks) + 1  # the blocks and the skip's add
    assert any(type(m).__name__ == "OptimizedModule" for m in part.stages[1].modules())
    # decomposed ops may sum in another order than eager's: float32 rounding, not a bias
    torch.testing.assert_close(part(*args), want, rtol=1e-5, atol=1e-6)

    whole = torch.nn.Sequential(torch.compile(models.make_long_skip(), backend="aot_eager"))
    with pytest.raises(TooManyStagesError) as info:
        partition(whole, 2, args)
    assert "'0' is kept whole because it is compiled (torch.compile)" in str(info.value)
    assert "compile its blocks instead of it" in str(info.value)


class SavesThenChanges(nn.Module):
    """An in-place change of a value autograd saved: the model's own backward fails."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.first(x))  # sigmoid saves its output
        out = self.last(h)
        h += 1  # changes it in place after the fact
        return out


def test_verify_says_the_model_itself_fails_its_backward() -> None:
    """It surfaced torch's raw "modified by an inplace operation" traceback from verify, as if
    the split were at fault (found by probing)."""
    from lightning_gsched.partition.errors import ExampleInputError

    with pytest.raises(ExampleInputError, match=r"its own backward fails, before any stage "
                       r"runs: RuntimeError: one of the variables needed"):
        partition(SavesThenChanges(), 2, (torch.randn(4, 8),))


def test_a_cut_between_a_view_and_an_in_place_change_is_explained() -> None:
    """``skip = h.view(...)`` then ``ReLU(inplace=True)`` on ``h``, a user's cut between them:
    the next stage changes its own copy of ``h`` and the handed-over view does not see it.
    verify refuses the split, and its message now names the separated change and the fixes
    (it only said "not recorded faithfully by torch.fx"; found by probing). A cut after the
    change verifies."""

    class ViewThenInPlace(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            self.r = torch.nn.ReLU(inplace=True)
            self.out = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.l1(x)
            skip = h.view(-1, 8)
            h = self.l2(self.r(h))
            return self.out(h + skip)

    x = torch.randn(4, 8)
    with pytest.raises(SplitMismatchError, match=r"separate in-place changes from their values "
                                                 r"\(unit 'r' changes 'l1' across the cut"):
        partition(ViewThenInPlace(), 2, (x,), split_points=["r"], verify=True)
    part = partition(ViewThenInPlace(), 2, (x,), split_points=["l2"], verify=True)
    assert part.separated_changes == []
