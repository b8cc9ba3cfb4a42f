"""``SequenceInput``: cut a module's first input along the sequence, for any number of inputs.

Why a style of our own: sequence parallelism starts where the first transformer block receives
the residual stream whole (every rank of the tensor-parallel group holds the same embedding
output) and must keep only this rank's part of the sequence. torch's ``PrepareModuleInput`` does
that, but its layouts list one entry per positional input (``(Replicate(), None)`` for a block
called as ``block(x, mask)``), so a plan that names styles by string (a YAML or JSON config,
``"sequence_input"``) cannot spell it without knowing the module's signature. This style cuts
the first positional input and passes the others unchanged; the backward gathers the gradient
whole, as ``PrepareModuleInput`` with the same layouts does (it is the same redistribution:
``Replicate()`` to ``Shard(dim)`` through the public ``DTensor`` API).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_gsched.partition.errors import PartitionError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class SequenceInputError(PartitionError, TypeError):
    """The module's first positional input is not a tensor with a sequence dimension, or that
    dimension does not split into equal parts."""


class SequenceInput(ParallelStyle):
    """Before the module's forward, its first positional input (a tensor every rank of the
    group holds whole, or a ``DTensor``) becomes this rank's part along ``dim`` as a plain
    tensor; other inputs pass unchanged."""

    def __init__(self, dim: int = 1) -> None:
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(partial(_cut_first_input, device_mesh, self.dim))
        return module

    def __repr__(self) -> str:
        return f"SequenceInput(dim={self.dim})"


def _cut_first_input(mesh: DeviceMesh, dim: int, module: nn.Module,
                     args: tuple[Any, ...]) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() <= dim:
        first = type(args[0]).__name__ if args else "nothing"
        raise SequenceInputError(
            f"SequenceInput on {type(module).__name__} cuts the first positional input along "
            f"dimension {dim}, but the module got {first}"
            + (f" of shape {tuple(args[0].shape)}" if args and isinstance(args[0], torch.Tensor)
               else "")
            + ": style the module whose first input is the (batch, sequence, ...) activation")
    x, parts = args[0], mesh.size()
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
