"""Errors raised by the partitioner.

All of them are :class:`~lightning_gsched.errors.PartitionError` so callers can catch one type;
the subclasses exist so tests and the strategy can tell the failure modes apart. Every message
names what went wrong *and* what to change (an argument, a module, a line of the user's code).
"""

from __future__ import annotations

from lightning_gsched.errors import PartitionError

__all__ = [
    "PartitionError",
    "TraceFailedError",
    "TooManyStagesError",
    "UnknownNameError",
    "BalanceError",
    "StageInputError",
    "ModeMismatchError",
    "ExampleInputError",
    "UntracedOutputError",
    "SplitMismatchError",
]


class TraceFailedError(PartitionError):
    """torch.fx could not trace the forward (data-dependent control flow, len() of a tensor...)."""


class TooManyStagesError(PartitionError, ValueError):
    """More stages were asked for than there are units to put in them."""


class UnknownNameError(PartitionError, KeyError):
    """A split point or leaf-module name that matches nothing in the model."""

    def __str__(self) -> str:  # KeyError would repr() the message; keep it readable
        return str(self.args[0]) if self.args else ""


class BalanceError(PartitionError, ValueError):
    """``balance``, ``unit_costs`` or ``split_points`` do not describe a valid split."""


class StageInputError(PartitionError, TypeError):
    """A stage was called with inputs whose structure differs from the traced example."""


class ModeMismatchError(PartitionError):
    """The traced graph depends on ``module.training`` and the module changed mode since."""


class ExampleInputError(PartitionError):
    """The example input is not one valid call of ``forward``: a unit failed when run on it."""

    where: str = ""  # the unit that failed and its module, when a unit did


class UntracedOutputError(PartitionError):
    """The forward returns an object holding tensors that a graph cannot rebuild each call
    (transformers' ``DynamicCache``): a split would return the trace-time object."""


class SplitMismatchError(PartitionError):
    """``verify``: the split's outputs or gradients differ from the unsplit model's."""


class UnbalancedPartitionWarning(UserWarning):
    """An automatic split left a stage without parameters or with far more than its share.

    Warned at partition time with the module that caused it (usually one torch.fx could not
    trace into and kept whole), the ``file:line`` that stopped the tracer and the fix.
    """
