"""Static-shape tracing: the fallback for forwards that compute with sizes in Python.

Plain torch.fx cannot trace ``torch.ones(t, t)`` where ``t`` came from ``x.shape``,
``range(x.size(1))``, ``len(x)`` or ``if x.dim() == 3`` — a very common reason real models fail
(``lightning.pytorch.demos.Transformer`` is one). In *static-shape* mode the tracer runs every
recorded operation on the example input as well, and proxies answer metadata questions
(``shape``, ``size()``, ``dim()``, ``dtype``, ``device``, ``len()``, unpacking) with the
example's concrete values. Sizes are then baked into the graph, so the partition only accepts
inputs with the example's shapes (stage 0 checks this and says so). Data-dependent branches
(``if x.sum() > 0``) still fail: values are never specialised, only metadata.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch.fx.proxy import Attribute

from lightning_gsched.host_random import real_code, states_kept
from lightning_gsched.partition.preserve import generators_kept, preserved_attributes
from lightning_gsched.partition.recording import RecordsMutation

try:  # private: lifts fx's patches of nn.Module.__call__/__getattr__ while we run real code
    from torch.fx._symbolic_trace import _maybe_revert_all_patches as _revert_patches
except ImportError:  # pragma: no cover - older/newer torch: static shapes may be unavailable
    _revert_patches = contextlib.nullcontext  # type: ignore[assignment]

_untraced_depth = 0


@contextlib.contextmanager
def _untraced() -> Iterator[None]:
    """Run real code without fx's patches; re-entrant (fx's own helper re-patches on an inner
    exit, which would leave the rest of the outer block traced)."""
    global _untraced_depth
    if _untraced_depth:
        yield
        return
    _untraced_depth += 1
    try:
        with _revert_patches():
            yield
    finally:
        _untraced_depth -= 1

_MISSING = object()
META_ATTRIBUTES = frozenset(
    {
        "shape",
        "ndim",
        "dtype",
        "device",
        "is_cuda",
        "layout",
        "is_sparse",
        "is_quantized",
        "is_meta",
        "is_nested",
    }
)
META_METHODS = frozenset(
    {
        "size",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "element_size",
        "get_device",
        "is_floating_point",
        "is_complex",
    }
)


class _ConcreteMixin:
    """Metadata from the example value; everything else stays symbolic."""

    def _concrete(self) -> Any:
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        if name in META_ATTRIBUTES or name in META_METHODS:
            value = self._concrete()
            if isinstance(value, torch.Tensor):
                return getattr(value, name)
        return ConcreteAttribute(self, name)  # type: ignore[arg-type]

    def __len__(self) -> int:
        value = self._concrete()
        if value is _MISSING:
            return fx.Proxy.__len__(self)  # type: ignore[arg-type]  # raises fx's error
        return len(value)

    def __iter__(self) -> Iterator[Any]:
        value = self._concrete()
        if isinstance(value, (torch.Tensor, tuple, list)):
            return iter([self[i] for i in range(len(value))])  # type: ignore[index]
        return fx.Proxy.__iter__(self)  # type: ignore[arg-type]


class ConcreteProxy(RecordsMutation, _ConcreteMixin, fx.Proxy):
    def _concrete(self) -> Any:
        return self.tracer.concrete.value_of(self.node)


class ConcreteAttribute(RecordsMutation, _ConcreteMixin, Attribute):
    def _concrete(self) -> Any:
        owner = self.root._concrete() if isinstance(self.root, _ConcreteMixin) else _MISSING
        if owner is _MISSING:
            return _MISSING
        try:
            return getattr(owner, self.attr)
        except Exception:  # noqa: BLE001
            return _MISSING


class ConcreteValues:
    """Example values of the nodes being traced, computed eagerly as nodes are recorded."""

    def __init__(self, example_tensors: list[torch.Tensor], resolve: Any) -> None:
        self.inputs = [t.detach().clone() for t in example_tensors]  # in-place ops stay local
        self.resolve = resolve  # get_attr target -> object
        self.values: dict[fx.Node, Any] = {}
        self.placeholders = 0

    def value_of(self, node: fx.Node) -> Any:
        if node not in self.values and node.op == "get_attr":
            # Unpatched: under fx's Module.__getattr__ reading a parameter or buffer records
            # another get_attr node, whose value is resolved here again, forever.
            try:
                with _untraced():
                    self.values[node] = self.resolve(node.target)
            except AttributeError:
                self.values[node] = _MISSING
        return self.values.get(node, _MISSING)

    def record(self, node: fx.Node) -> None:
        """Compute ``node``'s example value from its inputs' (``_MISSING`` if impossible)."""
        if node.op == "placeholder":
            self.values[node] = self.inputs[self.placeholders]
            self.placeholders += 1
            return
        if node.op not in ("call_function", "call_method", "call_module", "get_attr"):
            return
        if node.op == "get_attr":
            self.value_of(node)
            return
        missing = []

        def load(n: fx.Node) -> Any:
            value = self.value_of(n)
            if value is _MISSING:
                missing.append(n)
            return value

        args = fx.node.map_arg(node.args, load)
        kwargs = fx.node.map_arg(node.kwargs, load)
        if missing:
            self.values[node] = _MISSING
            return
        try:
            with real_code(), states_kept(), torch.no_grad(), _untraced():
                if node.op == "call_function":
                    value = node.target(*args, **kwargs)  # type: ignore[operator]
                elif node.op == "call_method":
                    value = getattr(args[0], node.target)(*args[1:], **kwargs)  # type: ignore[arg-type]
                else:  # a leaf's state is its own at every call, not the traced code's
                    leaf = self.resolve(node.target)
                    with preserved_attributes(leaf), generators_kept(leaf):
                        value = leaf(*args, **kwargs)
        except Exception:  # noqa: BLE001 - metadata for this value is simply unavailable
            value = _MISSING
        self.values[node] = value
