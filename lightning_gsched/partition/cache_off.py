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
"""

from __future__ import annotations

import inspect
from typing import Any

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
