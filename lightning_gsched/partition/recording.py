"""What plain torch.fx gets silently wrong, recorded faithfully instead.

Three things a forward can do that fx's default tracer does not record, each of which used to
give a split that ran but computed something else, without a word:

* **Custom autograd Functions.** ``MyFn.apply(x)`` on proxies runs ``MyFn.forward`` symbolically
  and records its operations, so the graph differentiates the forward with autograd and the
  user's ``backward`` never runs: a straight-through estimator (``forward`` rounds, ``backward``
  passes the gradient through) gave the weight before it a zero gradient. Here the call is
  recorded as **one opaque node** whose target calls ``MyFn.apply`` for real, so the stage's
  autograd graph holds the Function's own backward node (:class:`FunctionApply`,
  :func:`recording_autograd_functions`).
* **Attribute assignment on a traced value** (``outputs.pooler_output = proj(...)`` on the
  output of a module kept whole, CLIP): Python stored the attribute on the Proxy object and the
  graph never saw it. Recorded as a ``setattr`` node (:class:`RecordsMutation`).
* **Item assignment** (``x[:, 1:] = y``, Bart's ``shift_tokens_right``): fx's Proxy has no
  ``__setitem__``, so tracing failed and the automatic-leaf fallback kept the whole model in one
  stage. Recorded as an ``operator.setitem`` node.

Both mutation nodes have no users; they are units like any other (dead code is kept), and run
in forward order, so every later read sees the mutated value as in eager mode.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch.fx.proxy import Attribute
from torch.utils import _pytree as pytree

# the attributes fx's Proxy and Attribute set on themselves; any other assignment is the user's
_PROXY_FIELDS = frozenset({"tracer", "node", "root", "attr", "_node"})

_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]  # the classmethod object


class FunctionApply:
    """Graph node target: ``function.apply(*args, **kwargs)``, one opaque call.

    A plain callable with a ``__name__`` and ``__module__`` so fx's code generator can name it,
    and picklable by reference to the Function class, so stages still deepcopy and save.
    """

    def __init__(self, function: type[torch.autograd.Function]) -> None:
        self.function = function
        self.__name__ = f"{function.__name__}_apply"
        self.__qualname__ = self.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function.apply(*args, **kwargs)  # type: ignore[no-untyped-call]  # untyped

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FunctionApply) and other.function is self.function

    def __hash__(self) -> int:
        return hash(self.function)

    def __reduce__(self) -> tuple[Any, ...]:
        return (FunctionApply, (self.function,))

    def __repr__(self) -> str:
        return f"{self.function.__qualname__}.apply"


_targets: dict[type, FunctionApply] = {}


def function_target(function: type[torch.autograd.Function]) -> FunctionApply:
    """One target object per Function class, so equal calls compare equal across traces."""
    if function not in _targets:
        _targets[function] = FunctionApply(function)
    return _targets[function]


def _tracer_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The tracer of the first proxy among the arguments (None: a call on real values)."""
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, fx.Proxy):
            return leaf.tracer
    return None


class FunctionArgumentError(TypeError):
    """A custom Function got an argument a graph cannot hold (the tracer then keeps the
    enclosing submodule whole, where the Function runs for real)."""


@classmethod  # type: ignore[misc]
def _recording_apply(cls: type[torch.autograd.Function], *args: Any, **kwargs: Any) -> Any:
    tracer = _tracer_of(args, kwargs)
    if tracer is None:
        return _ORIGINAL_APPLY.__func__(cls, *args, **kwargs)
    try:
        return tracer.create_proxy("call_function", function_target(cls), args, kwargs)
    except NotImplementedError as exc:  # fx's create_arg: an object a graph cannot refer to
        raise FunctionArgumentError(
            f"custom autograd Function {cls.__qualname__}.apply takes an argument a traced "
            f"graph cannot hold ({exc}); it must run for real, inside a module kept whole"
        ) from None


@contextlib.contextmanager
def recording_autograd_functions() -> Iterator[None]:
    """While tracing, ``Function.apply`` on proxies records one node instead of inlining.

    Subclasses that define their own ``apply`` are left alone (they do not reach this one).
    Not thread-safe, like fx's own patching of ``nn.Module.__call__`` during a trace.
    """
    torch.autograd.Function.apply = _recording_apply  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.autograd.Function.apply = _ORIGINAL_APPLY  # type: ignore[method-assign]


class RecordsMutation:
    """Proxy mixin: ``proxy[key] = value`` and ``proxy.name = value`` become graph nodes."""

    tracer: Any

    def __setitem__(self, key: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _PROXY_FIELDS:
            object.__setattr__(self, name, value)
            return
        self.tracer.create_proxy("call_function", setattr, (self, name, value), {})


class GschedAttribute(RecordsMutation, Attribute):
    """fx's lazy attribute proxy, recording assignments too (``proxy.a.b = v``)."""


class GschedProxy(RecordsMutation, fx.Proxy):
    """fx's proxy for the symbolic mode, recording assignments (the static mode's proxy,
    :class:`.concrete.ConcreteProxy`, records them the same way)."""

    def __getattr__(self, name: str) -> GschedAttribute:
        return GschedAttribute(self, name)


# Python's augmented assignments, which fx records as these operators on tensors
_IN_PLACE_OPERATORS = frozenset({
    operator.setitem, setattr, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul, operator.iand,
    operator.ior, operator.ixor, operator.ilshift, operator.irshift,
})


def mutated_value(node: fx.Node, resolve: Callable[[str], Any]) -> fx.Node | None:
    """The value an in-place unit changes (None: not one): item or attribute assignment,
    ``x += y``, ``x.add_(y)``, ``F.relu(x, inplace=True)``, a module with ``inplace=True``
    (``nn.ReLU(inplace=True)``, found through ``resolve(target)``)."""
    if not node.args:
        return None
    if node.op == "call_function":
        changes = node.target in _IN_PLACE_OPERATORS or node.kwargs.get("inplace") is True
    elif node.op == "call_method":
        changes = isinstance(node.target, str) and _in_place(node.target)
    elif node.op == "call_module":
        changes = getattr(resolve(str(node.target)), "inplace", False) is True
    else:
        changes = False
    target = node.args[0]
    return target if changes and isinstance(target, fx.Node) else None


def writable_copy(value: Any) -> Any:
    """A stage's own copy of a received tensor that the stage changes in place.

    Why: a stage receives its inputs as fresh leaves that need a gradient (runtime/wire.py), and
    autograd refuses to change such a leaf in place (``nn.ReLU(inplace=True)`` as a stage's
    first unit). The copy is not a leaf, its gradient flows to the received one, and every later
    use in the stage (and what the stage hands on) reads the copy, so they all see the change as
    in eager mode. Only tensors are copied; other values are changed as they are.
    """
    return value.clone() if isinstance(value, torch.Tensor) else value


def _in_place(method: str) -> bool:
    return method.endswith("_") and not method.endswith("__")
