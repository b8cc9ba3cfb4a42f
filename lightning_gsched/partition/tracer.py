"""Trace ``module.forward`` into one flat torch.fx graph whose targets are the original FQNs.

Why a custom tracer instead of ``torch.fx.symbolic_trace``:

* the forward is called exactly like the user calls it (any pytree of args/kwargs, defaults
  left alone so ``if mask is None`` still works), by tracing a tiny generated root whose
  placeholders are the *tensor leaves* of the example call (:mod:`.layout`);
* every node records the stack of module invocations it came from (``meta["gsched_scope"]``),
  which the splitter uses to prefer cuts between blocks over cuts inside one;
* leaf modules are the user's classes/names plus torch's built-in layers (but not the layer
  stacks in :data:`TRACED_TORCH_CONTAINERS`), and a submodule whose forward cannot be traced
  (data-dependent control flow) is made a leaf automatically (``auto_leaf``): a leaf runs
  whole, with real tensors, so this is always correct;
* a module built inside forward (``nn.Identity()`` in litgpt) has no name a stage could call,
  so its forward is traced inline;
* if the root forward cannot be traced symbolically, or an automatic leaf would hold too much
  of the model to balance the stages, it is traced again with the example's static shapes
  (:mod:`.concrete`), which handles ``torch.ones(t, t)`` & co. (the order: :mod:`.attempts`);
* what still fails becomes a :class:`TraceFailedError` naming the module, the file and line,
  and the fix (:mod:`.trace_errors`); side effects of tracing on the module are undone
  (:mod:`.preserve`); a second trace in the other train/eval mode detects code that depends on
  ``self.training``.
"""

from __future__ import annotations

import dataclasses
import inspect
import linecache
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import Argument, Target

from lightning_gsched.host_random import (
    draw_marks,
    host_draws_refused,
    refuse_unguarded_draws,
    traced_code,
)
from lightning_gsched.partition.attempts import (
    Attempt,
    choose,
    leaf_limit,
    needs_static,
    run_attempt,
)
from lightning_gsched.partition.cache_off import fixed_keywords, omitted_cache
from lightning_gsched.partition.checkpoint_calls import (
    checkpoint_calls_noted,
    warn_checkpoint_traced,
)
from lightning_gsched.partition.compiled import is_compiled
from lightning_gsched.partition.concrete import ConcreteProxy, ConcreteValues
from lightning_gsched.partition.errors import TraceFailedError, UntracedOutputError
from lightning_gsched.partition.grad_mode import grad_mode_switches_refused
from lightning_gsched.partition.layout import InputLayout, OutputLayout, bind_arguments
from lightning_gsched.partition.names import resolve_leaf_modules
from lightning_gsched.partition.output_objects import (
    trace_time_objects,
    untraced_output_message,
)
from lightning_gsched.partition.preserve import (
    SubtreeState,
    changed_subtree_attributes,
    in_mode,
    preserved_attributes,
    preserved_tensors_and_rng,
    subtree_attributes,
)
from lightning_gsched.partition.recording import GschedProxy, recording_autograd_functions
from lightning_gsched.partition.trace_errors import (
    attach_failure_site,
    failure_message,
    failure_site,
)

ROOT = "_gsched_user"  # attribute under which the trace root holds the user's module
CONSTANT_PREFIX = "_gsched_constant_"
OTHER_MODE_CONSTANT_PREFIX = "_gsched_constant_other_mode_"
SCOPE = "gsched_scope"  # node.meta key: tuple of (module fqn, invocation id), outermost first

# torch.nn modules are leaves (fx's default) except these stacks of layers, which the tracer
# enters so stages can be cut between their layers; if one cannot be traced (the
# Transformer* ones need static shapes) auto_leaf keeps it whole instead.
TRACED_TORCH_CONTAINERS: frozenset[type] = frozenset(
    {nn.Sequential, nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder}
)


def _strip(qualname: str) -> str:
    return qualname[len(ROOT) + 1 :] if qualname.startswith(ROOT + ".") else qualname


class GschedTracer(fx.Tracer):
    """fx tracer with user leaves, per-node module scopes and failure attribution."""

    def __init__(
        self,
        leaf_classes: tuple[type, ...],
        leaf_names: frozenset[str],
        concrete: ConcreteValues | None = None,
    ) -> None:
        super().__init__(autowrap_modules=(math,))
        self.concrete = concrete  # set: static-shape mode (see .concrete)
        # Buffers become get_attr nodes (not constants frozen at trace time), so stages follow
        # later .to(device) / load_state_dict on the modules that own them.
        self.proxy_buffer_attributes = True
        self.leaf_classes = leaf_classes
        self.leaf_names = leaf_names
        self.gsched_scope: list[tuple[str, int]] = []
        self.gsched_invocations = 0
        self.traced_into: dict[str, nn.Module] = {}
        self.cache_off: dict[str, None] = {}  # submodules called as if with use_cache=False

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name == ROOT:
            return False
        name = _strip(module_qualified_name)
        if name in self.leaf_names or isinstance(m, self.leaf_classes):
            return True
        if is_compiled(m):  # torch.fx cannot enter compiled code: one unit, run compiled
            return True
        if type(m) in TRACED_TORCH_CONTAINERS:
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        try:
            qualname = self.path_of_module(m)
        except NameError:
            # Built inside forward (litgpt: ``clamp_head = nn.Identity()``): it has no name a
            # stage could call it by, and it is rebuilt on every call anyway, so record what
            # its forward does, in the enclosing module's scope.
            return forward(*args, **kwargs)
        is_root = qualname == ROOT
        leaf = self.is_leaf_module(m, qualname)
        name = "" if is_root else _strip(qualname)
        if not is_root:
            self.gsched_invocations += 1
            self.gsched_scope.append((name, self.gsched_invocations))
        if not leaf:
            self.traced_into.setdefault(name, m)
        if not is_root:  # the root's call is fixed by its input layout (cache_off)
            off = omitted_cache(m.forward, args, kwargs)
            if off:
                kwargs = {**kwargs, **off}
                self.cache_off.setdefault(name)
        # what a traced call must leave as it found (a leaf runs for real at every call)
        before = None if leaf else (subtree_attributes(m), draw_marks(m))
        try:
            result = super().call_module(m, forward, args, kwargs)
            if before is not None:
                attributes, marks = before
                where = f"{name or 'the model'}'s forward ({type(m).__name__})"
                refuse_unguarded_draws(marks, draw_marks(m), where)
                _refuse_state_change(m, name, attributes)
            return result
        except Exception as exc:
            if not leaf:
                attach_failure_site(exc, name, type(m))
            raise
        finally:
            if not is_root:
                self.gsched_scope.pop()

    def create_node(
        self,
        kind: str,
        target: Target,
        args: tuple[Argument, ...],
        kwargs: dict[str, Argument],
        name: str | None = None,
        type_expr: Any | None = None,
    ) -> fx.Node:
        if kind in ("call_module", "get_attr") and isinstance(target, str):
            if target.startswith(ROOT + "."):
                target = _strip(target)
                name = name or target.replace(".", "_")
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta[SCOPE] = tuple(self.gsched_scope)
        if self.concrete is not None:
            self.concrete.record(node)
        return node

    def proxy(self, node: fx.Node) -> fx.Proxy:
        if self.concrete is not None:
            return ConcreteProxy(node, self)
        return GschedProxy(node, self)


class ModuleStateChanged(RuntimeError):
    """A traced forward set a plain attribute of its module (a counter, a cache, a flag)."""


def _refuse_state_change(module: nn.Module, name: str, before: SubtreeState) -> None:
    """Raise :class:`ModuleStateChanged` when ``module``'s forward changed plain attributes of
    itself or of a module under it while traced (:func:`.preserve.changed_subtree_attributes`:
    a tensor kept on a module is not counted). Why: the graph records tensor operations only,
    so the split would never make that change again (``self.calls += 1`` stays at its traced
    value, a branch on it never flips; an ``initialized`` flag never set, so a data-dependent
    initialisation runs at every call; ``self.block.use_cache = False`` never reaches the
    block). Raised inside the module's call, it makes the module an automatic leaf: it runs
    whole, for real, at every call, and the attributes change as on one device. A submodule
    that sets its own is found at its own call first, so the smallest module doing it is the
    one kept whole. The tracer restores them afterwards."""
    changed = changed_subtree_attributes(module, before)
    if changed:
        where = name or "the model's own"
        raise ModuleStateChanged(
            f"{where} forward ({type(module).__name__}) sets "
            f"{', '.join('self.' + key for key in changed)} while traced: the split would not "
            "set it again at later calls. The module runs whole instead; in the root forward, "
            "keep such state in a submodule, or in a buffer updated in place "
            "(self.step.add_(1), not self.step += 1 or self.step = self.step + 1)")


class _TraceRootBase(nn.Module):
    """Holds the user's module; a generated ``forward`` takes the flat tensor leaves."""

    def __init__(self, module: nn.Module, layout: InputLayout) -> None:
        super().__init__()
        setattr(self, ROOT, module)
        self._gsched_layout = layout
        self._gsched_outputs: OutputLayout | None = None
        self._gsched_stale_outputs: list[str] = []

    def _gsched_call(self, tensors: tuple[Any, ...]) -> tuple[Any, ...]:
        args, kwargs = self._gsched_layout.unflatten(tensors)
        out = getattr(self, ROOT)(*args, **kwargs)
        self._gsched_outputs, proxies = OutputLayout.split(out)
        self._gsched_stale_outputs = trace_time_objects(out)
        return tuple(proxies)


def _make_root(module: nn.Module, layout: InputLayout) -> _TraceRootBase:
    params = ", ".join(layout.placeholder_names)
    packed = f"({params},)" if layout.placeholder_names else "()"
    source = f"def forward(self, {params}):\n    return self._gsched_call({packed})\n"
    filename = f"<gsched trace root of {type(module).__name__}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict[str, Any] = {}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - generated signature only
    cls = type("GschedTraceRoot", (_TraceRootBase,), {"forward": namespace["forward"]})
    root: _TraceRootBase = cls(module, layout)
    return root


def target_name(node: fx.Node) -> str:
    """A ``call_module`` / ``get_attr`` / ``call_method`` node's target: a qualified name (fx
    types any target as a name or a callable; only ``call_function`` targets are callables)."""
    assert isinstance(node.target, str), node.format_node()
    return node.target


@dataclass
class TracedModel:
    """The traced graph plus everything needed to run and slice it."""

    module: nn.Module
    graph: fx.Graph
    inputs: InputLayout
    outputs: OutputLayout
    constants: dict[str, Any]  # get_attr targets that fx invented for tensors made while tracing
    auto_leaves: dict[str, str] = field(default_factory=dict)  # fqn -> why it became a leaf
    traced_into: dict[str, nn.Module] = field(default_factory=dict)
    cache_off: tuple[str, ...] = ()  # submodules traced as if called with use_cache=False
    mode_dependent: str | None = None  # why the graph differs between train() and eval()
    # the module's mode when traced; with mode_dependent, the graph of the other mode (None
    # when that mode could not be traced), its constants being in ``constants`` too
    traced_training: bool = True
    other_mode_graph: fx.Graph | None = None
    static_shapes: bool = False  # sizes were specialised to the example (see .concrete)
    attempts: tuple[str, ...] = ()  # how each tracing mode tried ended (see .attempts)
    static_tried: bool = False  # the static-shape mode was among the attempts
    leaf_modules: tuple[Any, ...] = ()  # the leaf_modules argument, for messages
    static_shapes_option: bool | None = None  # the static_shapes argument, for messages

    def resolve(self, target: str) -> Any:
        """The object a ``call_module``/``get_attr`` target names (original FQN or constant)."""
        if target in self.constants:
            return self.constants[target]
        obj: Any = self.module
        for atom in target.split(".") if target else ():
            obj = getattr(obj, atom)
        return obj


def _trace_once(
    module: nn.Module,
    layout: InputLayout,
    classes: tuple[type, ...],
    names: frozenset[str],
    example: list[torch.Tensor] | None,
) -> tuple[fx.Graph, GschedTracer, _TraceRootBase]:
    """One trace; ``example`` (the tensor leaves of the example call) selects static shapes."""
    root = _make_root(module, layout)

    def resolve(target: str) -> Any:
        try:
            return _walk(module, target)
        except AttributeError:
            return _walk(root, target)

    concrete = ConcreteValues(example, resolve) if example is not None else None
    tracer = GschedTracer(classes, names, concrete)

    def where() -> str:  # the innermost module being traced, for the checkpoint warning
        return (f"module {tracer.gsched_scope[-1][0]!r}" if tracer.gsched_scope
                else "the forward itself")

    with preserved_attributes(module), preserved_tensors_and_rng(module), \
            recording_autograd_functions(), host_draws_refused(), grad_mode_switches_refused(), \
            traced_code(), checkpoint_calls_noted(where) as checkpointed:
        graph = tracer.trace(root)
    warn_checkpoint_traced(checkpointed, type(module).__name__)
    return graph, tracer, root


def _walk(obj: Any, target: str) -> Any:
    for atom in target.split(".") if target else ():
        obj = getattr(obj, atom)
    return obj


def _collect_constants(graph: fx.Graph, root: nn.Module, prefix: str = CONSTANT_PREFIX
                       ) -> dict[str, Any]:
    """Rename fx's ``_tensor_constant*`` targets (tensors built while tracing) and keep them."""
    constants: dict[str, Any] = {}
    user = getattr(root, ROOT)
    for node in graph.nodes:
        if node.op == "get_attr" and not _resolves(user, node.target):
            name = f"{prefix}{len(constants)}"
            constants[name] = getattr(root, node.target)
            node.target = name
    return constants


def _resolves(module: nn.Module, target: str) -> bool:
    obj: Any = module
    for atom in target.split("."):
        if not hasattr(obj, atom):
            return False
        obj = getattr(obj, atom)
    return True


def _mode_difference(first: fx.Graph, second: fx.Graph) -> str | None:
    a = first.python_code("self").src.splitlines()
    b = second.python_code("self").src.splitlines()
    if a == b:
        return None
    for line_a, line_b in zip(a, b, strict=False):  # the first difference, if within both
        if line_a != line_b:
            return f"train/eval traces differ at: {line_a.strip()!r} vs {line_b.strip()!r}"
    return "train/eval traces differ in length"


def _flip_mode_difference(
    module: nn.Module,
    layout: InputLayout,
    classes: tuple[type, ...],
    names: frozenset[str],
    example: list[torch.Tensor] | None,
    graph: fx.Graph,
) -> tuple[str | None, fx.Graph | None, dict[str, Any]]:
    """Trace again with ``training`` flipped; a different graph means forward reads the mode.

    Returns (why the graphs differ or None, the other mode's graph when they differ, its
    constants under names of their own so both graphs' constants can live side by side).
    """
    try:
        with in_mode([module], not module.training):
            other, _, other_root = _trace_once(module, layout, classes, names, example)
            # the first trace's names: comparable
            constants = _collect_constants(other, other_root)
    except Exception as exc:  # noqa: BLE001 - the other mode cannot even be traced
        return (f"forward cannot be traced in the other mode ({type(exc).__name__}: {exc})",
                None, {})
    reason = _mode_difference(graph, other)
    if reason is None:
        return None, None, {}
    renamed = {}  # both graphs' constants live in one table: the other mode's get own names
    for node in other.nodes:
        if node.op == "get_attr" and node.target in constants:
            new_name = OTHER_MODE_CONSTANT_PREFIX + node.target[len(CONSTANT_PREFIX):]
            renamed[new_name] = constants[node.target]
            node.target = new_name
    return reason, other, renamed


def trace_model(
    module: nn.Module,
    example_args: Sequence[Any],
    example_kwargs: dict[str, Any] | None,
    leaf_modules: Sequence[type | str] = (),
    auto_leaf: bool = True,
    static_shapes: bool | None = None,
    num_stages: int | None = None,
) -> TracedModel:
    """Trace ``module.forward`` for calls shaped like the example; see the module docstring.

    ``static_shapes``: ``False`` never specialises sizes, ``True`` always does, ``None`` (default)
    tries the symbolic trace first and static shapes when it fails or keeps a submodule whole
    that holds too much of the model for ``num_stages`` stages (order: :mod:`.attempts`).
    """
    signature = inspect.signature(module.forward)
    args, kwargs = tuple(example_args), dict(example_kwargs or {})
    layout = InputLayout.from_example(type(module).__name__, signature, args, kwargs)
    layout = dataclasses.replace(
        layout, fixed_keywords=fixed_keywords(signature, bind_arguments(signature, args, kwargs)))
    classes, names = resolve_leaf_modules(module, leaf_modules)
    example = layout.flatten(args, kwargs)

    def attempt(static: bool) -> Attempt:
        def trace(auto: frozenset[str]) -> tuple[fx.Graph, GschedTracer, _TraceRootBase]:
            return _trace_once(module, layout, classes, names | auto, example if static else None)

        return run_attempt(trace, module, static, auto_leaf)

    attempts: list[Attempt] = []
    if static_shapes is not True:
        attempts.append(attempt(static=False))
    if static_shapes is True or (
        static_shapes is None and needs_static(attempts[0], leaf_limit(num_stages))
    ):
        attempts.append(attempt(static=True))
    chosen = choose(attempts)
    static_tried = any(a.static for a in attempts)
    if chosen is None:
        last = attempts[-1].failure
        assert last is not None
        path, cls = failure_site(last)
        symbolic_failure = attempts[0].failure if len(attempts) > 1 else None
        raise TraceFailedError(
            failure_message(
                module, path or "", cls or type(module), last, symbolic_failure, static_tried
            )
        ) from last
    graph, tracer, root = chosen.result
    if root._gsched_stale_outputs:
        raise UntracedOutputError(
            untraced_output_message(type(module).__name__, root._gsched_stale_outputs))
    if chosen.static:
        layout = layout.with_static_shapes(example)
    constants = _collect_constants(graph, root)
    assert root._gsched_outputs is not None
    traced = TracedModel(
        module=module,
        graph=graph,
        inputs=layout,
        outputs=root._gsched_outputs,
        constants=constants,
        auto_leaves=dict(chosen.auto_leaves),
        traced_into=dict(tracer.traced_into),
        cache_off=tuple(tracer.cache_off),
        static_shapes=chosen.static,
        attempts=tuple(a.describe() for a in attempts),
        static_tried=static_tried,
        leaf_modules=tuple(leaf_modules),
        static_shapes_option=static_shapes,
    )
    traced.traced_training = module.training
    traced.mode_dependent, traced.other_mode_graph, other_constants = _flip_mode_difference(
        module,
        layout,
        classes,
        names | frozenset(chosen.auto_leaves),
        example if chosen.static else None,
        graph,
    )
    traced.constants.update(other_constants)
    return traced

