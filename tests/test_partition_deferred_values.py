"""A model built without weights whose forward needs values is refused at the split, clearly.

A deferred model (parameters on the meta device, docs/memory.md "Models larger than one rank")
is traced and sized on meta tensors, which carry shapes but no values. Two kinds of model code
cannot be split that way, and each used to fail far from its cause:

- code fx cannot trace symbolically, traced with static shapes, that builds a tensor while
  traced (a causal mask from ``torch.arange(t, device=x.device)``, transformers' mask and
  rotary positions): the split keeps it as a constant and the device it read as a literal, both
  meta, and the first real step failed on every rank ("Tensor on device meta is not on the
  expected device cpu");
- code that reads a value (``.item()``, ``bool()`` of a tensor: transformers' packed-sequence
  check): the example run failed with an ``ExampleInputError`` telling the user to fix an
  example that was fine.

Both are now a ``DeferredTraceError`` naming the module and the fix. The same models built
with weights split and compute what they compute whole (the reference, in the same test), so
the refusal is about the meta device, not the model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gsched.partition import partition
from lightning_gsched.partition.errors import DeferredTraceError


class MaskedMix(nn.Module):
    """Mixes positions under a causal mask built from the sequence length while traced."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        position = torch.arange(t, device=x.device)
        mask = (position[None, :] <= position[:, None]).to(x.dtype)  # (t, t)
        return self.proj(torch.einsum("st,btd->bsd", mask / mask.sum(-1, keepdim=True), x))


class SkipsEmptyRows(nn.Module):
    """Reads a value of its input: whether any row is all zeros (a padding check)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x.abs().sum(-1) == 0).any()):
            x = x + 1.0
        return self.proj(x)


class Net(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.mix = block()
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mix(torch.relu(self.inp(x)))))


def _deferred(block: type[nn.Module]) -> Net:
    with torch.device("meta"):
        return Net(block)


def _split_matches_whole(block: type[nn.Module], **options: object) -> None:
    torch.manual_seed(0)
    model, x = Net(block), torch.randn(2, 5, 8)
    part = partition(model, 2, (x,), balance="params", **options)
    y = x
    for stage in part.stages:
        y = stage(y)
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)


def test_a_tensor_built_while_traced_on_meta_is_refused_naming_the_module() -> None:
    _split_matches_whole(MaskedMix, static_shapes=True)  # with weights: splits and computes
    with pytest.raises(DeferredTraceError) as refused:
        partition(_deferred(MaskedMix), 2, (torch.randn(2, 5, 8),), balance="params",
                  static_shapes=True)
    message = str(refused.value)
    assert "module 'mix'" in message and "meta device" in message
    assert "leaf_modules" in message and "with its weights" in message


def test_the_symbolic_trace_of_the_same_model_without_weights_still_splits() -> None:
    """The refusal is the static-shape trace's: traced symbolically, the mask is built in the
    graph at every call, so a deferred model splits (the plain path, unchanged)."""
    part = partition(_deferred(MaskedMix), 2, (torch.randn(2, 5, 8),), balance="params")
    assert len(part.stages) == 2


def test_a_value_read_on_meta_is_refused_as_such_not_as_a_bad_example() -> None:
    _split_matches_whole(SkipsEmptyRows)  # with weights: splits and computes
    with pytest.raises(DeferredTraceError) as refused:
        partition(_deferred(SkipsEmptyRows), 2, (torch.randn(2, 5, 8),), balance="params")
    message = str(refused.value)
    assert "reads a value" in message and "'mix'" in message
    assert "example_args must be" not in message  # the example was fine
