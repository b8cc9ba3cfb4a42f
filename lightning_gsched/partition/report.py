"""Human-readable summary of a partition (printed by ``gsched`` and on request).

Kept apart from :mod:`.api` so the table layout can change without touching the logic. It only
reads public attributes of :class:`~.api.Partition`, spelled out as :class:`ReportedPartition`
so that this module does not import :mod:`.api` (which imports it: imports go one way).
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence


class ReportedPartition(Protocol):
    """What the report reads of a :class:`~.api.Partition` (see its docstring for meanings)."""

    @property
    def module(self) -> object: ...
    @property
    def num_stages(self) -> int: ...
    @property
    def balance(self) -> object: ...
    @property
    def split_method(self) -> str: ...
    @property
    def cost_unit(self) -> str: ...
    @property
    def unit_names(self) -> Sequence[str]: ...
    @property
    def stage_units(self) -> Sequence[Sequence[str]]: ...
    @property
    def stage_costs(self) -> Sequence[float]: ...
    @property
    def stage_param_counts(self) -> Sequence[int]: ...
    @property
    def boundary_names(self) -> Sequence[Sequence[str]]: ...
    @property
    def boundary_bytes(self) -> Sequence[int]: ...
    @property
    def shared_parameters(self) -> Mapping[str, Sequence[int]]: ...
    @property
    def unused_parameters(self) -> Sequence[str]: ...
    @property
    def auto_leaf_modules(self) -> Mapping[str, str]: ...
    @property
    def trace_attempts(self) -> Sequence[str]: ...
    @property
    def static_shapes(self) -> Sequence[Sequence[int]] | None: ...
    @property
    def mode_dependent(self) -> str | None: ...
    @property
    def graph_per_mode(self) -> bool: ...
    @property
    def verified(self) -> object | None: ...
    @property
    def fixed_keywords(self) -> Mapping[str, object]: ...
    @property
    def cache_off_modules(self) -> Sequence[str]: ...


def _size(num_bytes: int) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{num_bytes} B"


def _cost(value: float, unit: str) -> str:
    if unit == "ns":
        return f"{value / 1e6:.3f} ms"
    return f"{value:,.0f}"


def _wrap(items: Sequence[str], separator: str, width: int = 100) -> list[str]:
    """Indented lines of ``items`` joined by ``separator``, never breaking inside an item."""
    lines: list[str] = []
    current = ""
    for k, item in enumerate(items):
        piece = item + (separator.rstrip() if k < len(items) - 1 else "")
        if current and len(current) + 1 + len(piece) > width:
            lines.append(current)
            current = ""
        current = f"{current} {piece}" if current else f"  {piece}"
    if current:
        lines.append(current)
    return lines


def _folded(names: Sequence[str], groups: Sequence[tuple[str, int] | None]) -> list[str]:
    """Unit names with consecutive units of one top-level module invocation folded together."""
    items: list[str] = []
    k = 0
    while k < len(names):
        end = k + 1
        while groups[k] is not None and end < len(names) and groups[end] == groups[k]:
            end += 1
        group = groups[k]
        items.append(names[k] if end - k == 1 or group is None else f"{group[0]} ({end - k} units)")
        k = end
    return items


def format_report(
    part: ReportedPartition,
    unit_descriptions: Sequence[str],
    groups: Sequence[tuple[str, int] | None] | None = None,
    units: bool = True,
) -> str:
    """The report text; ``groups`` (top-level module per unit) folds node lists, ``None`` not.

    ``units=False`` leaves out the per-stage unit lists (2-3 lines per stage), keeping the stage
    table and the notes: GeneralParallel's startup print must stay on one screen for any S.
    """
    total = sum(part.stage_costs) or 1
    method = (
        f"balance={part.balance!r}"
        if part.split_method == "balanced"
        else "explicit unit counts" if part.split_method == "sizes" else "explicit split points"
    )
    lines = [
        f"Partition of {type(part.module).__name__} into {part.num_stages} stage(s): "
        f"{len(part.unit_names)} units, {method}, cost unit: {part.cost_unit}",
        f"{'stage':>5}  {'units':>5}  {'first .. last unit':<36} {'params':>12} "
        f"{'est. cost':>12} {'share':>6}  hands over",
    ]
    for index, names in enumerate(part.stage_units):
        span = f"{names[0]} .. {names[-1]}" if names else "(empty)"
        if index < part.num_stages - 1:
            handed = (
                f"{len(part.boundary_names[index])} value(s), "
                f"{_size(part.boundary_bytes[index])}"
            )
        else:
            handed = "module output"
        lines.append(
            f"{index:>5}  {len(names):>5}  {span[:36]:<36} {part.stage_param_counts[index]:>12,} "
            f"{_cost(part.stage_costs[index], part.cost_unit):>12} "
            f"{100 * part.stage_costs[index] / total:>5.1f}%  {handed}"
        )
    if part.shared_parameters:
        lines.append("Shared parameters (read by several stages; gradients are summed):")
        lines += [f"  {name}: stages {stages}" for name, stages in part.shared_parameters.items()]
    if part.unused_parameters:
        lines.append(f"Parameters no stage reads: {', '.join(part.unused_parameters)}")
    if part.auto_leaf_modules:
        lines.append("Modules kept whole because torch.fx could not trace into them:")
        lines += [f"  {name}: {why}" for name, why in part.auto_leaf_modules.items()]
    if len(part.trace_attempts) > 1 or part.auto_leaf_modules:
        lines.append("Tracing modes tried, in order (see docs/partition.md):")
        lines += [f"  {attempt}" for attempt in part.trace_attempts]
    if part.static_shapes is not None:
        lines.append(
            "Traced with static shapes (forward computes with sizes in Python): inputs must "
            f"have shapes {list(part.static_shapes)}"
        )
    if part.mode_dependent:
        lines.append(f"Traced code depends on train()/eval(): {part.mode_dependent}")
        lines.append("  every stage holds a train-mode and an eval-mode graph, cut alike"
                     if part.graph_per_mode else
                     "  the other mode cannot be cut alike: the stages run in the traced mode "
                     "only (ModeMismatchError otherwise)")
    if part.fixed_keywords:
        fixed = ", ".join(f"{k}={v!r}" for k, v in part.fixed_keywords.items())
        lines.append(f"Traced as if called with {fixed} (the call leaves it out; a pipeline "
                     "cannot return or hand over a key/value cache, and training never reads "
                     "it): the output holds no cache")
    if part.cache_off_modules:
        lines.append("Traced as if these submodules were called with use_cache=False (their "
                     "calls leave it out; a key/value cache cannot be handed between stages or "
                     "to a module kept whole): " + ", ".join(part.cache_off_modules))
    if part.verified is not None:
        lines.append(f"Verified: {part.verified}")
    if not units:
        return "\n".join(lines)
    start = 0
    for index, names in enumerate(part.stage_units):
        lines.append(f"Stage {index} units:")
        if groups is None:
            lines += _wrap(unit_descriptions[start : start + len(names)], "; ")
        else:
            lines += _wrap(_folded(names, groups[start : start + len(names)]), ", ")
        if index < part.num_stages - 1:
            lines.append(f"  -> hands over: {', '.join(part.boundary_names[index]) or '(nothing)'}")
        start += len(names)
    return "\n".join(lines)
