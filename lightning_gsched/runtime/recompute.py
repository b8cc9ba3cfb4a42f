"""Activation checkpointing of a stage: what ``F s b`` keeps, and how ``B s b`` replays it.

A checkpointed stage's ``F`` keeps only its inputs and the random generators' state instead of
its activations; ``B`` runs the forward again (charged to B by the planner), on the same inputs,
generators restored, inside the same ``forward_context``, so the replay is bit-exact; the ambient
random stream is forked around it, so later draws are as without checkpointing. A stage that
modifies an input in place (torch allows it without a graph) is refused (``check_inputs``).

Without a graph no output requires grad, yet the next stage must know which inputs need one:
:func:`flag_outputs` marks every floating-point output the stage computed, when it has a trainable
parameter or an input requiring grad, as the reentrant ``torch.utils.checkpoint`` does. Where the
graph would not have (a float computed from a buffer alone), the replay drops the extra gradient:
extra work, never a different result.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch.utils import _pytree as pytree

from lightning_gsched.errors import RuntimeConfigError
from lightning_gsched.runtime.split_backward import PendingWeightGrad, backward_input


def cuda_devices(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Indices of the CUDA devices the tensors live on (sorted, once each)."""
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


class RngState:
    """The CPU generator's state and the CUDA generators' of ``devices``, taken now (the default
    generators only, as ``torch.utils.checkpoint`` preserves them)."""

    def __init__(self, devices: Sequence[int] = ()) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = [(d, torch.cuda.get_rng_state(d)) for d in devices]

    @contextmanager
    def restored(self) -> Iterator[None]:
        """Inside: the generators as they were when taken; afterwards: as before entering."""
        devices = [d for d, _ in self.cuda]
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(self.cpu)
            for device, state in self.cuda:
                torch.cuda.set_rng_state(state, device)
            yield


@dataclass
class Replay:
    """What ``B s b`` needs to run a checkpointed ``F s b`` again."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: RngState
    versions: list[tuple[torch.Tensor, int]]  # every distinct input tensor and its version at F
    out_leaves: list[torch.Tensor] = field(default_factory=list)  # last stage: what loss_fn saw

    @classmethod
    def take(cls, args: tuple[Any, ...], kwargs: dict[str, Any], stage_devices: Sequence[int]
             ) -> "Replay":
        leaves = pytree.tree_leaves((args, kwargs))
        tensors = list({id(t): t for t in leaves if isinstance(t, torch.Tensor)}.values())
        devices = sorted({*stage_devices, *cuda_devices(tensors)})
        return cls(args, kwargs, RngState(devices), [(t, t._version) for t in tensors])

    def check_inputs(self, s: int, b: int) -> None:
        """Refuse a replay from inputs modified in place since F took them."""
        for i, (tensor, version) in enumerate(self.versions):
            if tensor._version != version:
                raise RuntimeConfigError(
                    f"input tensor {i} (shape {tuple(tensor.shape)}) of stage {s} was modified "
                    f"in place after F s{s} b{b} took it, so B s{s} b{b} cannot recompute the "
                    "stage's forward from it (activation checkpointing). Make the stage leave "
                    "its inputs unchanged (e.g. x = x + y instead of x += y, or a ReLU without "
                    "inplace=True), or turn checkpoint_activations off for this stage.")


def flag_outputs(tensors: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                 differentiable: bool) -> list[torch.Tensor]:
    """The outputs of a forward run without a graph, flagged for the next stage: when
    ``differentiable``, a computed floating-point (or complex) output becomes a detached alias
    requiring grad (an alias, so a buffer or user tensor returned as output is never changed)."""
    given = {id(t) for t in inputs}
    flagged = []
    for t in tensors:
        computed = not t.requires_grad and id(t) not in given
        if differentiable and computed and (t.is_floating_point() or t.is_complex()):
            t = t.detach().requires_grad_()
        flagged.append(t)
    return flagged


def loss_gradients(loss: torch.Tensor, leaves: Sequence[torch.Tensor],
                   params: Sequence[torch.Tensor], split: bool,
                   ) -> tuple[list[torch.Tensor | None], PendingWeightGrad | None]:
    """Backpropagate the last stage's loss to the leaves ``loss_fn`` saw (its own small graph).

    Ordinary backward: ``loss.backward()``, so a parameter the loss code reads accumulates as
    without checkpointing. Split backward: the loss graph's own B, whose weight part runs first
    in the stage's W. A parameter reached both through the loss code and the stage then
    accumulates its two terms one after the other instead of their sum: float rounding.
    """
    if not split:
        if loss.requires_grad:
            loss.backward()  # type: ignore[no-untyped-call]  # Tensor.backward: unannotated
        return [t.grad if t.requires_grad else None for t in leaves], None
    return backward_input([loss], None, leaves, params)
