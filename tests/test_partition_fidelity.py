"""A split either computes what the model computes, outputs and gradients, or is refused.

Each case here used to split without a word and compute something else:

* custom autograd Functions whose backward is not autograd of their forward (the tracer
  inlined their forward, so the user's backward never ran);
* an output object that is not a pytree but holds tensors (returned as the trace-time object);
* item and attribute assignment on traced values (the assignment was lost, or the whole model
  became one leaf);
and ``verify=`` catches what the tracer might still get wrong, naming the stage.

References are the unsplit model, run in the same test. Equalities through ``part(...)`` are
exact: the stages run the same kernels in the same order inside one autograd graph. Run as a
pipeline runs them (``models.run_stagewise``: detached at every boundary), gradients may differ
in the last bits where a value read by several stages sums its contributions in another order:
``rtol=1e-5, atol=1e-6``, orders of magnitude below the differences these bugs make (a zero
gradient instead of the passed-through one, a sign flipped, a factor 3).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import models
from lightning_gsched.errors import GschedError
from lightning_gsched.partition import (
    PartitionError,
    SplitMismatchError,
    UntracedOutputError,
    partition,
)
from lightning_gsched.partition import verify as verify_module

RTOL, ATOL = 1e-5, 1e-6


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _reference(make: Any, args: tuple, seed: int = 0) -> tuple[Any, dict[str, torch.Tensor]]:
    model = models.seeded(seed, make)
    out = model(*args)
    models.loss_of(out).backward()
    return out, _grads(model)


def _assert_split_exact(make: Any, args: tuple, num_stages: int, **options: Any) -> Any:
    """Outputs and gradients of the split equal the unsplit model's (exact through part(...),
    within summation order when run stage by stage as a pipeline)."""
    want_out, want_grads = _reference(make, args)
    model = models.seeded(0, make)
    part = partition(model, num_stages, args, **options)
    out = part(*args)
    for got, want in zip(pytree.tree_leaves(out), pytree.tree_leaves(want_out), strict=True):
        assert torch.equal(got, want)
    models.loss_of(out).backward()
    got_grads = _grads(model)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert torch.equal(got_grads[name], grad), name
    model.zero_grad(set_to_none=True)
    models.run_stagewise(part.stages, args, {})
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, want_grads[name], rtol=RTOL, atol=ATOL, msg=name)
    return part


# ------------------------------------------------------------------ custom autograd Functions


@pytest.mark.parametrize("static", [False, True], ids=["symbolic", "static"])
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_custom_backward_runs_in_every_stage_position(num_stages: int, static: bool) -> None:
    args = models.custom_function_inputs()
    part = _assert_split_exact(models.make_custom_functions, args, num_stages,
                               static_shapes=static)
    assert part.num_stages == num_stages
    assert part.verified is not None and part.verified.status == "passed"
    # the straight-through Function is what gives layers.0 a gradient at all: autograd of
    # its forward (a rounding) would give exactly zero
    model = part.module
    model.zero_grad(set_to_none=True)
    models.loss_of(part(*args)).backward()
    assert model.layers[0].weight.grad.abs().sum() > 0
    # one node per Function call: none of their forwards' operations were inlined
    units = " ".join(part.unit_names)
    assert "round" not in units and "view_as" not in units
    assert sum("_apply" in name for name in part.unit_names) == 5


class NeedsCallable(torch.autograd.Function):
    """A Function taking a Python callable, which a graph cannot hold as an argument."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fn: Any) -> torch.Tensor:
        return fn(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return 2 * grad, None


class CallsWithCallable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NeedsCallable.apply(self.lin(x), torch.tanh)


class AroundCallable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.inner = CallsWithCallable()
        self.last = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.inner(self.first(x)))


def test_function_with_an_unrecordable_argument_keeps_its_module_whole() -> None:
    args = (torch.randn(3, 8, generator=torch.Generator().manual_seed(0)),)
    part = _assert_split_exact(AroundCallable, args, 2)
    assert "inner" in part.auto_leaf_modules
    assert "NeedsCallable.apply" in part.auto_leaf_modules["inner"]


# ------------------------------------------------------------------------------- outputs


class NotAPytree:
    def __init__(self, value: torch.Tensor) -> None:
        self.layers = [[value]]  # as deep as a cache's key/value lists


class FakeCache(NotAPytree):
    """Named like transformers' caches: the error then says how to turn the cache off."""


class ReturnsObject(nn.Module):
    def __init__(self, holder: type) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.holder = holder

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        h = self.b(self.a(x))
        return h, {"state": self.holder(h)}


@pytest.mark.parametrize("holder,fix", [(NotAPytree, "register_pytree_node"),
                                        (FakeCache, "use_cache = False")])
def test_an_output_object_holding_tensors_is_refused(holder: type, fix: str) -> None:
    with pytest.raises(UntracedOutputError) as error:
        partition(ReturnsObject(holder), 2, (torch.randn(2, 4),))
    message = str(error.value)
    assert f"output[1]['state'] ({holder.__name__})" in message
    assert fix in message


class CacheReader(nn.Module):
    """A layer handed the model's cache object, as transformers' attention is."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: Any = None) -> torch.Tensor:
        y = self.lin(x)
        if cache is not None:
            cache.layers.append(y)
        return y


class CachingModel(nn.Module):
    """transformers' pattern: a cache is made unless ``use_cache`` is False."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CacheReader() for _ in range(4))

    def forward(self, x: torch.Tensor, use_cache: bool | None = None) -> torch.Tensor:
        cache = FakeCache(x) if use_cache is not False else None
        for layer in self.layers:
            x = torch.tanh(layer(x, cache))
        return x


class WrapsCachingModel(nn.Module):
    """A LightningModule's ``self.model(x)``: the call leaves ``use_cache`` out."""

    def __init__(self) -> None:
        super().__init__()
        self.model = CachingModel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def test_a_submodule_called_with_its_cache_on_is_traced_with_it_off() -> None:
    """The layers kept whole (as tensor parallelism keeps attention whole) would each be handed
    the cache object, which a graph cannot hold: the submodule is traced as if its call passed
    ``use_cache=False``, the split is even and exact, and the report names the submodule."""
    args = (torch.randn(3, 8, generator=torch.Generator().manual_seed(0)),)
    part = _assert_split_exact(WrapsCachingModel, args, 2, leaf_modules=("CacheReader",))
    assert part.cache_off_modules == ["model"] and not part.auto_leaf_modules
    assert part.stage_param_counts == [144, 144]
    assert "called with use_cache=False" in part.report() and ": model" in part.report()


class ReturnsTraceTimeTensor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.table = torch.arange(4.0)  # a plain attribute: neither a buffer nor a parameter

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.b(self.a(x)), self.table


def test_a_tensor_made_while_tracing_is_not_returned() -> None:
    with pytest.raises(UntracedOutputError, match=r"output\[1\] \(Tensor\).*register_buffer"):
        partition(ReturnsTraceTimeTensor(), 2, (torch.randn(2, 4),))


class Settings:
    """A plain object without tensors: a constant in the unsplit model too."""

    def __init__(self) -> None:
        self.name = "settings"


@dataclasses.dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor


pytree.register_dataclass(Pair)


class ReturnsConstantsAndPytrees(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.settings = Settings()

    def forward(self, x: torch.Tensor) -> tuple[Pair, Settings, str]:
        h = self.a(x)
        return Pair(h, self.b(h)), self.settings, "tag"


def test_plain_objects_and_registered_pytrees_are_returned_fresh() -> None:
    model = ReturnsConstantsAndPytrees()
    part = partition(model, 2, (torch.randn(2, 4),))
    for seed in (1, 2):  # each call's own values, not the example's
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(seed))
        (got, settings, tag), (want, _, _) = part(x), model(x)
        assert torch.equal(got.first, want.first) and torch.equal(got.second, want.second)
        assert settings is model.settings and tag == "tag"


@dataclasses.dataclass
class PlainPair:
    """The same fields as :class:`Pair`, not registered: torch's pytree takes it as a leaf."""

    first: torch.Tensor
    second: torch.Tensor


class ReturnsDataclass(nn.Module):
    def __init__(self, holder: type) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.holder = holder

    def forward(self, x: torch.Tensor) -> Any:
        h = self.a(x)
        return self.holder(h, self.b(torch.tanh(h)))


def test_a_plain_dataclass_is_refused_with_its_registration_and_a_registered_one_splits() -> None:
    """A plain ``@dataclass`` is one pytree leaf in torch: refused, and the message says to
    register it (not to "return a dataclass", which is what it got); the same fields in a
    registered dataclass split and verify, each call returning its own values."""
    with pytest.raises(UntracedOutputError) as error:
        partition(ReturnsDataclass(PlainPair), 2, (torch.randn(2, 4),))
    message = str(error.value)
    assert "output (PlainPair, a plain @dataclass)" in message
    assert "torch.utils._pytree.register_dataclass(PlainPair)" in message
    assert "tuple, list, dict or dataclass" not in message
    model = ReturnsDataclass(Pair)
    part = partition(model, 2, (torch.randn(2, 4),), verify=True)
    assert part.verified is not None and part.verified.status == "passed"
    assert part.num_stages == 2
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(3))
    got, want = part(x), model(x)
    assert type(got) is Pair
    assert torch.equal(got.first, want.first) and torch.equal(got.second, want.second)


# --------------------------------------------------------------------- assignment on values


class ShiftRight(nn.Module):
    """Bart's ``shift_tokens_right`` between layers: slice and item assignment on a new tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[1](self.layers[0](x))
        shifted = x.new_zeros(x.shape)
        shifted[:, 1:] = x[:, :-1].clone()
        shifted[:, 0] = 0.5
        return self.layers[3](self.layers[2](shifted))


@pytest.mark.parametrize("static", [False, True], ids=["symbolic", "static"])
def test_item_assignment_is_recorded_and_the_model_still_splits(static: bool) -> None:
    args = (torch.randn(3, 8, generator=torch.Generator().manual_seed(0)),)
    part = _assert_split_exact(ShiftRight, args, 2, static_shapes=static)
    assert not part.auto_leaf_modules  # not one leaf: the split is even
    assert part.stage_param_counts[0] == part.stage_param_counts[1]
    assert sum(name.startswith("setitem") for name in part.unit_names) == 2


class Encoded:
    """A leaf module's output object (transformers' BaseModelOutputWithPooling)."""

    def __init__(self, last: torch.Tensor, pooled: torch.Tensor) -> None:
        self.last, self.pooled = last, pooled


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Encoded:
        h = self.lin(x)
        return Encoded(h, h.mean(0))


class ProjectsPooled(nn.Module):
    """CLIP: ``text_outputs.pooler_output = self.text_projection(...)`` on a module's output."""

    def __init__(self) -> None:
        super().__init__()
        self.before = nn.Linear(8, 8)
        self.encoder = Encoder()
        self.projection = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> Encoded:
        out = self.encoder(self.before(x))
        out.pooled = self.projection(out.pooled)
        return out


@pytest.mark.parametrize("static", [False, True], ids=["symbolic", "static"])
def test_attribute_assignment_on_a_module_output_is_recorded(static: bool) -> None:
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    model = models.seeded(0, ProjectsPooled)
    part = partition(model, 2, (x,), leaf_modules=(Encoder,), static_shapes=static)
    got, want = part(x), model(x)
    assert got.pooled.shape == want.pooled.shape == (3,)
    assert torch.equal(got.pooled, want.pooled) and torch.equal(got.last, want.last)
    (got.pooled.sum() + got.last.sum()).backward()
    assert model.projection.weight.grad is not None  # the projection is in the graph


class MutatesEarlierValue(nn.Module):
    """A small slice of an early wide value is changed in place after the heavy layers.

    Cutting after ``middle.0`` hands over the least data (the slice and a narrow activation,
    instead of the wide first output) and balances well, but separates the slice from its
    in-place change: the receiving rank would change its own copy, a leaf that needs a gradient.
    """

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 64)
        self.middle = nn.ModuleList([nn.Linear(64, 16), *(nn.Linear(16, 16) for _ in range(3))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        kept = h[:, :2].clone()
        for layer in self.middle:
            h = torch.tanh(layer(h))
        kept[:, :1] = h[:, :1]
        return kept * 2


def test_cuts_keep_an_in_place_change_with_its_value_when_they_can(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_gsched.partition.units import UnitTable

    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    part = partition(models.seeded(0, MutatesEarlierValue), 2, (x,), balance_tolerance=10.0)
    clone, setitem = part.unit_names.index("clone"), part.unit_names.index("setitem")
    assert not any(clone < cut <= setitem for cut in part.cuts), (part.cuts, part.unit_names)
    # without the rule the splitter takes the cheaper cut that separates them; the receiving
    # stage then changes its own copy of the value (a received leaf that needs a gradient
    # cannot be changed in place), and the split still equals the model
    monkeypatch.setattr(UnitTable, "separated_mutations", lambda self: [0] * (len(self) + 1))
    separated = _assert_split_exact(MutatesEarlierValue, (x,), 2, balance_tolerance=10.0)
    clone = separated.unit_names.index("clone")
    setitem = separated.unit_names.index("setitem")
    assert any(clone < cut <= setitem for cut in separated.cuts)
    assert "writable_copy" in separated.stages[1].code
    assert separated.verified is not None and separated.verified.status == "passed"


class InPlaceFirst(nn.Module):
    """Every other unit is an in-place module: with one unit per stage, half the stages start by
    changing their received input in place."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.act(layer(x))
        return x


def test_a_stage_starting_with_an_in_place_module_works_as_a_pipeline_runs_it() -> None:
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    part = _assert_split_exact(InPlaceFirst, (x,), 6, balance=[1] * 6, verify=True)
    assert all("writable_copy" in part.stages[k].code for k in (1, 3, 5))


class Opaque:
    """Not a tensor, not a pytree: a graph cannot hold it as an argument."""


class TakesObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, how: Any) -> torch.Tensor:
        return self.lin(x)


class PassesObject(nn.Module):
    """A submodule hands an object to a kept-whole module: fx cannot record that call."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        self.leaf = TakesObject()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.leaf(x, Opaque())


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = PassesObject()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_degenerate_split_hint_names_the_real_cause() -> None:
    from lightning_gsched.partition import UnbalancedPartitionWarning

    with pytest.warns(UnbalancedPartitionWarning) as record:
        partition(Outer(), 2, (torch.randn(2, 8),), leaf_modules=(TakesObject,))
    message = str(record[0].message)
    assert "'body'" in message and "passes an object a graph cannot hold" in message
    assert "tensor's values" not in message


# ---------------------------------------------------------------------------------- verify


def test_verify_names_the_stage_whose_gradient_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With Function recording switched off (the old behaviour), verify catches the inlined
    straight-through estimator: layers.0 gets a zero gradient instead of the passed one."""
    import lightning_gsched.partition.tracer as tracer

    monkeypatch.setattr(tracer, "recording_autograd_functions", contextlib.nullcontext)
    args = models.custom_function_inputs()
    with pytest.raises(SplitMismatchError) as error:
        partition(models.make_custom_functions(), 2, args)
    message = str(error.value)
    assert "gradient of 'layers.0.weight' (stage 0)" in message
    assert "first stage that differs is stage 0" in message
    assert "leaf_modules=" in message  # the fix


class SparseEmbedding(nn.Module):
    """``nn.Embedding(..., sparse=True)``: its weight's gradient is a sparse tensor; with
    ``straight_through`` a custom Function stands between it and the rest."""

    def __init__(self, straight_through: bool = False) -> None:
        super().__init__()
        self.straight_through = straight_through
        self.emb = nn.Embedding(20, 16, sparse=True)
        self.l1, self.l2 = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx).mean(1)
        if self.straight_through:
            h = models.StraightThrough.apply(h)
        return self.l2(torch.tanh(self.l1(h)))


def test_verify_compares_sparse_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sparse embedding gradient is compared as the dense tensor it stands for (comparing it
    as it is failed with aten::ne on the SparseCPU backend), and a split that gets it wrong
    (the straight-through Function inlined: a zero gradient) is still caught."""
    import lightning_gsched.partition.tracer as tracer

    idx = (torch.randint(0, 20, (4, 7), generator=torch.Generator().manual_seed(0)),)
    part = partition(models.seeded(0, SparseEmbedding), 2, idx, verify=True)
    assert part.verified is not None and part.verified.status == "passed"
    model = models.seeded(0, SparseEmbedding)
    model(*idx).sum().backward()
    assert model.emb.weight.grad is not None and model.emb.weight.grad.is_sparse

    monkeypatch.setattr(tracer, "recording_autograd_functions", contextlib.nullcontext)
    with pytest.raises(SplitMismatchError, match=r"gradient of 'emb.weight' \(stage 0\)"):
        partition(models.seeded(0, lambda: SparseEmbedding(straight_through=True)), 2, idx,
                  verify=True)


def test_verify_leaves_the_model_as_it_was() -> None:
    model = models.make_bn_cnn()
    model.train()
    args = models.bn_cnn_inputs()
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    part = partition(model, 2, args, verify=True)
    assert part.verified is not None and part.verified.status == "passed"
    assert "Verified: passed, outputs and" in part.report(units=False)
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in model.parameters())
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)


def test_verify_auto_skips_large_or_weightless_models(monkeypatch: pytest.MonkeyPatch) -> None:
    args = models.mlp_inputs()
    part = partition(models.make_mlp(), 2, args, verify=False)
    assert part.verified is not None and part.verified.status == "skipped"
    monkeypatch.setattr(verify_module, "AUTO_LIMIT_BYTES", 16)
    part = partition(models.make_mlp(), 2, args)
    assert part.verified.status == "skipped" and "verify=True" in part.verified.detail
    assert partition(models.make_mlp(), 2, args, verify=True).verified.status == "passed"
    with torch.device("meta"):
        weightless = models.MLP()
    assert "meta" in (verify_module.skip_reason(weightless, True) or "")


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_verify_rejects_other_values(value: Any) -> None:
    with pytest.raises(PartitionError, match="verify=.*'auto'"):
        partition(models.make_mlp(), 2, models.mlp_inputs(), verify=value)


def test_strategy_checks_verify_at_construction() -> None:
    from lightning_gsched import GeneralParallel

    with pytest.raises(GschedError, match="verify="):
        GeneralParallel("1f1b", verify="sometimes")
    assert GeneralParallel("1f1b", verify=False).partition_options.verify is False
