"""Give the C heap's free pages back to the OS at step boundaries (CPU, glibc).

On CPU glibc keeps most of what a step frees: its dynamic mmap threshold makes blocks up to the
last freed mmap'd size (up to 32 MiB) come from the heap, whose freed pages stay resident, so the
process's peak exceeds its live tensors by a varying amount (docs/benchmarks.md).
``malloc_trim(0)`` returns the free pages without changing the allocator's policy
(``mallopt(M_MMAP_THRESHOLD)`` would also return memory inside a step, at a far higher cost). The
trim costs a sizeable share of a small model's step, so the runtime trims every step only where
memory is the constraint (``ModelRuntime.release_heap_each_step``). Elsewhere a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import lru_cache
from typing import Callable

import torch


@lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl, Windows)."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap(device: torch.device) -> bool:
    """Return the C heap's free pages to the OS when ``device``'s tensors live there (CPU); True
    when memory was released."""
    if device.type != "cpu":
        return False
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
