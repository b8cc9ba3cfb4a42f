"""The boundary between the user's call signature and the flat graph.

fx graphs take a flat list of placeholders and return a flat tuple, but users call
``module(*args, **kwargs)`` with any pytree (dicts of tensors, flags, ``None`` masks) and get any
pytree back. :class:`InputLayout` records, from the example call, which leaves of the bound
arguments are tensors (graph inputs) and which are plain Python values (fixed at trace time,
because control flow may depend on them); :class:`OutputLayout` records how to rebuild the
original output from the graph's flat outputs. Stage 0 and the last stage use them so that the
partition is called exactly like the module.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import keyword
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx
from torch.utils import _pytree as pytree

from lightning_gsched.partition.errors import PartitionError, StageInputError

# Leaves that are fixed into the trace. Anything else that is not a tensor or a pytree container
# is rejected, because silently baking an arbitrary object (maybe holding tensors) into the graph
# would make later calls ignore their inputs.
PLAIN_TYPES: tuple[type, ...] = (
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type(None),
    type(Ellipsis),
    slice,
    range,
    enum.Enum,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.Size,
)


def bind_arguments(signature: inspect.Signature, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> dict[str, Any]:
    """Bind a call to ``forward``'s signature; ``**kwargs`` are sorted so key order never matters."""
    bound = signature.bind(*args, **kwargs)
    arguments = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in arguments:
            arguments[name] = dict(sorted(arguments[name].items()))
    return arguments


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and a != a and b != b:  # both NaN
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - exotic __eq__; treat as different
        return False


def _describe(tree: Any) -> str:
    """A short structural description (tensors shown by shape) for error messages."""

    def show(leaf: Any) -> str:
        if isinstance(leaf, torch.Tensor):
            return f"Tensor{tuple(leaf.shape)}"
        if isinstance(leaf, torch.fx.Proxy):
            return "Tensor"
        return repr(leaf)

    return repr(pytree.tree_map(show, tree)).replace("'", "")


def _identifier(parts: Sequence[str], taken: set[str]) -> str:
    name = "_".join(parts) or "input"
    name = re.sub(r"\W", "_", name)
    if name[0].isdigit() or keyword.iskeyword(name) or name in ("self", "torch"):
        name = f"in_{name}"
    unique, k = name, 1
    while unique in taken:
        unique, k = f"{name}_{k}", k + 1
    taken.add(unique)
    return unique


def _key_text(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


class _PicklesSpecAsTemplate:
    """Pickle/deepcopy the ``spec`` field as a template tree (ints at the leaves) and re-flatten.

    Copying TreeSpec objects directly goes through torch's deprecated ``LeafSpec`` path (a
    FutureWarning on every deepcopy/torch.save of a stage); a template pickles like plain data.
    """

    spec: pytree.TreeSpec

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        spec = state.pop("spec")
        state["spec_template"] = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        _, spec = pytree.tree_flatten(state.pop("spec_template"))
        for key, value in {**state, "spec": spec}.items():
            object.__setattr__(self, key, value)


@dataclass(frozen=True)
class InputLayout(_PicklesSpecAsTemplate):
    """Flattening of ``forward(*args, **kwargs)`` into the graph's tensor placeholders."""

    owner: str
    signature: inspect.Signature
    spec: pytree.TreeSpec
    tensor_leaves: tuple[int, ...]
    constants: dict[int, Any]
    placeholder_names: tuple[str, ...]
    described: str = field(default="")
    static_shapes: tuple[tuple[int, ...], ...] | None = None  # set when sizes were specialised
    # keyword arguments the trace adds to every call (``use_cache=False``: see .cache_off)
    fixed_keywords: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_example(
        cls, owner: str, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> InputLayout:
        try:
            arguments = bind_arguments(signature, args, kwargs)
        except TypeError as exc:
            raise PartitionError(
                f"example_args/example_kwargs do not fit {owner}.forward{signature}: {exc}. "
                "Pass the same arguments you would pass to module(...)."
            ) from None
        with_paths, spec = pytree.tree_flatten_with_path(arguments)
        tensor_leaves: list[int] = []
        constants: dict[int, Any] = {}
        names: list[str] = []
        taken: set[str] = set()
        for i, (path, leaf) in enumerate(with_paths):
            where = "".join(f"[{_key_text(k)!r}]" for k in path)
            if isinstance(leaf, torch.Tensor):
                tensor_leaves.append(i)
                names.append(_identifier([_key_text(k) for k in path], taken))
            elif isinstance(leaf, PLAIN_TYPES):
                constants[i] = leaf
            else:
                raise PartitionError(
                    f"Argument {where} of {owner}.forward is a {type(leaf).__name__}: stage "
                    "inputs must be tensors, plain Python values, or pytrees (tuple/list/dict/"
                    "namedtuple) of them. Register the class with "
                    "torch.utils._pytree.register_pytree_node, or pass its tensors directly."
                )
        return cls(
            owner=owner,
            signature=signature,
            spec=spec,
            tensor_leaves=tuple(tensor_leaves),
            constants=constants,
            placeholder_names=tuple(names),
            described=_describe(arguments),
        )

    def flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The graph inputs for a call; raises :class:`StageInputError` if it differs from the trace."""
        try:
            arguments = bind_arguments(self.signature, args, kwargs)
        except TypeError as exc:
            raise StageInputError(f"{self.owner}.forward{self.signature}: {exc}") from None
        leaves, spec = pytree.tree_flatten(arguments)
        if spec != self.spec:
            raise StageInputError(
                f"Stage 0 of {self.owner} was traced for arguments shaped like {self.described} "
                f"but was called with {_describe(arguments)}. Which arguments are given, their "
                "nesting and None-ness are fixed at trace time: call partition() with example "
                "arguments of the same structure."
            )
        for i, traced in self.constants.items():
            if not _same_value(leaves[i], traced):
                raise StageInputError(
                    f"Stage 0 of {self.owner} was traced with the plain value {traced!r} at "
                    f"argument leaf {i} ({self.described}) but got {leaves[i]!r}. Non-tensor "
                    "arguments are fixed at trace time (forward may branch on them): partition "
                    "again with this value, or pass it as a tensor."
                )
        tensors = [leaves[i] for i in self.tensor_leaves]
        if self.static_shapes is not None:
            for name, tensor, shape in zip(
                self.placeholder_names, tensors, self.static_shapes, strict=True
            ):
                if tuple(tensor.shape) != shape:
                    raise StageInputError(
                        f"{self.owner} was traced with static shapes (its forward computes with "
                        f"sizes in Python, see the partition report), so input {name!r} must "
                        f"have shape {shape}, got {tuple(tensor.shape)}. Partition with an "
                        "example of this shape, keep batches the same size (drop_last=True), "
                        "or make the forward traceable without static shapes."
                    )
        return tensors

    def with_static_shapes(self, tensors: Sequence[torch.Tensor]) -> InputLayout:
        """This layout, additionally requiring the given (example) tensor shapes."""
        shapes = tuple(tuple(t.shape) for t in tensors)
        return dataclasses.replace(self, static_shapes=shapes)

    def unflatten(self, tensors: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Rebuild ``(args, kwargs)`` from values for the tensor leaves (proxies while tracing)."""
        leaves: list[Any] = [None] * (len(self.tensor_leaves) + len(self.constants))
        for slot, value in zip(self.tensor_leaves, tensors, strict=True):
            leaves[slot] = value
        for slot, value in self.constants.items():
            leaves[slot] = value
        arguments = pytree.tree_unflatten(leaves, self.spec)
        bound = inspect.BoundArguments(self.signature, arguments)
        return bound.args, {**bound.kwargs, **self.fixed_keywords}


@dataclass(frozen=True)
class OutputLayout(_PicklesSpecAsTemplate):
    """How the last stage rebuilds ``module.forward``'s return value from the graph outputs."""

    spec: pytree.TreeSpec
    graph_leaves: tuple[int, ...]
    constants: dict[int, Any]

    @classmethod
    def split(cls, output: Any) -> tuple[OutputLayout, list[torch.fx.Proxy]]:
        """Separate traced proxies (graph outputs) from constants in a traced return value."""
        leaves, spec = pytree.tree_flatten(output)
        graph_leaves, constants, proxies = [], {}, []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.fx.Proxy):
                graph_leaves.append(i)
                proxies.append(leaf)
            else:
                constants[i] = leaf
        return cls(spec=spec, graph_leaves=tuple(graph_leaves), constants=constants), proxies

    def rebuild(self, values: Sequence[Any]) -> Any:
        leaves: list[Any] = [None] * (len(self.graph_leaves) + len(self.constants))
        for slot, value in zip(self.graph_leaves, values, strict=True):
            leaves[slot] = value
        for slot, value in self.constants.items():
            leaves[slot] = value
        return pytree.tree_unflatten(leaves, self.spec)
