"""The units the splitter cuts between, and what is live at each possible cut.

A *unit* is one top-level node of the traced graph in topological (= execution) order: a
``call_module`` of a leaf module, a ``call_function`` or a ``call_method``. Placeholders are the
stage-0 inputs and ``get_attr`` nodes (parameters, buffers, constants) are not units: they are
re-created in every stage that reads them, which is how a tied weight ends up referenced — not
copied — by two stages.

Cut ``c`` (``1 <= c < n``) goes between unit ``c - 1`` and unit ``c``. A value is *live* at cut
``c`` when it is defined before it and used at or after it; those values are what stage ``k``
hands to stage ``k + 1`` (including pass-through values such as a skip connection or a mask).
The *depth* of a cut is how many module invocations the units on both sides share: 0 between
two top-level blocks, 1 inside a block, and so on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch import nn

from lightning_gsched.partition.recording import mutated_value
from lightning_gsched.partition.tracer import SCOPE, TracedModel, target_name

UNIT_OPS = ("call_module", "call_function", "call_method")


@dataclass(frozen=True)
class Unit:
    """One cuttable node."""

    index: int
    node: fx.Node
    scope: tuple[tuple[str, int], ...]
    parameters: tuple[str, ...]  # canonical FQNs of the parameters it reads
    param_elements: int

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def module_path(self) -> str:
        """Innermost module the unit belongs to ('' for code in the root forward)."""
        return self.scope[-1][0] if self.scope else ""

    def describe(self) -> str:
        node = self.node
        if node.op == "call_module":
            return f"{node.name} = {node.target}(...)"
        if node.op == "call_method":
            return f"{node.name} = .{node.target}(...)"
        target = getattr(node.target, "__name__", str(node.target))
        return f"{node.name} = {target}(...)"


def canonical_parameter_names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name in ``module.named_parameters()`` (the canonical FQN)."""
    return {id(p): name for name, p in module.named_parameters()}


def canonical_buffer_names(module: nn.Module) -> dict[int, str]:
    return {id(b): name for name, b in module.named_buffers()}


def _tensors_read(node: fx.Node, traced: TracedModel) -> list[Any]:
    """Parameters/buffers/modules a node reads: its leaf module and its get_attr inputs."""
    objects: list[Any] = []
    if node.op == "call_module":
        objects.append(traced.resolve(target_name(node)))
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            objects.append(traced.resolve(target_name(arg)))
    return objects


def _parameters_of(objects: list[Any], names: dict[int, str]) -> dict[int, Any]:
    found: dict[int, Any] = {}
    for obj in objects:
        params = obj.parameters() if isinstance(obj, nn.Module) else [obj]
        for p in params:
            if isinstance(p, nn.Parameter) and id(p) in names:
                found.setdefault(id(p), p)
    return found


class UnitTable:
    """Units of a traced graph with liveness and nesting depth of every cut."""

    def __init__(self, traced: TracedModel) -> None:
        self.traced = traced
        graph = traced.graph
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in graph.nodes if n.op == "output")
        names = canonical_parameter_names(traced.module)
        self.units: list[Unit] = []
        for node in graph.nodes:
            if node.op not in UNIT_OPS:
                continue
            params = _parameters_of(_tensors_read(node, traced), names)
            self.units.append(
                Unit(
                    index=len(self.units),
                    node=node,
                    scope=tuple(node.meta.get(SCOPE, ())),
                    parameters=tuple(names[i] for i in params),
                    param_elements=sum(p.numel() for p in params.values()),
                )
            )
        n = len(self.units)
        self.position: dict[fx.Node, int] = {p: -1 for p in self.placeholders}
        self.position.update({u.node: u.index for u in self.units})
        self.last_use: dict[fx.Node, int] = {}
        for value in self.position:
            uses = [n if user.op == "output" else self.position[user] for user in value.users]
            self.last_use[value] = max(uses, default=self.position[value])
        # values in definition order: placeholders first, then units
        self.values: list[fx.Node] = list(self.position)

    def __len__(self) -> int:
        return len(self.units)

    def live_at(self, cut: int) -> list[fx.Node]:
        """Values defined before unit ``cut`` and used by unit ``cut`` or later, in definition order."""
        return [v for v in self.values if self.position[v] < cut <= self.last_use[v]]

    def cut_depth(self, cut: int) -> int:
        """Shared module invocations across the cut (0 = between top-level blocks)."""
        left, right = self.units[cut - 1].scope, self.units[cut].scope
        depth = 0
        for a, b in zip(left, right, strict=False):  # scopes of different depths: common prefix
            if a != b:
                break
            depth += 1
        return depth

    def live_totals(self, value_bytes: dict[fx.Node, int]) -> tuple[list[int], list[int]]:
        """(bytes, count) of live values at every cut 0..n (index 0 and n are unused)."""
        n = len(self.units)
        size_diff = [0] * (n + 2)
        count_diff = [0] * (n + 2)
        for v in self.values:
            first, last = self.position[v] + 1, min(self.last_use[v], n)
            if first <= last:
                size_diff[first] += value_bytes.get(v, 0)
                size_diff[last + 1] -= value_bytes.get(v, 0)
                count_diff[first] += 1
                count_diff[last + 1] -= 1
        sizes, counts, s, c = [], [], 0, 0
        for cut in range(n + 1):
            s += size_diff[cut]
            c += count_diff[cut]
            sizes.append(s)
            counts.append(c)
        return sizes, counts

    def separated_mutations(self) -> list[int]:
        """Per cut 0..n: in-place changes (``x[i] = v``, ``o.a = v``, ``x.add_(v)``) it would
        put in a later stage than the value they change.

        Such a cut hands the value over before the change: the receiving rank changes its own
        copy (a view of it handed over too, or the caller's input, no longer sees the change),
        and a received tensor that needs a gradient cannot be changed in place at all. The
        splitter avoids these cuts whenever its balance tolerance allows.
        """
        diff = [0] * (len(self.units) + 2)
        for unit in self.units:
            value = mutated_value(unit.node, self.traced.resolve)
            if value is None or value not in self.position:
                continue
            diff[self.position[value] + 1] += 1
            diff[unit.index + 1] -= 1
        counts, running = [], 0
        for cut in range(len(self.units) + 1):
            running += diff[cut]
            counts.append(running)
        return counts

    def mutations_across(self, cut: int) -> list[tuple[Unit, str]]:
        """``(changing unit, changed value's name)`` of each in-place change that cut ``cut``
        (before unit ``cut``) would put in a later stage than the value it changes (what
        :meth:`separated_mutations` counts)."""
        found = []
        for unit in self.units:
            value = mutated_value(unit.node, self.traced.resolve)
            if value is not None and value in self.position \
                    and self.position[value] < cut <= unit.index:
                found.append((unit, value.name))
        return found

    def first_unit_of_module(self, fqn: str) -> int | None:
        """Index of the first unit that runs inside module ``fqn`` (or calls it as a leaf)."""
        prefix = fqn + "."
        for unit in self.units:
            for path, _ in unit.scope:
                if path == fqn or path.startswith(prefix):
                    return unit.index
        return None
