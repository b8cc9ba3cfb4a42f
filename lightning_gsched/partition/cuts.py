"""Choose where to cut: explicit split points, explicit stage sizes, or balanced costs.

Balanced splitting (``"params"``, ``"time"`` or given ``unit_costs``):

1. ``best`` = the smallest achievable cost of the most expensive stage
   (:func:`.linear.bottleneck`).
2. Every split whose most expensive stage costs at most ``best * (1 + tolerance)`` is acceptable.
   Among those, :func:`.linear.cheapest_split` prefers, in this order: cuts that keep every
   in-place change in the stage of the value it changes (:meth:`.UnitTable.separated_mutations`),
   cuts at shallow module nesting (between top-level blocks rather than inside one, see
   :meth:`.UnitTable.cut_depth`), fewer bytes handed between stages on the example input, fewer
   values handed over, and then cuts closest to the equal-cost positions (the most even stages).

Additionally, no stage may cost less than a quarter of an even share (``total / num_stages``)
when such a split exists, so surplus stages split blocks instead of holding a lone ``getitem``.

So a residual block is cut in the middle only when the blocks cannot be balanced within the
tolerance, and then at the point where the least data is live. If every unit costs 0 (no
parameters), units are counted instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch.fx as fx
from torch import nn

from lightning_gsched.partition.errors import BalanceError, TooManyStagesError
from lightning_gsched.partition.hints import finer_trace_hint, leaf_origin
from lightning_gsched.partition.linear import bottleneck, cheapest_split
from lightning_gsched.partition.names import unknown_name_error
from lightning_gsched.partition.tracer import target_name
from lightning_gsched.partition.units import UnitTable

Number = float

# Stages may not cost less than this fraction of an even share (total / num_stages) when some
# split allows it: otherwise the nesting preference would rather create near-empty stages (cut
# between trivial top-level ops such as ``size``/``getitem``) than cut inside a block.
UNDERFULL_FLOORS = (0.25, 0.0)


@dataclass(frozen=True)
class CutPlan:
    """Where the stages start (``cuts``) and why."""

    cuts: tuple[int, ...]
    how: str  # "balanced", "sizes" or "split_points"
    best_bottleneck: Number | None = None  # balanced only: the optimum before tolerance


def check_stage_count(num_stages: int, table: UnitTable, module: nn.Module) -> None:
    """At most one stage per traced unit (``num_stages`` is a positive int: :mod:`.arguments`)."""
    maximum = max(len(table), 1)
    if num_stages > maximum:
        finer = finer_trace_hint(table.traced)
        raise TooManyStagesError(
            f"num_stages={num_stages} but {type(module).__name__} traces to only {len(table)} "
            f"units ({max(len(table) - 1, 0)} cut points), so at most {maximum} stages are "
            f"possible. Use num_stages <= {maximum}"
            + (f", or trace finer: {finer}." if finer else ".")
        )


def cuts_from_sizes(sizes: Sequence[int], num_units: int) -> CutPlan:
    """Cuts after the given unit counts (one positive int per stage: :mod:`.arguments`)."""
    if sum(sizes) != num_units:
        raise BalanceError(
            f"balance={list(sizes)} sums to {sum(sizes)} but the model has {num_units} units; "
            "the counts must add up to exactly that (see part.report() for the unit list)."
        )
    cuts, total = [], 0
    for size in sizes[:-1]:
        total += size
        cuts.append(total)
    return CutPlan(cuts=tuple(cuts), how="sizes")


def _module_position(name: str, table: UnitTable, module: nn.Module) -> int | None:
    """First unit of module ``name`` (aliases resolved); raises if it never runs."""
    by_name = dict(module.named_modules(remove_duplicate=False))
    if name not in by_name or name == "":
        return None
    canonical = {id(m): n for n, m in module.named_modules()}[id(by_name[name])]
    position = table.first_unit_of_module(canonical)
    if position is not None:
        return position
    leaves = [target_name(u.node) for u in table.units if u.node.op == "call_module"]
    enclosing = [t for t in leaves if canonical.startswith(t + ".")]
    if enclosing:
        raise BalanceError(
            f"split point {name!r} is inside leaf module {enclosing[0]!r}, which runs whole: "
            f"{leaf_origin(table.traced, enclosing[0])}. Or cut before {enclosing[0]!r} instead."
        )
    raise BalanceError(f"split point {name!r} names a module that forward never calls.")


def cuts_from_split_points(
    split_points: Sequence[str], table: UnitTable, module: nn.Module
) -> CutPlan:
    """Cuts before the named modules/units (``num_stages - 1`` names: :mod:`.arguments`)."""
    unit_names = {u.name: u.index for u in table.units}
    positions: dict[int, str] = {}
    for name in split_points:
        position = _module_position(name, table, module)
        if position is None:
            position = unit_names.get(name)
        if position is None:
            known = [n for n, _ in module.named_modules() if n] + list(unit_names)
            raise unknown_name_error(
                "split point", name, known,
                "Split points are module names (as in module.named_modules()) or unit names "
                "from part.report(); the cut goes before the module's first operation.",
            )
        if position == 0:
            raise BalanceError(
                f"split point {name!r} is the first unit of forward, so stage 0 would be empty; "
                "drop it."
            )
        if position in positions:
            raise BalanceError(
                f"split points {positions[position]!r} and {name!r} cut at the same place "
                f"(before unit {table.units[position].name!r}); drop one."
            )
        positions[position] = name
    return CutPlan(cuts=tuple(sorted(positions)), how="split_points")


def balanced_cuts(
    costs: Sequence[Number],
    num_stages: int,
    table: UnitTable,
    value_bytes: dict[fx.Node, int],
    tolerance: float,
) -> CutPlan:
    n = len(costs)
    if num_stages == 1 or n <= 1:
        return CutPlan(cuts=(), how="balanced", best_bottleneck=sum(costs))
    if sum(costs) == 0:
        costs = [1] * n
    sizes, counts = table.live_totals(value_bytes)
    separated = table.separated_mutations()
    penalties = [(0, 0, 0, 0)] + [
        (separated[c], table.cut_depth(c), sizes[c], counts[c]) for c in range(1, n)
    ]
    best = bottleneck(costs, num_stages)
    share = sum(costs) / num_stages
    for floor in UNDERFULL_FLOORS:  # the first one that admits a split wins; 0 always does
        try:
            bound = best * (1 + tolerance)
            cuts = cheapest_split(costs, num_stages, bound, penalties, floor * share)
            break
        except ValueError:
            continue
    return CutPlan(cuts=tuple(cuts), how="balanced", best_bottleneck=best)
