"""Sequence-parallel styles for a module's first input, for any number of inputs: cut it along
the sequence (``SequenceInput``) or gather it whole once (``SequenceGather``).

Why a style of our own: sequence parallelism starts where the first transformer block receives
the residual stream whole (every rank of the tensor-parallel group holds the same embedding
output) and must keep only this rank's part of the sequence. torch's ``PrepareModuleInput`` does
that, but its layouts list one entry per positional input (``(Replicate(), None)`` for a block
called as ``block(x, mask)``), so a plan that names styles by string (a YAML or JSON config,
``"sequence_input"``) cannot spell it without knowing the module's signature. This style cuts
the first positional input and passes the others unchanged; the backward gathers the gradient
whole, as ``PrepareModuleInput`` with the same layouts does (it is the same redistribution:
``Replicate()`` to ``Shard(dim)`` through the public ``DTensor`` API).

``SequenceGather`` (``"sequence_gather"``) is the way back inside a block, once for several
readers: on a module whose column-wise layers read one sequence-split input (an attention's q,
k and v, styled plain ``"colwise"``), the input is gathered once and handed on as a replicated
``DTensor``, as torchtitan's ``PrepareModuleInput(..., desired_input_layouts=(Replicate(),
None))`` does. ``"colwise_from_sequence"`` on each of the three instead gathers three times and
autograd keeps three gathered copies for the weight gradients (docs/benchmarks.md, the
``memory[...+sp]`` rows); here the layers share one, and their input gradients, summed as
partial ``DTensor`` s, are reduce-scattered back to the sequence split once.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_gsched.partition.errors import PartitionError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class SequenceInputError(PartitionError, TypeError):
    """The module's first positional input is not a tensor with a sequence dimension, or that
    dimension does not split into equal parts."""


def _first_input(style: str, verb: str, dim: int, module: nn.Module,
                 args: tuple[Any, ...]) -> torch.Tensor:
    if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() <= dim:
        first = type(args[0]).__name__ if args else "nothing"
        raise SequenceInputError(
            f"{style} on {type(module).__name__} {verb} the first positional input along "
            f"dimension {dim}, but the module got {first}"
            + (f" of shape {tuple(args[0].shape)}" if args and isinstance(args[0], torch.Tensor)
               else "")
            + ": style the module whose first input is the (batch, sequence, ...) activation")
    return args[0]


def _gather_first_input(mesh: DeviceMesh, dim: int, module: nn.Module,
                        args: tuple[Any, ...]) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    x = _first_input("SequenceGather", "gathers", dim, module, args)
    part = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (Shard(dim),),
                                                               run_check=False)
    return (part.redistribute(mesh, (Replicate(),)), *args[1:])


def _cut_first_input(mesh: DeviceMesh, dim: int, module: nn.Module,
                     args: tuple[Any, ...]) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    x, parts = _first_input("SequenceInput", "cuts", dim, module, args), mesh.size()
    if x.shape[dim] % parts:
        # torch's sequence-sharded styles take every rank's part to be shape[dim] / T long (the
        # next gather would send parts of different sizes: gloo aborts the process)
        raise SequenceInputError(
            f"SequenceInput on {type(module).__name__} cuts dimension {dim} of its first input "
            f"into tensor_parallel_size={parts} equal parts, but it has {x.shape[dim]} "
            f"(shape {tuple(x.shape)}): use a sequence length divisible by {parts} (pad the "
            "batch), or a tensor_parallel_size that divides it")
    whole = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (Replicate(),),
                                                                run_check=False)
    return (whole.redistribute(mesh, (Shard(dim),)).to_local(), *args[1:])


class _FirstInputStyle(ParallelStyle):
    """A style whose whole work is one forward pre-hook on the module's first positional input
    along ``dim`` (:attr:`hook`, the subclass's: cut or gather)."""

    hook: Callable[[DeviceMesh, int, nn.Module, tuple[Any, ...]], tuple[Any, ...]]

    def __init__(self, dim: int = 1) -> None:
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(partial(type(self).hook, device_mesh, self.dim))
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim})"


class SequenceInput(_FirstInputStyle):
    """Before the module's forward, its first positional input (a tensor every rank of the
    group holds whole, or a ``DTensor``) becomes this rank's part along ``dim`` as a plain
    tensor; other inputs pass unchanged."""

    hook = staticmethod(_cut_first_input)


class SequenceGather(_FirstInputStyle):
    """Before the module's forward, its first positional input (this rank's part of the
    sequence along ``dim``, plain or a ``DTensor``) becomes the whole sequence, a ``DTensor``
    replicated over the group, for the column-wise layers inside; other inputs pass
    unchanged."""

    hook = staticmethod(_gather_first_input)
