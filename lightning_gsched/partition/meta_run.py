"""Run a model built without weights (parameters on the meta device): traced, then sized.

Why: a deferred model (runtime/materialize.py) has no weights yet, and the build runs it before
any rank has its own. On the meta device every operation yields its output's shape and dtype
without computing anything, so the trace (and the example run that sizes what crosses each cut)
first runs there (:func:`traced_without_weights`). But tensors a forward builds outside the
graph (an attention mask, positions: the split keeps them as constants) then have no values,
the device they read is ``meta``, and code that reads a value (``.item()``) fails. Such a model
is traced again with real-device stand-ins of its parameters (:func:`stand_ins`: one zero per
tensor, no memory; a real forward of one microbatch), so those tensors get their real values.
The memory prediction runs each stage forward and backward for the bytes it saves, which with
stand-ins would allocate every weight's gradient: it runs on meta tensors, inside
:func:`on_meta`, where the buffers, the split's constants and every device a stage names (a
literal ``x.to(device='cpu')`` a real trace recorded) are meta too, since a kernel mixing a
meta tensor with a real one refuses.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar

import torch
import torch.fx as fx
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from lightning_gsched.partition.errors import PartitionError
from lightning_gsched.partition.tracer import CONSTANT_PREFIX

_T = TypeVar("_T")


def has_meta_parameters(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def to_meta(tree: Any) -> Any:
    """The same pytree with every tensor replaced by a meta tensor of its shape and dtype."""
    return pytree.tree_map(
        lambda t: t.to("meta") if isinstance(t, torch.Tensor) and not t.is_meta else t, tree)


def traced_without_weights(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                           trace: Callable[[tuple[Any, ...], dict[str, Any]], _T],
                           valueless: Callable[[_T], bool]) -> _T:
    """``trace(args, kwargs)`` of a model without weights: on meta tensors when that keeps
    nothing ``valueless`` and does not fail, else on :func:`stand_ins` (module doc). A failure
    there is the model's, raised as it is."""
    try:
        with _buffers_on_meta(module):
            result = trace(to_meta(args), to_meta(kwargs))
        if not valueless(result):
            return result
    except PartitionError:
        pass  # e.g. a value read on meta: the real example says whether the model is at fault
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    try:
        with stand_ins(module, tensors[0].device if tensors else torch.device("cpu")):
            return trace(args, kwargs)
    except PartitionError as exc:
        raise type(exc)(
            f"{str(exc).rstrip('.')}. (The model is built without weights, so it was traced "
            "on stand-ins of its parameters: real tensors holding one zero each, with stride 0. "
            "An operation that needs real strides refuses them, e.g. grouped_mm in "
            "mixture-of-experts layers; if the error names such an operation rather than your "
            "input, build this model with its weights, in a process that can hold it)") from exc


def keeps_meta_values(nodes: Iterable[fx.Node], constants: Mapping[str, Any]) -> bool:
    """Whether a trace on meta kept a tensor built while traced (a constant of the split) or
    a device it read (a literal): on meta, neither is what the stages need at a step."""
    for node in nodes:
        constant = constants.get(str(node.target)) if node.op == "get_attr" else None
        if isinstance(constant, torch.Tensor) and constant.is_meta:
            return True
        if _names_meta_device((node.args, node.kwargs)):
            return True
    return False


def _names_meta_device(value: Any) -> bool:
    found = False

    def visit(leaf: Any) -> Any:
        nonlocal found
        found = found or (isinstance(leaf, torch.device) and leaf.type == "meta") \
            or (isinstance(leaf, str) and leaf == "meta")
        return leaf

    fx.node.map_aggregate(value, visit)
    return found


@contextlib.contextmanager
def on_meta(*modules: nn.Module) -> Iterator[None]:
    """Inside, ``modules`` run on meta tensors alone: every buffer of them (and of their
    submodules) and every constant the split keeps on a stage is a meta copy, and every device
    named in a torch call is the meta device. The real tensors are put back on exit."""
    with _buffers_on_meta(*modules, constants=True), _DevicesOnMeta():
        yield


@contextlib.contextmanager
def _buffers_on_meta(*modules: nn.Module, constants: bool = False) -> Iterator[None]:
    """Every buffer of ``modules`` (and, with ``constants``, every constant of a stage) is a
    meta copy inside."""
    swaps: list[tuple[dict[str, Any], str, Any]] = []
    for module in modules:
        for sub in module.modules():
            attributes = vars(sub)  # the split's constants are plain attributes of a stage
            kept = [name for name in attributes if name.startswith(CONSTANT_PREFIX)]
            stores: tuple[tuple[dict[str, Any], list[str]], ...] = (
                (sub._buffers, list(sub._buffers)), (attributes, kept if constants else []))
            for store, names in stores:
                for name in names:
                    tensor = store[name]
                    if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                        swaps.append((store, name, tensor.to("meta")))
    with _swapped(swaps):
        yield


@contextlib.contextmanager
def _swapped(swaps: list[tuple[dict[str, Any], str, Any]]) -> Iterator[None]:
    """Each ``store[name]`` is ``value`` inside; what was there is put back on exit."""
    saved = [(store, name, store[name]) for store, name, _ in swaps]
    for store, name, value in swaps:
        store[name] = value
    try:
        yield
    finally:
        for store, name, tensor in saved:
            store[name] = tensor


class _DevicesOnMeta(TorchFunctionMode):
    """Every device argument of a torch call is the meta device (``x.to(device)``,
    ``torch.arange(n, device=...)``, ``x.to("cpu")``, ``x.cpu()``): a stage's literal devices,
    recorded by a trace on real tensors, would copy a meta tensor out to a real device, which
    has no data."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in (torch.Tensor.cpu, torch.Tensor.cuda):  # a move: stays on meta
            return args[0]
        kwargs = dict(kwargs or {})
        if "device" in kwargs and kwargs["device"] is not None:
            kwargs["device"] = _META
        args = tuple(_META if isinstance(a, torch.device) else a for a in args)
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], str) \
                and _is_device_name(args[1]):
            args = (args[0], _META, *args[2:])
        return func(*args, **kwargs)


_META = torch.device("meta")


def _is_device_name(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, TypeError):
        return False
    return True


@contextlib.contextmanager
def stand_ins(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Every meta parameter and buffer of ``module`` is, inside, a real tensor on ``device`` of
    its shape and dtype that holds a single zero (stride 0: no memory of its size).

    Why: a model built without weights is traced by running it on the example (the static-shape
    mode runs every recorded operation, and code fx cannot enter runs as it is). On meta
    tensors, tensors the forward builds outside the graph (a causal mask, positions from
    ``torch.arange(t, device=x.device)``) had no values, the device they read was ``meta``,
    and code reading a value (``.item()``) failed. With stand-ins the example and the buffers
    stay real, so such tensors get their real values and devices. What the stand-ins' zeros
    flow into are activations, which the trace records as graph operations (run again on the
    real weights at every step), never as constants. Tied parameters stay tied (one stand-in)."""
    swaps: list[tuple[dict[str, Any], str, Any]] = []
    made: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        stores: tuple[dict[str, Any], ...] = (sub._parameters, sub._buffers)
        for store in stores:
            for name, tensor in list(store.items()):
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) not in made:
                    zero = torch.zeros((), dtype=tensor.dtype, device=device).expand(tensor.shape)
                    made[id(tensor)] = (nn.Parameter(zero, requires_grad=tensor.requires_grad)
                                        if isinstance(tensor, nn.Parameter) else zero)
                swaps.append((store, name, made[id(tensor)]))
    with _swapped(swaps):
        yield
