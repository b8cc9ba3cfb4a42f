"""Sequence-parallel styles for a module's first input, for any number of inputs: cut it along
the sequence (``SequenceInput``) or gather it whole once (``SequenceGather``).

Why a style of our own: sequence parallelism starts where the first transformer block receives
the residual stream whole (every rank of the tensor-parallel group holds the same embedding
output) and must keep only this rank's part of the sequence. torch's ``PrepareModuleInput`` does
that, but its layouts list one entry per positional input (``(Replicate(), None)`` for a block
called as ``block(x, mask)``), so a plan that names styles by string (a YAML or JSON config,
``"sequence_input"``) cannot spell it without knowing the module's signature. This style cuts
the first input and passes the others unchanged (the first positional input, or, when the call
passes none, the forward's first parameter by keyword: transformers' decoder layer calls
``self.self_attn(hidden_states=hidden_states, ...)``, which torch's ``PrepareModuleInput`` sees
only through ``input_kwarg_layouts`` naming the keyword); the backward gathers the gradient
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

import inspect
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_gsched.partition.errors import PartitionError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class SequenceInputError(PartitionError, TypeError):
    """The module's first input is not a tensor with a sequence dimension, or that dimension
    does not split into equal parts."""


def _first_parameter(module: nn.Module) -> str | None:
    """The name of the first parameter of ``module.forward`` that a call can pass by keyword
    (``hidden_states`` for transformers' attention), or None (``forward(*args)``, no
    signature)."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    if parameters and parameters[0].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                             inspect.Parameter.KEYWORD_ONLY):
        return parameters[0].name
    return None


def _first_input(style: str, verb: str, dim: int, first: str | None, module: nn.Module,
                 args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[torch.Tensor, str | None]:
    """The module's first input and where it came from: the keyword it was passed by (``first``,
    the forward's first parameter, :func:`_first_parameter`, when the call passes no positional
    input: transformers' decoder layer calls ``self.self_attn(hidden_states=..., ...)``), or None
    for the first positional input."""
    key = None if args else first
    if args:
        value, seen = args[0], "the first positional input"
    elif key is not None and key in kwargs:
        value, seen = kwargs[key], f"the first input (keyword {key!r})"
    else:
        keywords = ", ".join(repr(k) for k in kwargs) or "none"
        expected = (f"positionally or as {key!r}, the first parameter of its forward"
                    if key is not None else "positionally (its forward names no first "
                    "parameter to take by keyword)")
        raise SequenceInputError(
            f"{style} on {type(module).__name__} {verb} its first input along dimension {dim}, "
            f"taken {expected}, but the call passes no positional input and keyword arguments "
            f"{keywords}: style the module whose first input is the (batch, sequence, ...) "
            "activation")
    if not isinstance(value, torch.Tensor) or value.dim() <= dim:
        raise SequenceInputError(
            f"{style} on {type(module).__name__} {verb} {seen} along dimension {dim}, but the "
            f"module got {type(value).__name__}"
            + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "")
            + ": style the module whose first input is the (batch, sequence, ...) activation")
    return value, key


def _replaced(args: tuple[Any, ...], kwargs: dict[str, Any], key: str | None,
              value: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if key is None:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, key: value}


def _gather_first_input(mesh: DeviceMesh, dim: int, first: str | None, module: nn.Module,
                        args: tuple[Any, ...], kwargs: dict[str, Any]
                        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    x, key = _first_input("SequenceGather", "gathers", dim, first, module, args, kwargs)
    part = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (Shard(dim),),
                                                               run_check=False)
    return _replaced(args, kwargs, key, part.redistribute(mesh, (Replicate(),)))


def _cut_first_input(mesh: DeviceMesh, dim: int, first: str | None, module: nn.Module,
                     args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    x, key = _first_input("SequenceInput", "cuts", dim, first, module, args, kwargs)
    parts = mesh.size()
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
    return _replaced(args, kwargs, key, whole.redistribute(mesh, (Shard(dim),)).to_local())


class _FirstInputStyle(ParallelStyle):
    """A style whose whole work is one forward pre-hook on the module's first input along
    ``dim`` (:attr:`hook`, the subclass's: cut or gather): the first positional input, or,
    when the call passes none, the forward's first parameter passed by keyword."""

    hook: Callable[[DeviceMesh, int, str | None, nn.Module, tuple[Any, ...], dict[str, Any]],
                   tuple[tuple[Any, ...], dict[str, Any]]]

    def __init__(self, dim: int = 1) -> None:
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # the forward's first parameter read once here, not from its signature at every call
        module.register_forward_pre_hook(
            partial(type(self).hook, device_mesh, self.dim, _first_parameter(module)),
            with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim})"


class SequenceInput(_FirstInputStyle):
    """Before the module's forward, its first input (positional, or its forward's first
    parameter by keyword; a tensor every rank of the group holds whole, or a ``DTensor``)
    becomes this rank's part along ``dim`` as a plain tensor; other inputs pass unchanged."""

    hook = staticmethod(_cut_first_input)


class SequenceGather(_FirstInputStyle):
    """Before the module's forward, its first input (positional, or its forward's first
    parameter by keyword: transformers' attention is called ``self_attn(hidden_states=...)``;
    this rank's part of the sequence along ``dim``, plain or a ``DTensor``) becomes the whole
    sequence, a ``DTensor`` replicated over the group, for the column-wise layers inside; other
    inputs pass unchanged."""

    hook = staticmethod(_gather_first_input)
