"""A buffer a forward reassigns is state the graph drops: kept whole, or refused at the root.

Found by probing: ``self.step += 1`` on a registered buffer (a warm-up counter), or
``self.calls = self.calls + 1``, assigns a new tensor; fx records ``step + 1`` but not the
assignment, so the split computed ``step + 1`` from the buffer's traced value at every call
while the buffer stayed 0 (outputs 0.047 off one device's at the second call, ``verify``
passing: it runs once). Plain attributes were already caught (``ModuleStateChanged``); buffers
now are too. Each case runs the split and the same model whole for three calls, compared in
the test.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_gsched.partition import partition
from lightning_gsched.partition.errors import TraceFailedError


class Counted(nn.Module):
    """A layer scaled by a warm-up counter it keeps in a buffer."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.in_place = in_place
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_place:
            self.step.add_(1)
        else:
            self.step = self.step + 1
        return self.proj(x) * torch.clamp(self.step / 10.0, max=1.0)


class Net(nn.Module):
    def __init__(self, in_place: bool = False) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.counted = Counted(in_place)
        self.last = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.counted(torch.relu(self.first(x)))))


class CountsAtTheRoot(Net):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x) * self.calls


class MaskCache(nn.Module):
    """Reassigns a buffer with a mask made from sizes alone (a cache of the last length)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        self.mask = torch.ones(t, t, device=x.device).tril()
        return torch.einsum("st,btd->bsd", self.mask, x)


class CachesAMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.cache, self.last = nn.Linear(4, 4), MaskCache(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.cache(torch.relu(self.first(x))))


def _three_calls_match(model: nn.Module, x: torch.Tensor) -> None:
    whole = copy.deepcopy(model)
    part = partition(model, 2, (x,), balance="params")
    for _ in range(3):
        torch.testing.assert_close(part(x), whole(x), rtol=0, atol=0)
    for name, buffer in whole.named_buffers():  # the split's module advanced alike
        torch.testing.assert_close(dict(model.named_buffers())[name], buffer, rtol=0, atol=0)


@pytest.mark.parametrize("in_place", [False, True])
def test_a_counter_buffer_in_a_submodule_advances_as_on_one_device(in_place: bool) -> None:
    torch.manual_seed(0)
    _three_calls_match(Net(in_place), torch.randn(2, 4))


def test_a_counter_buffer_reassigned_at_the_root_is_refused_naming_the_fix() -> None:
    with pytest.raises(TraceFailedError, match=r"sets self\.calls while traced.*"
                       r"self\.step\.add_\(1\), not self\.step \+= 1"):
        partition(CountsAtTheRoot(), 2, (torch.randn(2, 4),), balance="params")


def test_a_buffer_rebuilt_from_sizes_keeps_its_module_whole() -> None:
    """Traced through, the split failed ``verify`` (the stages read the module's buffer, not
    the traced mask); its module now runs whole."""
    torch.manual_seed(0)
    _three_calls_match(CachesAMask(), torch.randn(2, 5, 4))
