"""What torch.fx would run once at trace time and drop from the split: kept whole instead.

A forward that draws from Python's ``random`` or numpy's global generator (a layer drop decided
by ``random.random()`` would be frozen for the whole run; lightning_gsched/host_random.py), sets
its module's plain attributes (a counter, a flag, a tensor made from the data;
``partition/preserve.py``), or switches the grad mode (``torch.no_grad()``: the split would
compute with gradients; ``partition/grad_mode.py``). The module that does it is kept whole and
runs for real at every call; in the root forward, the trace is refused naming it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from lightning_gsched.host_random import host_states, seed_host
from lightning_gsched.partition import partition
from lightning_gsched.partition.errors import PartitionError


class PythonLayerDrop(nn.Module):
    """Skipped in training when Python's generator says so (the form of many layer drops)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and random.random() < 0.5:
            return x
        return torch.tanh(self.layer(x))


class NumpyLayerDrop(PythonLayerDrop):
    """The same with numpy's global generator (transformers' wav2vec2 encoder draws so)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and np.random.random() < 0.5:
            return x
        return torch.tanh(self.layer(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.python_drop = PythonLayerDrop()
        self.numpy_drop = NumpyLayerDrop()
        self.last = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.numpy_drop(self.python_drop(self.first(x))))


class DrawsAtTheRoot(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if random.uniform(0, 1) < 0.5:
            x = 2 * x
        return super().forward(x)


def test_a_module_that_draws_runs_whole_and_draws_at_every_call() -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8)
    seed_host(123)
    before = host_states()
    part = partition(model, 2, example_args=(x,), verify=True)
    after = host_states()
    assert after[0] == before[0] and all(  # tracing and the check left both streams as found
        np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
        for a, b in zip(after[1], before[1], strict=True))
    report = part.report()
    for name, call in (("python_drop", "random.random()"),
                       ("numpy_drop", "numpy.random.random()")):
        assert f"{name}: " in report and call in report, report
    outputs = []
    for seed in range(8):  # each split step draws as the model does, and the draws matter
        seed_host(seed)
        want = model(x)
        seed_host(seed)
        got = part(x)
        assert torch.equal(got, want), seed
        outputs.append(got)
    distinct = {tuple(o.flatten().tolist()) for o in outputs}
    assert len(distinct) > 1, "every step dropped the same layers: the draw was frozen"


def test_a_draw_in_the_root_forward_is_refused_naming_it() -> None:
    with pytest.raises(PartitionError, match=r"random\.uniform\(\) was called while"):
        partition(DrawsAtTheRoot(), 2, example_args=(torch.randn(4, 8),))


def test_draws_outside_the_trace_and_in_eval_are_untouched() -> None:
    """The guard is only up while the tracer runs: afterwards the module-level functions are
    the originals, and a model in eval mode (no draw) is traced into as before."""
    originals = (random.random, np.random.random)
    model = Net().eval()
    part = partition(model, 2, example_args=(torch.randn(4, 8),))
    assert (random.random, np.random.random) == originals
    assert "kept whole" not in part.report()


class Counted(nn.Module):
    """Doubles its input from its third call on: state the graph would not keep."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 2:
            x = 2 * x
        return self.layer(x)


class CountingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.counted = Counted()
        self.last = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.counted(self.first(x)))


class CountsAtTheRoot(CountingNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = getattr(self, "steps", 0) + 1
        return super().forward(x)


def test_a_module_that_sets_its_attributes_runs_whole_and_keeps_counting() -> None:
    """``self.calls += 1`` in a traced forward would stay at its traced value in the split (a
    branch on it never flips): the module is kept whole, and partitioning leaves it uncounted."""
    torch.manual_seed(0)
    model, x = CountingNet(), torch.randn(4, 8)
    part = partition(model, 2, example_args=(x,))
    assert model.counted.calls == 0, "tracing and the example run left the counter as found"
    report = part.report()
    assert "counted: " in report and "self.calls" in report, report
    twin = CountingNet()
    twin.load_state_dict(model.state_dict())
    for call in range(4):  # the split and an unsplit twin count alike; from call 3 x doubles
        assert torch.equal(part(x), twin(x)), call
    assert model.counted.calls == twin.counted.calls == 4


class HooksOnce(nn.Module):
    """Hooks its layers at its first call and marks it in an attribute, as transformers'
    output capturing does for ``output_hidden_states``: the hooks collect every layer's
    output."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "hooked", False):
            for layer in self.layers:
                layer.register_forward_hook(lambda m, args, out: self.seen.append(out))
            self.hooked = True
        self.seen: list[torch.Tensor] = []
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return torch.stack(self.seen).mean(0)


class CapturingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.capturing, self.last = nn.Linear(8, 8), HooksOnce(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.capturing(self.first(x)))


def test_hooks_a_module_installs_once_are_not_installed_again_by_each_run() -> None:
    """The runs of partition() restored the module's "hooked" flag but kept the hooks it had
    installed, so each later run installed them again and every layer's output was collected
    several times: a BERT pooling output_hidden_states failed verify even at S=1 (found by
    probing). Now the hooks are restored with the attributes."""
    torch.manual_seed(0)
    model, x = CapturingNet(), torch.randn(4, 8)
    twin = CapturingNet()
    twin.load_state_dict(model.state_dict())
    part = partition(model, 2, example_args=(x,))  # verify compares with the unsplit model
    assert all(not layer._forward_hooks for layer in model.capturing.layers)
    for call in range(2):
        torch.testing.assert_close(part(x), twin(x), rtol=0, atol=0, msg=str(call))


def test_a_root_forward_that_sets_its_attributes_is_refused_naming_them() -> None:
    with pytest.raises(PartitionError, match=r"sets self\.steps while traced"):
        partition(CountsAtTheRoot(), 2, example_args=(torch.randn(4, 8),))


class FirstBatchOffset(nn.Module):
    """Keeps the first batch's mean and subtracts it from every later batch (a data-dependent
    initialisation without a flag): a tensor attribute made from the input's values."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.offset: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset is None:
            self.offset = x.detach().mean(0)
        return self.layer(x - self.offset)


class SizedMask(nn.Module):
    """Keeps a mask made from the input's size only: the graph remakes it alike every call."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = torch.arange(x.size(1), device=x.device)
        self.mask = (index[:, None] >= index[None, :]).to(x.dtype)
        return self.layer(x @ self.mask)


class CachingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.offset = FirstBatchOffset()
        self.sized = SizedMask()
        self.last = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.sized(self.offset(self.first(x))))


def test_a_tensor_kept_from_the_data_keeps_its_module_whole_one_from_sizes_does_not() -> None:
    torch.manual_seed(0)
    model = CachingNet()
    batches = [torch.randn(4, 8) for _ in range(3)]
    part = partition(model, 2, example_args=(batches[0],))
    report = part.report()
    assert "offset: " in report and "self.offset" in report, report
    assert "sized: " not in report, report  # traced into: its mask comes from sizes only
    assert model.offset.offset is None, "partitioning left the attribute as it found it"
    twin = CachingNet()
    twin.load_state_dict(model.state_dict())
    for b, x in enumerate(batches):  # the first batch's mean is kept by both
        assert torch.equal(part(x), twin(x)), b


class MomentumTarget(nn.Module):
    """A stop-gradient branch: its layer is never trained and sends no gradient back."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.layer(h)


class TargetNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.target = MomentumTarget()
        self.online = nn.Linear(8, 8)
        self.last = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        return self.last(self.online(h) + self.target(h))


class NoGradAtTheRoot(TargetNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x = self.first(x)
        return self.last(x)


def test_a_module_that_turns_gradients_off_runs_whole_and_gets_none() -> None:
    """Even unchecked (``verify=False``, as for a model above verify's size limit), the split
    gives the stop-gradient branch no gradient and the layer before it the model's."""
    torch.manual_seed(0)
    model, x = TargetNet(), torch.randn(4, 8)
    part = partition(model, 2, example_args=(x,), verify=False)
    report = part.report()
    assert "target: " in report and "turns gradients off" in report, report
    part(x).square().sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and not any(n.startswith("target.") for n in got), got
    for name, grad in want.items():
        assert torch.equal(got[name], grad), name


def test_a_grad_mode_switch_in_the_root_forward_is_refused_naming_it() -> None:
    with pytest.raises(PartitionError, match="turns gradients off"):
        partition(NoGradAtTheRoot(), 2, example_args=(torch.randn(4, 8),))


def test_the_switch_is_found_when_partition_runs_without_gradients() -> None:
    """A caller under ``no_grad`` (where the forward's own ``no_grad`` changes nothing) still
    gets the module kept whole: every switch counts, not only one that changes the mode."""
    with torch.no_grad():
        part = partition(TargetNet(), 2, example_args=(torch.randn(4, 8),), verify=False)
        assert not torch.is_grad_enabled(), "the caller's mode is as it set it"
    assert "target: " in part.report() and "turns gradients off" in part.report()


# Draws that bypass the module-level functions: found by their generator's state


from random import random as imported_random  # noqa: E402 - the form under test

GLOBAL_DRAWS = random.Random(7)  # a module-level generator object a forward names


class ImportedDraw(PythonLayerDrop):
    """Draws through a function bound at import (``from random import random``): the
    module-level guard never sees the call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and imported_random() < 0.5:
            return x
        return torch.tanh(self.layer(x))


class HeldGenerator(PythonLayerDrop):
    """Draws from a numpy Generator it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = np.random.default_rng(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.rng.random() < 0.5:
            return x
        return torch.tanh(self.layer(x))


def helper_draw() -> float:
    """A helper of this file that draws from its global generator."""
    return GLOBAL_DRAWS.random()


class GlobalGenerator(PythonLayerDrop):
    """Draws from a ``random.Random`` of its own file's globals, through a helper."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and helper_draw() < 0.5:
            return x
        return torch.tanh(self.layer(x))


class UnguardedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.imported = ImportedDraw()
        self.held = HeldGenerator()
        self.named = GlobalGenerator()
        self.last = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.named(self.held(self.imported(self.first(x)))))


class ImportedDrawAtTheRoot(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if imported_random() < 0.5:
            x = 2 * x
        return super().forward(x)


@pytest.mark.parametrize("static", [False, True], ids=["symbolic", "static"])
def test_draws_that_bypass_the_guard_keep_their_module_whole(static: bool) -> None:
    torch.manual_seed(0)
    model, x = UnguardedNet(), torch.randn(4, 8)
    seed_host(5)
    states = (random.getstate(), model.held.rng.bit_generator.state, GLOBAL_DRAWS.getstate())
    part = partition(model, 2, example_args=(x,), verify=True, static_shapes=static)
    # tracing and the check left every generator as found
    assert states == (random.getstate(), model.held.rng.bit_generator.state,
                      GLOBAL_DRAWS.getstate())
    report = part.report()
    for name, source in (("imported", "global generator"), ("held", "self.rng"),
                         ("named", "the global 'GLOBAL_DRAWS'")):
        assert f"{name}: " in report and source in report, report
    outputs = []
    for seed in range(8):
        for run in ("model", "split"):
            seed_host(seed)
            model.held.rng = np.random.default_rng(seed)
            GLOBAL_DRAWS.seed(seed)
            out = model(x) if run == "model" else part(x)
            if run == "model":
                want = out
        assert torch.equal(out, want), seed
        outputs.append(out)
    assert len({tuple(o.flatten().tolist()) for o in outputs}) > 1, "the draws were frozen"


def test_an_imported_draw_in_the_root_forward_is_refused_naming_it() -> None:
    with pytest.raises(PartitionError, match="drew from Python's or numpy's global generator"):
        partition(ImportedDrawAtTheRoot(), 2, example_args=(torch.randn(4, 8),))


# A forward that sets its children's attributes


class Scaled(nn.Module):
    """Multiplies by a Python number its parent sets: a constant of the traced graph."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * self.scale


class Warming(nn.Module):
    """Raises its child's scale at every call (a warm-up written on the child)."""

    def __init__(self) -> None:
        super().__init__()
        self.child = Scaled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.child.scale = min(self.child.scale + 0.5, 3.0)
        return self.child(x)


class WarmingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.warming = Warming()
        self.counted = Counted()  # a leaf below: its own counter, run for real under static
        self.last = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.counted(self.warming(self.first(x))))


@pytest.mark.parametrize("static", [False, True], ids=["symbolic", "static"])
def test_a_forward_that_sets_a_childs_attribute_keeps_itself_whole(static: bool) -> None:
    """The parent that writes the child's attribute is the module kept whole (the child alone
    would read a frozen constant); a leaf that sets its own attributes while the example runs
    for real (static shapes) does not make its parent look like one that sets them."""
    torch.manual_seed(0)
    model, x = WarmingNet(), torch.randn(4, 8)
    part = partition(model, 2, example_args=(x,), static_shapes=static,
                     leaf_modules=(Counted,))
    assert (model.warming.child.scale, model.counted.calls) == (1.0, 0), "left as found"
    report = part.report()
    assert "warming: " in report and "self.child.scale" in report, report
    assert "counted: " not in report and "(root)" not in report, report
    twin = WarmingNet()
    twin.load_state_dict(model.state_dict())
    for call in range(5):  # the scale grows 1.5, 2.0, ... in both; from call 3 x doubles
        assert torch.equal(part(x), twin(x)), call
    assert model.warming.child.scale == twin.warming.child.scale == 3.0
