"""B then W (runtime/split_backward.py) equals one ordinary backward, on the modules users have.

Every check runs the same module twice from the same weights on the same inputs: once with
``torch.autograd.backward`` per microbatch (the reference), once with ``backward_input`` per
microbatch and the pending W's run later in another order. Tensors are float64: the only
difference allowed is the order in which W adds a parameter's contributions from several
starting points (module docstring), which float64 rounds at ~1e-16 relative; rtol 1e-12 leaves
four orders of magnitude for sums of a few hundred terms.
"""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Callable

import pytest
import torch
from torch import nn

from lightning_gsched.errors import RuntimeConfigError
from lightning_gsched.runtime.split_backward import backward_input

RTOL, ATOL = 1e-12, 1e-14


class UsedTwice(nn.Module):
    """One Linear applied twice, a raw weight, a bias used twice, an output of parameters alone."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8))
        self.b = nn.Parameter(torch.randn(8))
        self.unused = nn.Parameter(torch.randn(3))
        self.frozen = nn.Parameter(torch.randn(8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(torch.tanh(self.lin(x))) + self.frozen
        h = h.view(-1, 8).transpose(0, 1).transpose(0, 1)
        h = h.clone().add_(self.b)  # in place on a non-leaf
        return h @ self.w + self.b, self.b * 2  # second output: parameters only


class Embedded(nn.Module):
    """A first stage: integer inputs need no gradient, so W does the whole weight backward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(ids))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.attn(x, x, x, need_weights=False)[0])


class LastStage(nn.Module):
    """The last stage: a scalar loss is the root (gradient of ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        target = torch.arange(x.shape[0]) % 5
        return nn.functional.cross_entropy(self.head(x), target)


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "used_twice": (UsedTwice, lambda: torch.randn(4, 8)),
    "embedding": (Embedded, lambda: torch.randint(0, 10, (4,))),
    "mlp_layernorm": (lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16),
                                            nn.Linear(16, 8)), lambda: torch.randn(4, 8)),
    "attention": (Attention, lambda: torch.randn(2, 5, 8)),
    "encoder_layer": (lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
                      lambda: torch.randn(2, 5, 8)),
    "conv_batchnorm": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                                             nn.Flatten(), nn.Linear(64, 3)),
                       lambda: torch.randn(2, 3, 6, 6)),
    "last_stage_loss": (LastStage, lambda: torch.randn(6, 8)),
}


def _outputs(module: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], list | None]:
    out = module(x)
    outs = list(out) if isinstance(out, tuple) else [out]
    if outs[0].dim() == 0:  # a loss: the root's gradient is ones
        return outs, None
    grads: list = [torch.full_like(o, 0.5) + 0.01 * i for i, o in enumerate(outs)]
    if len(grads) > 1:
        grads[-1] = None  # an output without an incoming gradient
    return outs, grads


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.clone().requires_grad_(x.is_floating_point())


@pytest.fixture(autouse=True)
def _float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


@pytest.mark.parametrize("case", sorted(CASES))
def test_b_then_w_equals_one_backward(case: str) -> None:
    make, data = CASES[case]
    torch.manual_seed(0)
    reference = make()
    split = copy.deepcopy(reference)
    xs = [data() for _ in range(3)]

    want_inputs = []
    for x in xs:
        leaf = _leaf(x)
        outs, grads = _outputs(reference, leaf)
        pairs = [(o, g) for o, g in zip(outs, grads or [None] * len(outs), strict=True)
                 if grads is None or g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs] if grads else None)
        want_inputs.append(leaf.grad)

    pending, got_inputs = [], []
    for x in xs:
        leaf = _leaf(x)
        outs, grads = _outputs(split, leaf)
        input_grads, work = backward_input(outs, grads, [leaf], list(split.parameters()))
        assert all(p.grad is None for p in split.parameters()), "B touched a weight gradient"
        assert leaf.grad is None  # returned, not accumulated
        pending.append(work)
        got_inputs.append(input_grads[0])
    for work in (pending[1], pending[2], pending[0]):  # W in another order than B
        work.run()

    for want, got in zip(want_inputs, got_inputs, strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for (name, a), (_, b) in zip(reference.named_parameters(), split.named_parameters(),
                                 strict=True):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=RTOL, atol=ATOL, msg=name)


def test_w_accumulates_in_place_and_fires_post_accumulate_hooks() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    reference = copy.deepcopy(module)
    for p in module.parameters():
        p.grad = torch.full_like(p, 0.25)  # an earlier microbatch's gradient, in a buffer
    for p in reference.parameters():
        p.grad = torch.full_like(p, 0.25)
    storage = {id(p): p.grad.data_ptr() for p in module.parameters()}
    fired: dict[int, int] = {}
    for p in module.parameters():
        p.register_post_accumulate_grad_hook(lambda q: fired.__setitem__(id(q), fired.get(id(q), 0) + 1))
    x = torch.randn(4, 8)
    reference(_leaf(x)).sum().backward()
    leaf = _leaf(x)
    _, work = backward_input([module(leaf).sum()], None, [leaf], list(module.parameters()))
    assert not fired
    work.run()
    assert fired == {id(p): 1 for p in module.parameters()}
    for a, b in zip(reference.parameters(), module.parameters(), strict=True):
        assert b.grad.data_ptr() == storage[id(b)]
        torch.testing.assert_close(b.grad, a.grad, rtol=RTOL, atol=ATOL)


def test_w_runs_once() -> None:
    lin = nn.Linear(4, 4)
    x = _leaf(torch.randn(2, 4))
    _, work = backward_input([lin(x).sum()], None, [x], list(lin.parameters()))
    work.run()
    with pytest.raises(RuntimeConfigError, match="already accumulated"):
        work.run()


def test_the_graph_is_released_after_w() -> None:
    """After W nothing keeps the forward's saved tensors alive."""

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x, w = ctx.saved_tensors
            return grad * w, (grad * x).sum(0)

    w = nn.Parameter(torch.randn(8))
    x = _leaf(torch.randn(4, 8))
    hidden = torch.tanh(x) * 3  # saved by Keep; only the graph refers to it afterwards
    probe = weakref.ref(hidden)
    out = Keep.apply(hidden, w)
    del hidden
    grads, work = backward_input([out.sum()], None, [x], [w])
    del out
    gc.collect()
    assert probe() is not None  # W still needs it
    work.run()
    del work
    gc.collect()
    assert probe() is None
    assert w.grad is not None and grads[0] is not None
