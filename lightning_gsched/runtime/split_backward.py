"""A stage's backward in two halves: B (input gradients) now, W (weight gradients) later.

Why: zero-bubble schedules (``zb-h1``, ``zb-h2``, ``zbv``) run ``B s b`` as soon as the next
stage's gradient arrives, because the previous stage waits for its result, and ``W s b`` later,
where the worker would otherwise idle. Autograd has no "weights later" mode, so this module cuts
one backward in two over the same graph, without recomputing the forward:

* **B** (:func:`backward_input`) runs ``torch.autograd.grad(roots, inputs, retain_graph=True)``.
  Autograd then executes only the nodes on a path to an input (call them the input closure I)
  and, inside them, only the outputs leading to an input: the weight-gradient matrix products
  are skipped. A pre-hook on every *boundary* node (a node of I from which the autograd graph
  reaches a parameter outside I) records the gradient arriving at it.
* **W** (:meth:`PendingWeightGrad.run`) starts autograd again from those boundary nodes with
  the recorded gradients (``GradientEdge`` roots) plus the roots that are not in I (outputs
  computed from parameters alone, or every root when no input needs a gradient, e.g. token
  ids), restricted to the parameters (``inputs=params``). Parameters therefore accumulate
  through their usual AccumulateGrad nodes: ``.grad`` views of a flat buffer receive the sum
  in place and post-accumulate hooks fire (the bucketed all-reduce relies on both).

W runs one ``torch.autograd.backward`` per starting point u, restricted to P(u), the parameters
reachable from u *outside* I. Below a node outside I everything is outside I (a node that
reaches an input makes its parents reach it too), so the engine only re-runs u for its
parameter outputs and then the parameter-only part of the graph: the input-gradient chain is
not recomputed. Calls are linear in their gradients, so the sum over starting points is the
ordinary backward's weight gradient.

Double counting, and why there is none: each call adds only what flows from its own starting
point into parameters outside I. A parameter also reachable from u *through* I (used again
below another boundary node) would receive that other node's share twice, so during u's call a
pre-hook on u's children inside I replaces what arrives with zeros; that share is added by the
other node's own call. Roots outside I were not executed in B, so their contributions (the
given output gradients, and what boundary nodes above them send) are new.

Cost: B costs an input-only backward; W costs the weight-gradient outputs of the boundary nodes
plus parameter-only subgraphs, about what the ordinary backward spends on weights.

Exactness: every weight gradient is a sum of the same products as in one ordinary backward.
Where a parameter (or a node above it outside I) gets contributions from several starting
points, W adds them in another order than the ordinary backward would, so those gradients agree
to float rounding; with one contribution per parameter they are identical.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node

from lightning_gsched.errors import RuntimeConfigError


def _node_of(tensor: torch.Tensor) -> Node | None:
    """The autograd node gradients of ``tensor`` flow into (AccumulateGrad for a leaf)."""
    if not tensor.requires_grad:
        return None
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    return torch.autograd.graph.get_gradient_edge(tensor).node


def _children(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Every node reachable from ``roots`` with its next functions (the backward edges)."""
    edges: dict[Node, list[Node]] = {}
    queue = deque(roots)
    while queue:
        node = queue.popleft()
        if node in edges:
            continue
        nexts = [n for n, _ in node.next_functions if n is not None]
        edges[node] = nexts
        queue.extend(n for n in nexts if n not in edges)
    return edges


def _reaching(edges: dict[Node, list[Node]], targets: set[Node]) -> set[Node]:
    """Nodes from which some node of ``targets`` is reachable (targets included)."""
    parents: dict[Node, list[Node]] = {node: [] for node in edges}
    for node, nexts in edges.items():
        for n in nexts:
            parents.setdefault(n, []).append(node)
    found = {t for t in targets if t in parents}
    queue = deque(found)
    while queue:
        node = queue.popleft()
        for parent in parents.get(node, ()):
            if parent not in found:
                found.add(parent)
                queue.append(parent)
    return found


class _Start:
    """One W call: where it starts, with which gradients, and which parameters it feeds."""

    __slots__ = ("edges", "grads", "params", "inside")

    def __init__(self, edges: list[GradientEdge], grads: list[Any], params: list[torch.Tensor],
                 inside: list[Node]) -> None:
        self.edges, self.grads, self.params, self.inside = edges, grads, params, inside


class PendingWeightGrad:
    """What ``W s b`` needs from ``B s b``: starting points with their gradients."""

    def __init__(self, starts: list[_Start]) -> None:
        self._starts = starts
        self._done = False

    def run(self) -> None:
        """Accumulate the weight gradients into ``param.grad`` and release the graph."""
        if self._done:
            raise RuntimeConfigError(
                "the weight gradients of this backward were already accumulated; run each W "
                "once (the programs list one W per (stage, microbatch))"
            )
        self._done = True
        starts, self._starts = self._starts, []  # drop the graph with this object's last use
        for start in starts:
            handles = [node.register_prehook(_zeros) for node in start.inside]
            try:
                torch.autograd.backward(start.edges, grad_tensors=start.grads,
                                        inputs=start.params, retain_graph=True)
            finally:
                for handle in handles:
                    handle.remove()


def _zeros(grads: tuple[Any, ...]) -> tuple[Any, ...]:
    """Pre-hook: a share that another starting point's call adds (see the module docstring)."""
    return tuple(None if g is None else torch.zeros_like(g) for g in grads)


def backward_input(roots: Sequence[torch.Tensor], root_grads: Sequence[Any] | None,
                   inputs: Sequence[Any], params: Sequence[torch.Tensor]
                   ) -> tuple[list[Any], PendingWeightGrad]:
    """B: gradients of ``inputs`` (None where an input needs none), and W's pending work.

    ``roots``: the stage's output tensors (``root_grads`` their incoming gradients) or, on the
    last stage, ``[loss]`` with ``root_grads=None`` (a gradient of ones). Parameters' ``.grad``
    are not touched here; :meth:`PendingWeightGrad.run` adds the weight gradients.
    """
    given = list(root_grads) if root_grads is not None else [torch.ones_like(r) for r in roots]
    pairs = [(r, g) for r, g in zip(roots, given, strict=True)  # None: no incoming gradient
             if isinstance(r, torch.Tensor) and r.requires_grad and g is not None]
    params = [p for p in params if p.requires_grad]
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    root_nodes = [_node_of(r) for r, _ in pairs]
    edges = _children([n for n in root_nodes if n is not None])
    input_nodes = {n for n in map(_node_of, wanted) if n is not None}
    param_of = {n: p for p in params if (n := _node_of(p)) is not None}
    closure = _reaching(edges, input_nodes)  # what B executes
    to_params = _reaching(edges, set(param_of))
    # boundary: executed in B, with a next function that leads to a parameter outside B
    boundary = [node for node in closure if node not in input_nodes and any(
        n in to_params and n not in closure for n in edges.get(node, ()))]
    recorded: dict[Node, tuple[Any, ...]] = {}

    def record(node: Node):  # noqa: ANN202 - an autograd pre-hook factory
        def hook(grad_outputs: tuple[Any, ...]) -> None:
            recorded[node] = tuple(grad_outputs)
        return hook

    handles = [node.register_prehook(record(node)) for node in boundary]
    try:
        grads: Sequence[Any] = ()
        if wanted and pairs:
            grads = torch.autograd.grad([r for r, _ in pairs], wanted,
                                        grad_outputs=[g for _, g in pairs],
                                        retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    by_input = dict(zip(map(id, wanted), grads, strict=False))
    input_grads = [by_input.get(id(t)) if isinstance(t, torch.Tensor) else None for t in inputs]

    def params_below(nodes: list[Node]) -> list[torch.Tensor]:
        """Parameters reachable from ``nodes`` (all outside B), in the stage's order."""
        seen = set(nodes)
        queue = deque(nodes)
        while queue:
            for n in edges.get(queue.popleft(), ()):
                if n not in seen and n in to_params:
                    seen.add(n)
                    queue.append(n)
        return [param_of[n] for n in param_of if n in seen]

    starts: list[_Start] = []
    for node in boundary:
        grad_outputs = recorded.get(node, ())
        live = [(GradientEdge(node, i), g) for i, g in enumerate(grad_outputs) if g is not None]
        outside = [n for n in edges[node] if n in to_params and n not in closure]
        below = params_below(outside)
        if live and below:
            inside = [n for n in edges[node] if n in closure]
            starts.append(_Start([e for e, _ in live], [g for _, g in live], below, inside))
    for (root, grad), node in zip(pairs, root_nodes, strict=True):
        if node is not None and node not in closure and node in to_params:
            below = params_below([node])
            edge = torch.autograd.graph.get_gradient_edge(root)
            starts.append(_Start([edge], [grad], below, []))
    return input_grads, PendingWeightGrad(starts)
