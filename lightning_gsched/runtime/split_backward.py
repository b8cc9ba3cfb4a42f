"""A stage's backward in two halves: B (input gradients) now, W (weight gradients) later.

Zero-bubble schedules (``zb-h1``, ``zb-h2``, ``zbv``; Qi et al., "Zero Bubble Pipeline
Parallelism") run ``B s b`` as soon as the next stage's gradient arrives, since the previous stage
waits for it, and ``W s b`` where the worker would otherwise idle. Autograd has no "weights later"
mode, so this module cuts one backward in two over the same graph, without recomputing the
forward, after ``torch.distributed.pipelining._backward``.

Terms, on the autograd graph below the roots (the stage's outputs, or its loss): I, the *input
closure*, the nodes from which an input's AccumulateGrad node is reachable (every parent of a node
of I is in I); O, the *weight side*, the nodes outside I from which a parameter's AccumulateGrad
node is reachable (nothing below a node of O is in I: it would then reach an input itself);
*intermediates*, the nodes of I with a child in O (e.g. a Linear's ``AddmmBackward``: the layer
input is in I, the weight's ``TBackward`` and the bias in O).

**B** (:func:`backward_input`) runs ``torch.autograd.grad(roots, inputs, retain_graph=True)``:
autograd executes exactly the nodes of I, each only towards I, so no weight-gradient product is
computed and no ``.grad`` touched. A pre-hook on every intermediate records the gradient arriving
at it, complete since all its parents are in I. Where no input needs a gradient (a first stage,
whose inputs are token ids), I is empty and B returns at once, without walking the graph: it cost
0.4 ms per microbatch on the benchmark GPT's first stage (two blocks; torch's own B there returns
in 0.02 ms), and W is then the whole backward.

**W** (:meth:`PendingWeightGrad.run`): (1) each intermediate runs again, alone, from its recorded
gradient, with its O children as the ``autograd.grad`` targets, so only its outputs towards O are
computed; a post-hook reads them and hands nothing on. One engine call per intermediate: from an
upper intermediate the input side leads to the lower intermediates' weights, so one call from all
would run B again. (2) One ``torch.autograd.backward`` from the O children with the read outputs
summed per edge, plus the roots outside I (outputs computed from parameters alone, or every root
when no input needs a gradient), with ``inputs=params``. Parameters accumulate through their
AccumulateGrad nodes, once each: ``.grad`` views of a flat buffer receive the sum in place and
post-accumulate hooks fire once (:mod:`.buckets` relies on it).

**Alone**: most intermediates (every Linear's, every LayerNorm's of a transformer) own their part
of O: no node of it is reached from another intermediate or from a root outside I. Then no
parameter of that part is reachable from the intermediate's input side either (the last node of
I on such a path would be an intermediate reaching the part), so one engine call from the
intermediate's recorded gradient with ``inputs=`` the part's parameters computes its outputs
towards O only and runs the part, accumulating each parameter once: phases 1 and 2 in one call,
no gradient held between them, and the part's saved tensors released by the call. The shared
intermediates (a weight reached twice, a root's weight side) take the two phases above; the alone
ones run between the two, since phase 1 of a weight used twice runs the input side between its
uses again (outputs discarded), which may pass an alone intermediate whose call would have
released its saved tensors. Which intermediates are alone is decided over all intermediates,
including those B gave no gradient.

Nothing counts twice: B executed only nodes of I, phase 1 only the intermediates' edges towards O,
phase 2 only nodes of O; a root outside I was not executed in B and nothing below it is in I.

Exactness: B executes the same nodes of I in the same order (the engine orders ready nodes by
creation; O nodes never make a node of I ready) on the same buffers as an ordinary backward, so
input and recorded gradients are bit-identical, and the weight outputs are the same kernels on the
same values. Phase 2 sums the terms reaching an O edge in the ordinary order (roots first, then
intermediates in B's order); only an O node receiving three or more terms, from intermediates and
other O nodes, may add them in another order: float rounding, not a different value.

Cost: B is the ordinary backward minus its weight products, W the weight products plus the
weight-only subgraph; saved tensors and recorded gradients live from B to W. An intermediate's O
child also reachable through its I children (a Linear applied twice) has its input-side output
computed and discarded. Only the given parameters receive gradients.
"""

from __future__ import annotations

import functools
import operator
from collections import deque
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from lightning_gsched.errors import RuntimeConfigError

EdgeKey = tuple[Node, int]  # (node, index of its gradient input), as in ``next_functions``
# a node of I with children in O, the gradient B recorded at it, and its O edges as
# (output index of the node, the edge it feeds)
_Intermediate = tuple[Node, tuple[torch.Tensor | None, ...], list[tuple[int, EdgeKey]]]
# an intermediate whose weight side is its own, with the parameters there (see "Alone")
_Alone = tuple[Node, tuple[torch.Tensor | None, ...], list[torch.Tensor]]
# (the alone, then the shared intermediates, the roots outside I and their parameters)
_Work = tuple[list[_Alone], list[_Intermediate], list[tuple[EdgeKey, torch.Tensor]],
              list[torch.Tensor]]


class PendingWeightGrad:
    """What ``W s b`` needs from ``B s b``: the intermediates with their recorded gradients, the
    roots outside I with theirs, and the parameters. These keep the forward's saved tensors alive
    until :meth:`run`, which accumulates them, once, and drops them first."""

    def __init__(self, work: _Work) -> None:
        self._work: _Work | None = work

    @property
    def done(self) -> bool:
        """True once :meth:`run` started: the weight gradients are (being) accumulated."""
        return self._work is None

    def held_tensors(self) -> list[torch.Tensor]:
        """The gradients B recorded for W: with the saved tensors of the graph below the
        intermediates, what this object keeps alive from B to W (``footprint.held_until_w``)."""
        if self._work is None:
            return []
        alone, intermediates, root_edges, _ = self._work
        return [*(g for _, grads, _ in [*alone, *intermediates] for g in grads if g is not None),
                *(g for _, g in root_edges)]

    def run(self) -> None:
        """Accumulate the weight gradients into ``param.grad`` and release the graph."""
        if self._work is None:
            raise RuntimeConfigError(
                "the weight gradients of this backward were already accumulated; run each "
                "PendingWeightGrad once (the programs list one W per (stage, microbatch)).")
        # take the references out first: nothing here keeps the graph alive, even on a raise
        (alone, intermediates, root_edges, params), self._work = self._work, None
        arriving: dict[EdgeKey, list[torch.Tensor]] = {}
        for key, grad in root_edges:  # the engine adds the roots' gradients first
            arriving.setdefault(key, []).append(grad)
        queue = deque(intermediates)  # in B's execution order (see Exactness)
        intermediates.clear()
        while queue:  # each recorded gradient is dropped once used
            node, recorded, weight_edges = queue.popleft()
            outputs = _weight_outputs(node, recorded, weight_edges)
            for index, key in weight_edges:
                if (output := outputs[index]) is not None:
                    arriving.setdefault(key, []).append(output)
        # after phase 1, which may run an alone intermediate's node again on the input side
        # between two uses of one weight (its outputs there discarded), before phase 2 (O only)
        queue_alone = deque(alone)  # each recorded gradient dropped once used
        alone.clear()
        while queue_alone:
            _accumulate_alone(*queue_alone.popleft())
        if not arriving:  # nothing reached a parameter (all None, or no parameter needs one)
            return
        edges = [GradientEdge(node, nr) for node, nr in arriving]
        sums = [functools.reduce(operator.add, grads) for grads in arriving.values()]
        arriving.clear()
        torch.autograd.backward(edges, grad_tensors=sums, inputs=params)


def _accumulate_alone(node: Node, recorded: tuple[torch.Tensor | None, ...],
                      params: list[torch.Tensor]) -> None:
    """Phases 1 and 2 of an intermediate that owns its weight side (module docstring, "Alone"):
    one call from its recorded gradient to its parameters. The pre-hook puts back what B
    recorded, as in :func:`_weight_outputs`."""
    given = [(GradientEdge(node, i), g) for i, g in enumerate(recorded) if g is not None]

    def replay(_arriving: tuple[Any, ...]) -> tuple[torch.Tensor | None, ...]:
        return recorded

    handle = node.register_prehook(replay)
    try:
        torch.autograd.backward([e for e, _ in given], grad_tensors=[g for _, g in given],
                                inputs=params)
    finally:
        handle.remove()


def _weight_outputs(node: Node, recorded: tuple[torch.Tensor | None, ...],
                    weight_edges: list[tuple[int, EdgeKey]]) -> tuple[torch.Tensor | None, ...]:
    """Phase 1: run one intermediate from its recorded gradient for its outputs towards O. The
    post-hook keeps them and hands nothing on; the pre-hook puts back exactly what B recorded, in
    case tensor hooks on the node's outputs would change the fed gradient again."""
    outputs: list[tuple[torch.Tensor | None, ...]] = []

    def replay(_arriving: tuple[Any, ...]) -> tuple[torch.Tensor | None, ...]:
        return recorded

    def keep(grad_inputs: tuple[Any, ...], _grad_outputs: tuple[Any, ...]) -> tuple[None, ...]:
        outputs.append(tuple(grad_inputs))
        return tuple(None for _ in grad_inputs)

    given = [(GradientEdge(node, i), g) for i, g in enumerate(recorded) if g is not None]
    targets = [GradientEdge(n, nr) for n, nr in dict.fromkeys(key for _, key in weight_edges)]
    handles = [node.register_prehook(replay), node.register_hook(keep)]
    try:
        torch.autograd.grad([e for e, _ in given], targets, grad_outputs=[g for _, g in given],
                            retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return outputs[0] if outputs else (None,) * len(node.next_functions)


def backward_input(roots: Sequence[torch.Tensor], root_grads: Sequence[torch.Tensor | None] | None,
                   inputs: Sequence[Any], params: Iterable[torch.Tensor],
                   ) -> tuple[list[torch.Tensor | None], PendingWeightGrad]:
    """B: the gradients of ``inputs`` (leaves; None where none), and the work W has left.

    ``roots``: the stage's output tensors with ``root_grads`` their gradients (None: skipped), or
    ``[loss]`` with ``root_grads=None`` (a gradient of ones). ``params`` requiring grad receive
    gradients in :meth:`PendingWeightGrad.run`; B leaves every ``.grad`` untouched.
    """
    params = list(dict.fromkeys(p for p in params if p.requires_grad))
    wanted = _input_leaves(inputs)
    _check_params(params, wanted)
    pairs = _roots_with_grads(roots, root_grads, needs_weights=bool(params))
    root_edges = [(_edge_key(r), g) for r, g in pairs]
    if not wanted:  # a first stage's B: I is empty, W is the whole backward (nothing to walk)
        return [None] * len(inputs), PendingWeightGrad(([], [], root_edges, params))
    parents = _parents([key[0] for key, _ in root_edges])
    closure = _ancestors(parents, {_edge_key(t)[0] for t in wanted})  # I
    param_nodes = {_edge_key(p)[0]: p for p in params}
    weight_side = _ancestors(parents, set(param_nodes), blocked=closure)  # O
    intermediates = {
        node: edges for node in closure
        if (edges := [(i, (child, nr)) for i, (child, nr) in enumerate(node.next_functions)
                      if child in weight_side])
    }

    recorded: dict[Node, tuple[torch.Tensor | None, ...]] = {}  # in B's execution order

    def recorder(node: Node) -> Callable[[tuple[Any, ...]], None]:
        def hook(grads: tuple[Any, ...]) -> None:
            recorded[node] = tuple(grads)
        return hook

    input_grads: dict[int, torch.Tensor | None] = {}
    if closure:  # some root depends on an input that needs a gradient
        handles = [node.register_prehook(recorder(node)) for node in intermediates]
        try:
            grads = torch.autograd.grad([r for r, _ in pairs], wanted,
                                        grad_outputs=[g for _, g in pairs],
                                        retain_graph=bool(intermediates), allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        input_grads = {id(t): g for t, g in zip(wanted, grads, strict=True)}
    # roots outside I: never executed in B and nothing below them is in I (see docstring)
    outside = [(key, g) for key, g in root_edges if key[0] in weight_side]
    part_of = _weight_parts(intermediates, [key[0] for key, _ in outside], weight_side)
    alone_params: dict[Node, list[torch.Tensor]] = {}
    shared_params: list[torch.Tensor] = []
    for node, p in param_nodes.items():
        if node in weight_side:
            owner = part_of[node]
            (shared_params if owner is None else alone_params.setdefault(owner, [])).append(p)
    alone: list[_Alone] = []
    shared: list[_Intermediate] = []
    for node, arrived in recorded.items():  # in B's order
        if all(g is None for g in arrived):  # nothing reached it, nothing to add
            continue
        if node in alone_params:
            alone.append((node, arrived, alone_params[node]))
        else:
            shared.append((node, arrived, intermediates[node]))
    pending = PendingWeightGrad((alone, shared, outside, shared_params))
    return [input_grads.get(id(t)) for t in inputs], pending


def _roots_with_grads(roots: Sequence[torch.Tensor],
                      root_grads: Sequence[torch.Tensor | None] | None,
                      needs_weights: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(root, its gradient) for every root B and W start from; checks what was given."""
    roots = list(roots)
    for i, r in enumerate(roots):
        if not isinstance(r, torch.Tensor):
            raise RuntimeConfigError(
                f"root {i} is a {type(r).__name__}, not a tensor; pass the stage's output "
                "tensors (flattened) or [loss].")
    if root_grads is None:
        for i, r in enumerate(roots):
            if r.numel() != 1:
                raise RuntimeConfigError(
                    f"root_grads=None means a gradient of ones, which only a scalar root (a loss) "
                    f"has, but root {i} has shape {tuple(r.shape)}; pass the gradients of the "
                    "outputs, or reduce the loss to a scalar.")
        grads: list[torch.Tensor | None] = [torch.ones_like(r) for r in roots]
    else:
        grads = list(root_grads)
        if len(grads) != len(roots):
            raise RuntimeConfigError(
                f"{len(grads)} root gradients for {len(roots)} roots; give one per root (None "
                "for an output that received no gradient).")
    for i, (r, g) in enumerate(zip(roots, grads, strict=True)):
        if g is not None and not r.requires_grad and needs_weights:
            raise RuntimeConfigError(
                f"root {i} (shape {tuple(r.shape)}) was given a gradient but does not "
                "require grad, so no parameter can get a gradient through it (computed under "
                "torch.no_grad() or detached?); pass only roots that require grad, or None as "
                "the gradient of an output that needs none.")
    return [(r, g) for r, g in zip(roots, grads, strict=True) if g is not None and r.requires_grad]


def _input_leaves(inputs: Sequence[Any]) -> list[torch.Tensor]:
    """The inputs that need a gradient; each must be a leaf (the stage boundary)."""
    wanted = []
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            if t.grad_fn is not None:
                raise RuntimeConfigError(
                    f"input {i} is not a leaf (its grad_fn is {type(t.grad_fn).__name__}), so B "
                    "would run into the graph that produced it; give the stage fresh leaves, "
                    "e.g. x.detach().requires_grad_().")
            wanted.append(t)
    return wanted


def _check_params(params: list[torch.Tensor], wanted: list[torch.Tensor]) -> None:
    inputs = {id(t) for t in wanted}
    for p in params:
        if p.grad_fn is not None:
            raise RuntimeConfigError(
                f"a parameter of shape {tuple(p.shape)} is not a leaf (its grad_fn is "
                f"{type(p.grad_fn).__name__}); pass the stage's nn.Parameters.")
        if id(p) in inputs:
            raise RuntimeConfigError(
                f"a parameter of shape {tuple(p.shape)} is also a stage input; B returns an "
                "input's gradient and W accumulates a parameter's, so pass it as one of the two.")


def _edge_key(t: torch.Tensor) -> EdgeKey:
    """Where the gradient of ``t`` enters the graph: (grad_fn, output_nr) or (AccumulateGrad, 0)."""
    edge = get_gradient_edge(t)
    return edge.node, edge.output_nr


def _parents(roots: list[Node]) -> dict[Node, list[Node]]:
    """Every node below ``roots`` with the nodes whose ``next_functions`` lead to it."""
    parents: dict[Node, list[Node]] = {node: [] for node in roots}
    queue = deque(parents)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _weight_parts(intermediates: dict[Node, list[tuple[int, EdgeKey]]], outside_roots: list[Node],
                  weight_side: set[Node]) -> dict[Node, Node | None]:
    """{node of O: the intermediate whose part of O it is, or None where the part is shared}:
    shared between intermediates, or reached from a root outside I (module docstring, "Alone").

    Each start claims the nodes of O below it that nobody claimed; meeting another's node joins
    the two starts (union-find), whose nodes below were claimed when that start walked them."""
    starts: list[Node | None] = [*intermediates, None]  # None: the roots outside I, together
    joined = list(range(len(starts)))

    def find(i: int) -> int:
        while joined[i] != i:
            joined[i] = joined[joined[i]]
            i = joined[i]
        return i

    claimed: dict[Node, int] = {}
    children = [[child for _, (child, _) in edges] for edges in intermediates.values()]
    for start, below in enumerate([*children, outside_roots]):
        queue = deque(below)
        while queue:
            node = queue.popleft()
            if node in claimed:
                joined[find(claimed[node])] = find(start)
                continue
            claimed[node] = start
            queue.extend(child for child, _ in node.next_functions if child in weight_side)
    size = [0] * len(starts)
    for i in range(len(starts)):
        size[find(i)] += 1
    last = len(starts) - 1  # the roots' start

    def owner(start: int) -> Node | None:
        root = find(start)
        return starts[start] if size[root] == 1 and root != last else None

    return {node: owner(start) for node, start in claimed.items()}


def _ancestors(parents: dict[Node, list[Node]], targets: set[Node],
               blocked: set[Node] | frozenset[Node] = frozenset()) -> set[Node]:
    """Nodes of the graph from which a target is reachable without passing ``blocked``."""
    found = {t for t in targets if t in parents and t not in blocked}
    queue = deque(found)
    while queue:
        for parent in parents[queue.popleft()]:
            if parent not in found and parent not in blocked:
                found.add(parent)
                queue.append(parent)
    return found
