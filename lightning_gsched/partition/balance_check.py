"""Warn, at partition time, when an automatic split came out degenerate, and say why.

A pipeline is as fast as its slowest stage, and a stage without parameters does no useful
work, so a split where one stage holds far more than its share of the parameters (or a stage
holds none) silently wastes the machines. The usual cause is a submodule the tracer could not
enter and kept whole (an automatic leaf), which the report lists but nobody reads; hence a
:class:`~.errors.UnbalancedPartitionWarning` that names the module, why it was kept whole
(with ``file:line``) and the option that fixes it. Not warned, because they are the user's
choice or the model's own granularity: explicit splits (``split_points``, unit counts), heavy
``leaf_modules`` entries, and layers too few or too uneven for the stage count (the report
shows the shares).
"""

from __future__ import annotations

import warnings
from typing import Sequence

from lightning_gsched.partition.attempts import STAGE_SHARE_LIMIT
from lightning_gsched.partition.errors import UnbalancedPartitionWarning
from lightning_gsched.partition.hints import auto_leaf_fix
from lightning_gsched.partition.tracer import TracedModel
from lightning_gsched.partition.units import Unit, UnitTable


def stage_problems(stage_param_counts: Sequence[int], total: int) -> list[str]:
    """What is degenerate about the stages' parameter counts (empty: nothing)."""
    num_stages = len(stage_param_counts)
    if num_stages < 2 or total == 0:
        return []
    share = total / num_stages
    problems = [
        f"stage {k} holds {count / total:.0%} of the parameters (an even share is "
        f"{share / total:.0%}, the most accepted {STAGE_SHARE_LIMIT:g}x that)"
        for k, count in enumerate(stage_param_counts)
        if count > STAGE_SHARE_LIMIT * share
    ]
    empty = [str(k) for k, count in enumerate(stage_param_counts) if count == 0]
    if empty:
        problems.append(f"stage(s) {', '.join(empty)} hold no parameters")
    return problems


def _heavy_units(table: UnitTable, limit: float) -> list[Unit]:
    return [u for u in table.units if u.param_elements > limit]


def _cause(traced: TracedModel, unit: Unit, total: int) -> str | None:
    share = f"{unit.param_elements / total:.0%} of the parameters"
    target = str(unit.node.target)
    if unit.node.op == "call_module" and target in traced.auto_leaves:
        return (
            f"{target!r} ({share}) runs whole inside one stage because torch.fx could not trace "
            f"into it: {traced.auto_leaves[target]}. Fix: {auto_leaf_fix(traced, target)}."
        )
    # a leaf_modules entry (the user's choice) or one layer: no option of ours changes it
    return None


def unbalanced_message(
    table: UnitTable, stage_param_counts: Sequence[int], problems: Sequence[str]
) -> str | None:
    """The warning text (what is degenerate, the automatic leaves that cause it, what was
    tried, the fix), or ``None`` when no automatic leaf is to blame."""
    traced = table.traced
    total = sum(p.numel() for p in traced.module.parameters())
    limit = STAGE_SHARE_LIMIT * total / len(stage_param_counts)
    causes = [c for u in _heavy_units(table, limit) if (c := _cause(traced, u, total))]
    if not causes:
        return None
    lines = [
        f"Partition of {type(traced.module).__name__} into {len(stage_param_counts)} stages is "
        f"unbalanced: {'; '.join(problems)}.",
        *causes,
    ]
    if traced.attempts:
        lines.append("Tried: " + "; ".join(traced.attempts) + ".")
    return "\n".join(lines)


def warn_if_unbalanced(
    table: UnitTable, split_method: str, stage_param_counts: Sequence[int]
) -> None:
    """Warn (:class:`~.errors.UnbalancedPartitionWarning`) if an automatic split is degenerate."""
    if split_method != "balanced":
        return
    total = sum(p.numel() for p in table.traced.module.parameters())
    problems = stage_problems(stage_param_counts, total)
    message = unbalanced_message(table, stage_param_counts, problems) if problems else None
    if message is not None:
        warnings.warn(message, UnbalancedPartitionWarning, stacklevel=3)  # at partition()'s caller
