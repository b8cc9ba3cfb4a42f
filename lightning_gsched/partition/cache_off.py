"""Trace with the key/value cache off when the forward has one and the call leaves it on.

Why: a causal language model called with its default ``use_cache`` (transformers: GPT-2, Llama,
Mixtral, Mamba...) builds a cache object in forward. A graph cannot return it (it would be the
object built while tracing, stale on every call: :mod:`.output_objects`), and a module handed it
as an argument cannot be traced into (transformers' Mamba in eval mode: the whole backbone
became one stage). Training never reads the cache, and a pipeline could not hand it between
stages anyway. So when ``forward`` has a ``use_cache`` parameter and the example call does not
set it, the model is traced as if called with ``use_cache=False``; the report says so
(``part.fixed_keywords``), and calls that leave ``use_cache`` out behave the same. A call
that passes ``use_cache=True`` explicitly keeps it, and a cache object in the output is then
refused with :class:`.errors.UntracedOutputError`.

The same rule holds for every submodule the trace reaches (:func:`omitted_cache`): a model
wrapped in a LightningModule (``self.model(tokens)``) is a submodule whose call leaves
``use_cache`` out, and its cache object, handed to each layer's attention, stops the trace at
any attention kept whole (tensor parallelism keeps them so: the whole language model then ran in
one stage). The report names those modules (``part.cache_off_modules``).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from torch import nn

CACHE_KEYWORD = "use_cache"


def fixed_keywords(signature: inspect.Signature, bound: dict[str, Any]) -> dict[str, Any]:
    """``{"use_cache": False}`` when ``forward`` takes ``use_cache`` and the call omits it."""
    parameter = signature.parameters.get(CACHE_KEYWORD)
    if parameter is None or parameter.kind in (inspect.Parameter.VAR_POSITIONAL,
                                               inspect.Parameter.POSITIONAL_ONLY):
        return {}
    if CACHE_KEYWORD in bound:
        return {}
    return {CACHE_KEYWORD: False}


def omitted_cache(forward: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> dict[str, Any]:
    """:func:`fixed_keywords` for one call of a submodule's ``forward``; ``{}`` where its
    signature cannot be read or the call does not bind to it (the call is then left as is)."""
    try:
        signature = inspect.signature(forward)
        bound = signature.bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return {}
    return fixed_keywords(signature, bound)


@contextmanager
def submodule_calls_cache_off(module: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """Inside, the submodules ``names`` (``part.cache_off_modules``) of ``module`` are called as
    the trace called them: with ``use_cache=False`` where the call leaves it out. Why: a run of
    the whole model that stands for the split (verify's reference) must return what the split
    returns; with the cache on, a transformers model's output object carries a cache entry the
    split's does not, and the two differ in structure, not in value."""
    def pre_hook(sub: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, {**kwargs, **omitted_cache(sub.forward, args, kwargs)}

    handles = [module.get_submodule(name).register_forward_pre_hook(pre_hook, with_kwargs=True)
               for name in names]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
