"""Give the C heap's free pages back to the OS at step boundaries (CPU, glibc).

Why: on CPU a rank's tensors live in the process's C heap, and glibc's default policy keeps
most of what a training step frees. Its mmap threshold is dynamic: once a large block
(up to 32 MiB) served by ``mmap`` is freed, blocks up to that size come from the heap
instead, and freed heap pages stay resident. Measured on a deferred 512 MiB model at W=4
(``memory_process[1f1b]``, docs/benchmarks.md) a rank then held 150-350 MiB of freed memory
beyond its live tensors, which made the process's peak 1.4-1.8x the bytes model's prediction
and varied from run to run.

``malloc_trim(0)`` at the start of every step returns the free pages (top of the heap and
whole free pages inside it) without changing the allocator's policy, so the rank's resident
set starts each step at its live tensors. It costs page faults when the next step reuses
those pages, far less than fixing the mmap threshold (``mallopt(M_MMAP_THRESHOLD)``), which
would also return memory inside a step (figures: docs/benchmarks.md, "Measurements behind
design choices"). Users who
want that stricter policy set glibc's own variable (``MALLOC_MMAP_THRESHOLD_=1048576``).

On a small model whose step allocates many small activations the same trim costs a sizeable
share of the step (the benchmark GPT built with weights). So the runtime trims at every
step only where memory is the constraint: ``ModelRuntime.release_heap_each_step``, which the
engine sets for a model built without weights (the large-model path, docs/memory.md); the
one trim after the stage buffers are built always runs.

GPU tensors are not in this heap (the CUDA caching allocator keeps its own pool), and other
C libraries have no ``malloc_trim``: both are no-ops.
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
    """Return the C heap's free pages to the OS when ``device``'s tensors live there (CPU).
    True when memory was released."""
    if device.type != "cpu":
        return False
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
