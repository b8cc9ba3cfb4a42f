"""Checks of ``partition()``'s arguments, shared with ``GeneralParallel``.

Why a module of its own: ``GeneralParallel(balance=..., split_points=..., leaf_modules=...)``
only partitions at the first batch, after processes have started; checking the same arguments
with the same code at construction makes a typo fail in the user's script instead. Everything
here needs neither the model nor the example: what does (names that must exist in the model,
counts that must add up to the number of traced units) is checked while partitioning.
The generic rules (positive ints, finite numbers, flags) are the schedule layer's
(:mod:`lightning_gsched.schedule.validate`), raised here as :class:`BalanceError`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from lightning_gsched.partition.errors import BalanceError, PartitionError, UnknownNameError
from lightning_gsched.schedule import validate

BALANCE_MODES = ("params", "time")


def check_num_stages(num_stages: Any) -> int:
    """A positive int; whether the model has that many units is checked after tracing."""
    return validate.positive_int("num_stages", num_stages, "2", BalanceError)


def check_balance(balance: Any, num_stages: int | None) -> str | list[int]:
    """``"params"``, ``"time"`` or one positive unit count per stage (their sum must equal the
    number of traced units, known only after tracing)."""
    if isinstance(balance, str):
        if balance not in BALANCE_MODES:
            raise BalanceError(
                f"balance={balance!r} is not one of {BALANCE_MODES} or a list of unit counts per "
                "stage; e.g. balance='params'"
            )
        return balance
    if not isinstance(balance, Sequence):
        raise validate.invalid("balance", balance, f"must be one of {BALANCE_MODES} or a list "
                               "of unit counts per stage", "'params'", BalanceError)
    counts = [validate.positive_int(f"balance[{k}]", c, "3", BalanceError)
              for k, c in enumerate(balance)]
    if num_stages is not None and len(counts) != num_stages:
        raise BalanceError(
            f"balance={list(balance)} has {len(counts)} entries but num_stages={num_stages}; give "
            "one unit count per stage (see part.report() for the units)"
        )
    return counts


def check_leaf_modules(leaf_modules: Any) -> tuple[type | str, ...]:
    """Module classes or names; a single class or name stands for a one-entry list.

    (``tuple("Block")`` would silently become five one-letter names.)
    """
    if isinstance(leaf_modules, (str, type)):
        leaf_modules = (leaf_modules,)
    if not isinstance(leaf_modules, Sequence):
        raise validate.invalid("leaf_modules", leaf_modules, "must be a list of module classes "
                               "or module names", "(Block,)", PartitionError)
    for item in leaf_modules:
        if not (isinstance(item, str) or (isinstance(item, type) and issubclass(item, nn.Module))):
            raise UnknownNameError(
                f"leaf_modules entry {item!r} is neither an nn.Module subclass nor a module "
                "name; pass module classes (e.g. leaf_modules=(Block,)) or module names (e.g. "
                "'blocks.0')."
            )
    return tuple(leaf_modules)


def check_split_points(split_points: Any, num_stages: int | None, balance: Any) -> list[str] | None:
    """None, or ``num_stages - 1`` module/unit names (a single name for two stages)."""
    if split_points is None:
        return None
    if isinstance(split_points, str):
        split_points = [split_points]
    if not isinstance(split_points, Sequence) or not all(isinstance(n, str) for n in split_points):
        raise validate.invalid("split_points", split_points, "must be a list of module names",
                               "['blocks.2']", BalanceError)
    if not isinstance(balance, str):
        raise BalanceError("Give either split_points or a list in balance, not both.")
    if num_stages is not None and len(split_points) != num_stages - 1:
        raise BalanceError(
            f"split_points has {len(split_points)} names, which makes {len(split_points) + 1} "
            f"stages, but num_stages={num_stages}; give num_stages - 1 names."
        )
    return list(split_points)


def check_unit_costs(unit_costs: Any, num_units: int | None = None) -> list[float] | None:
    """None, or one finite cost >= 0 per traced unit (``part.unit_costs`` of rank 0)."""
    if unit_costs is None:
        return None
    expected = f"{num_units} " if num_units is not None else ""
    rule = (f"unit_costs must be {expected}non-negative numbers (one per unit, as in "
            "part.unit_costs)")
    if isinstance(unit_costs, (str, bytes)) or not isinstance(unit_costs, Sequence):
        raise BalanceError(f"{rule}, got {unit_costs!r}.")
    if num_units is not None and len(unit_costs) != num_units:
        raise BalanceError(f"{rule}, got {len(unit_costs)} values.")
    return [validate.non_negative_number(f"unit_costs[{k}]", c, "0", BalanceError)
            for k, c in enumerate(unit_costs)]


def check_example(example_args: Any, example_kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) of one call of ``forward``; a lone tensor stands for ``(tensor,)``.

    A lone tensor is a common slip for ``(x,)`` (``tuple(x)`` would iterate its rows), a dict
    one for ``example_kwargs``.
    """
    if isinstance(example_args, torch.Tensor):
        example_args = (example_args,)
    if isinstance(example_args, dict):
        raise PartitionError(
            "example_args is a dict; pass keyword inputs as example_kwargs={...} and positional "
            "ones as example_args=(x,)"
        )
    if not isinstance(example_args, (tuple, list)):
        raise validate.invalid("example_args", example_args, "must be a tuple of forward's "
                               "positional arguments (one call of forward)", "(x,)",
                               PartitionError)
    if example_kwargs is not None and (not isinstance(example_kwargs, dict) or not all(
            isinstance(k, str) for k in example_kwargs)):
        raise validate.invalid("example_kwargs", example_kwargs, "must be None or a dict of "
                               "forward's keyword arguments", "{'mask': mask}", PartitionError)
    return tuple(example_args), dict(example_kwargs or {})


def check_options(balance: Any, leaf_modules: Any, split_points: Any, static_shapes: Any,
                  num_stages: int | None
                  ) -> tuple[Any, tuple[type | str, ...], list[str] | None, bool | None]:
    """The options ``GeneralParallel`` forwards to ``partition()``, normalised.

    ``num_stages`` is None when the schedule decides it at setup; the counts are then checked
    by ``partition()`` itself.
    """
    return (
        check_balance(balance, num_stages),
        check_leaf_modules(leaf_modules),
        check_split_points(split_points, num_stages, balance),
        validate.optional_flag("static_shapes", static_shapes, PartitionError),
    )
