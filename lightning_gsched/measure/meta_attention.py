"""Size attention on meta tensors as the real device runs it: the fused kernel, not the math.

Why: a model built without weights (docs/memory.md, "deferred initialisation") is sized on
meta tensors, and on the meta device ``F.scaled_dot_product_attention`` has no fused kernel to
choose, so it decomposes into the math path, which saves the whole ``T x T`` attention matrix
of every head for the backward. On CPU and CUDA the same call runs a fused kernel (flash or
memory-efficient attention) that saves only the query, key, value, output and the
log-sum-exp rows, so meta sizing without this overcounts activation bytes
(docs/benchmarks.md, "Measurements behind design choices").

:func:`fused_attention_on_meta` routes such calls on meta tensors to torch's fused CPU kernel,
whose meta implementation and autograd formula save exactly what the fused kernels save, so
the saved-tensor hooks count the same bytes. Calls it cannot express (grouped-query attention,
non-meta tensors) keep torch's own path.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_SDPA: tuple[Callable[..., Any], ...] = (F.scaled_dot_product_attention,
                                         torch._C._nn.scaled_dot_product_attention)


def _fused(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
           is_causal: bool = False, scale: float | None = None,
           enable_gqa: bool = False) -> torch.Tensor | None:
    """The fused kernel's output, or None where it does not apply."""
    if enable_gqa or not (query.is_meta and key.is_meta and value.is_meta):
        return None
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None  # the fused kernel takes (batch, heads, positions, features) only
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out: torch.Tensor = kernel(query, key, value, dropout_p, is_causal, attn_mask=attn_mask,
                               scale=scale)[0]
    return out


class fused_attention_on_meta(TorchFunctionMode):  # noqa: N801 - used as a context manager
    """Within the ``with`` block, scaled-dot-product attention on meta tensors runs the fused
    kernel's meta implementation (what it saves for the backward is what CPU and CUDA save)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _SDPA:
            out = _fused(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)
