"""A tensor-parallel shard's initial values drawn without its full tensor (CPU).

Why: a model built without weights gets one device's values, so each module's parameters were
drawn at their full shape and then cut (runtime/materialize.py): a single module whose full
tensors do not fit one rank could not be built. On CPU, torch draws ``uniform_`` one element
after another in memory order and ``normal_`` in blocks of 16 (uniforms for the whole tensor,
then Box-Muller per block, the last 16 redrawn when the size is not a multiple of 16), so a
tensor drawn as consecutive chunks whose sizes are multiples of 16, the last one at least 16,
consumes the generator as one draw does and gets the same values, bit for bit
(:func:`chunked_draw_is_exact` checks it once per process on the installed torch; the tests
check it over shapes and dtypes). A rank then keeps its region of each chunk and holds one chunk
at a time.

While a module's ``reset_parameters()`` runs, each sharded parameter is a :class:`RegionTensor`:
the full shape, no storage of its own, this rank's region kept. The in-place fills initialisers
use (``uniform_``, ``normal_``, ``fill_``, ``zero_``, also through ``.data``) land in the
region; reading its shape, or a view's shape (fan-in of a convolution), works; any other use
(a value read, a view written into: Embedding's padding row, ``trunc_normal_``'s rejection
loop, ``orthogonal_``) raises :class:`RegionUnsupported`, and the module is drawn whole as
before. CUDA's generator assigns numbers to elements by thread, not in order, so on a GPU the
full draw stays.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# elements per drawn chunk: a multiple of 16 (normal_'s block), 64 MiB of float32
CHUNK_ELEMENTS = 1 << 24
# a region is one run of lines per index of the dimensions before its cut, copied one by one:
# beyond this many runs the tensor is drawn whole instead (not a tensor-parallel shard's shape)
MAX_RUNS = 1 << 16


class RegionUnsupported(RuntimeError):
    """An initialiser did something with a :class:`RegionTensor` other than fill it."""


class RegionTensor(torch.Tensor):
    """A parameter's full shape with only this rank's region behind it (module docstring).

    ``local``: the region's values (None for a view: shape only); ``cut``: the dimension cut,
    and the region's ``[start, stop)`` along it."""

    local: torch.Tensor | None
    cut: tuple[int, int, int]
    filled: bool  # an initialiser wrote its values (else they are uninitialised memory)

    @staticmethod
    def __new__(cls, shape: torch.Size, dtype: torch.dtype, local: torch.Tensor | None,
                cut: tuple[int, int, int], stride: tuple[int, ...] | None = None,
                ) -> "RegionTensor":
        made = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=stride, dtype=dtype, device=torch.device("cpu"))
        made.local, made.cut, made.filled = local, cut, False
        return made

    def __repr__(self) -> str:  # type: ignore[override]
        dim, start, stop = self.cut
        return f"RegionTensor(shape={tuple(self.shape)}, dimension {dim} [{start}:{stop}])"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any,  # type: ignore[override]
                           args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                           ) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args and isinstance(args[0], RegionTensor) else None
        others = [a for a in tree_flatten((args[1:], kwargs))[0] if isinstance(a, RegionTensor)]
        if target is None or others:
            raise RegionUnsupported(f"{func} reads a parameter drawn by region")
        if func in (aten.detach.default, aten.alias.default):
            return target  # ``.data``: the same region
        if getattr(func, "is_view", False):  # its shape only: writing into it is refused
            meta = torch.empty_strided(target.shape, target.stride(), dtype=target.dtype,
                                       device="meta")
            out = func(meta, *args[1:], **kwargs)
            return RegionTensor(out.shape, out.dtype, None, target.cut, tuple(out.stride()))
        if target.local is None:
            raise RegionUnsupported(f"{func} on a view of a parameter drawn by region")
        local = target.local
        if func is aten.uniform_.default:
            target._draw(lambda t: t.uniform_(*args[1:], **kwargs))
        elif func is aten.normal_.default:
            target._draw(lambda t: t.normal_(*args[1:], **kwargs))
        elif func is aten.fill_.Scalar:
            local.fill_(args[1])
        elif func is aten.zero_.default:
            local.zero_()
        else:
            raise RegionUnsupported(f"{func} on a parameter drawn by region")
        target.filled = True
        return target

    def _draw(self, fill: Callable[[torch.Tensor], Any],
              chunk_elements: int | None = None) -> None:
        """``fill`` (an in-place draw) over the full tensor, chunk after chunk in memory order,
        keeping the region. The tensor is read as lines (its last dimensions after the cut
        one): a chunk is whole lines, a multiple of 16 elements but the last, which holds at
        least 16 (or is the whole tensor); the region is, per index of the dimensions before
        the cut, one run of lines."""
        assert self.local is not None
        shape, (dim, start, stop) = self.shape, self.cut
        prefix, size, width = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:])
        lines, kept = prefix * size, stop - start
        unit = 16 // math.gcd(width, 16) if width else 1  # lines whose elements are 16 k
        per_chunk = unit * max(1, (chunk_elements or CHUNK_ELEMENTS) // max(unit * width, 1))
        local = self.local.view(prefix * kept, width)
        first = 0
        while first < lines:
            last = min(lines, first + per_chunk)
            if (lines - last) * width < 16:  # what would be left is too short for its own chunk
                last = lines
            chunk = torch.empty((last - first) * width, dtype=self.dtype)
            fill(chunk)
            drawn = chunk.view(last - first, width)
            for p in range(first // size, (last - 1) // size + 1):  # the runs in this chunk
                low, high = max(first, p * size + start), min(last, p * size + stop)
                if low < high:
                    at = p * kept + low - p * size - start
                    local[at:at + high - low] = drawn[low - first:high - first]
            first = last


def region_tensor(shape: torch.Size, dtype: torch.dtype, region: tuple[slice, ...]
                  ) -> RegionTensor | None:
    """A :class:`RegionTensor` for ``region`` of a full tensor of ``shape`` (storage for the
    region only), or None where the region is not one cut dimension (or has more than
    :data:`MAX_RUNS` runs)."""
    cut = [d for d, where in enumerate(region) if where != slice(None)]
    if len(cut) != 1:
        return None
    dim = cut[0]
    start, stop, step = region[dim].indices(shape[dim])
    if step != 1 or math.prod(shape[:dim]) > MAX_RUNS or not chunked_draw_is_exact(dtype):
        return None
    local_shape = list(shape)
    local_shape[dim] = stop - start
    return RegionTensor(shape, dtype, torch.empty(local_shape, dtype=dtype), (dim, start, stop))


@lru_cache(maxsize=None)
def chunked_draw_is_exact(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch's CPU ``uniform_`` and ``normal_`` give a ``dtype`` tensor drawn in
    chunks the values and generator state of one draw (module docstring), on a small case with
    a tail: checked once per dtype and process before any region is drawn."""
    generator = torch.Generator()
    shape = torch.Size((7, 37))  # 259 elements: rows of 37, a tail past the last block of 16

    def uniform(t: torch.Tensor) -> Any:
        return t.uniform_(-1, 1, generator=generator)

    def normal(t: torch.Tensor) -> Any:
        return t.normal_(0, 1, generator=generator)

    for draw in (uniform, normal):
        generator.manual_seed(0)
        whole = torch.empty(shape, dtype=dtype)
        draw(whole)
        after = torch.rand(4, generator=generator)
        generator.manual_seed(0)
        region = RegionTensor(shape, dtype, torch.empty(7, 12, dtype=dtype), (1, 20, 32))
        region._draw(draw, chunk_elements=16 * 37)  # several chunks
        assert region.local is not None
        if not (torch.equal(region.local, whole[:, 20:32])
                and torch.equal(torch.rand(4, generator=generator), after)):
            return False
    return True
