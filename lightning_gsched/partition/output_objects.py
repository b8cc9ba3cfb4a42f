"""Find trace-time objects in a traced forward's return value, which a split must never return.

A graph returns tensors and pytrees of them. Anything else in the output (a leaf pytree does not
enter) is kept as it was while tracing and handed back on every call: transformers'
``DynamicCache`` (any causal LM called with its default ``use_cache``) came back as the *same
object every call*, its keys and values being the tracer's placeholders. The tensor-leaf
comparisons of tests could not see it. This module walks every non-pytree leaf of the output,
through attributes, lists, tuples and dicts, and reports those that reach a traced value or a
tensor; :func:`.tracer.trace_model` refuses the split with :class:`.errors.UntracedOutputError`.
Plain values (ints, strings, a config object without tensors) stay allowed: they are constants
in the unsplit model too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from lightning_gsched.partition.layout import PLAIN_TYPES

MAX_DEPTH = 6  # how deep inside an object to look; caches hold lists of tensors two levels down


def _holds_tensors(obj: Any, depth: int, seen: set[int]) -> bool:
    if isinstance(obj, (fx.Proxy, torch.Tensor)):
        return True
    if depth == 0 or id(obj) in seen or isinstance(obj, PLAIN_TYPES) or isinstance(obj, type):
        return False
    seen.add(id(obj))
    if isinstance(obj, dict):
        children: Any = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    else:
        children = list(getattr(obj, "__dict__", {}).values())
        children += [getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ())
                     if isinstance(s, str)]
    return any(_holds_tensors(child, depth - 1, seen) for child in children)


def _where(path: tuple[Any, ...]) -> str:
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                value = getattr(key, attr)
                parts.append(f".{value}" if attr == "name" else f"[{value!r}]")
                break
        else:
            parts.append(f"[{key}]")
    return "output" + "".join(parts)


def trace_time_objects(output: Any) -> list[str]:
    """``"output['past_key_values'] (DynamicCache)"`` for each leaf that would be returned stale
    (``"output (Out, a plain @dataclass)"`` for a dataclass: torch's pytree does not enter one
    that is not registered, so it is a leaf).

    A leaf is stale when it is not a traced value, not a plain value, and holds a tensor or a
    traced value somewhere inside; a real tensor leaf is stale too (it was computed once, while
    tracing, and would be the same tensor on every call).
    """
    stale = []
    for path, leaf in pytree.tree_flatten_with_path(output)[0]:
        if isinstance(leaf, fx.Proxy) or isinstance(leaf, PLAIN_TYPES):
            continue
        if _holds_tensors(leaf, MAX_DEPTH, set()):
            kind = ", a plain @dataclass" if dataclasses.is_dataclass(leaf) else ""
            stale.append(f"{_where(path)} ({type(leaf).__name__}{kind})")
    return stale


def untraced_output_message(owner: str, stale: list[str]) -> str:
    """The error for :func:`trace_time_objects`' findings: what is wrong and the fixes."""
    cache = any("Cache" in s for s in stale)
    if all(s.endswith("(Tensor)") or s.endswith("(Parameter)") for s in stale):
        return (
            f"{owner}.forward returns {', '.join(stale)}: a tensor computed once while tracing "
            "(not from the inputs, parameters or buffers), so a split would return that same "
            "tensor on every call. Register it as a buffer (self.register_buffer) or compute "
            "it in forward from the inputs."
        )
    fixes = (
        "For transformers models this is the key/value cache: turn it off for training with "
        "`model.config.use_cache = False` (or pass use_cache=False in the call and in "
        "example_kwargs). "
        if cache else ""
    )
    plain = sorted({s.rsplit(" (", 1)[1].split(",")[0] for s in stale
                    if s.endswith(", a plain @dataclass)")})
    registration = (
        f"A @dataclass is not a pytree node in torch unless registered (torch.utils._pytree "
        f"takes it as one leaf): register it once, after its definition, with "
        f"{', '.join(f'torch.utils._pytree.register_dataclass({c})' for c in plain)} so each "
        "call rebuilds it "
        "with this call's tensors. " if plain else "")
    return (
        f"{owner}.forward returns {', '.join(stale)}: "
        f"{'an object' if len(stale) == 1 else 'objects'} holding tensors that is not a pytree "
        "of them, so a split could only return the object built while tracing, the same one "
        "on every call, with the tracer's values inside (never this call's). "
        + fixes + registration
        + "Otherwise return the tensors in a tuple, list or dict, or in a class registered as "
        "a pytree node so each call rebuilds it: torch.utils._pytree.register_dataclass for a "
        "@dataclass, torch.utils._pytree.register_pytree_node for another class."
    )
