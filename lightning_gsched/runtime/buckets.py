"""Start a stage's gradient all-reduce in pieces while its last backward is still running.

As torch's DDP overlaps the reduction of the last layers' gradients with the backward of the
first ones: during the stage's last backward of the step, a post-accumulate hook on each parameter
counts it done, and once every parameter of a bucket (a contiguous piece of the flat gradient,
about :data:`BUCKET_BYTES`) has its final gradient, that piece's all-reduce starts. Buckets start
in one fixed order (reverse parameter order, as backward produces them) on every rank, since
collectives must be issued in the same order everywhere. ``ALLREDUCE_G`` starts the remaining
buckets. A piece-wise all-reduce of a buffer is an all-reduce of the buffer.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from lightning_gsched.runtime.flat import FlatGrads

# torch DDP's default bucket_cap_mb: smaller buckets start earlier but pay one latency each
BUCKET_BYTES = 25 * 2**20


def bucket_ranges(sizes: list[int], offsets: list[int], element_size: int,
                  cap: int) -> list[tuple[int, int, list[int]]]:
    """(start, end, parameter indices) per bucket, last parameters first; never splits one."""
    groups: list[list[int]] = [[]]
    nbytes = 0
    for i in reversed(range(len(sizes))):
        groups[-1].append(i)
        nbytes += sizes[i] * element_size
        if nbytes >= cap:
            groups.append([])
            nbytes = 0
    return [(min(offsets[i] for i in members), max(offsets[i] + sizes[i] for i in members),
             members) for members in groups if members]


class GradBuckets:
    """Bucketed, overlapped all-reduce of one stage's flat gradient (see module docstring)."""

    def __init__(self, grads: FlatGrads, launch: Callable[[torch.Tensor], Any],
                 cap: int | None = None) -> None:
        self.grads = grads
        self.launch = launch  # starts an async all-reduce of a tensor, returns its handle
        element = torch.empty((), dtype=grads.dtype).element_size()
        self.buckets = bucket_ranges(grads.sizes, grads.offsets, element, cap or BUCKET_BYTES)
        self.bucket_of = {i: k for k, (_, _, members) in enumerate(self.buckets) for i in members}
        self.handles: list[Any] = []
        self.pending: list[int] = []
        self.next = 0
        self.works: list[Any] = []
        self.started_during_backward = 0  # buckets started by hooks, over all steps

    def arm(self) -> None:
        """Hook every parameter for the backward that follows (the stage's last one)."""
        self.pending = [len(members) for _, _, members in self.buckets]
        self.next = 0
        self.works = []
        # torch's register_post_accumulate_grad_hook has no annotations
        self.handles += [
            p.register_post_accumulate_grad_hook(self._hook(i))  # type: ignore[no-untyped-call]
            for i, p in enumerate(self.grads.params)]

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def done(param: torch.Tensor) -> None:
            self.grads.fold(i)  # the final gradient must be in the flat piece we send
            self.pending[self.bucket_of[i]] -= 1
            while self.next < len(self.buckets) and self.pending[self.next] == 0:
                self._start(self.next)
                self.started_during_backward += 1
        return done

    def _start(self, k: int) -> None:
        start, end, _ = self.buckets[k]
        assert self.grads.flat is not None
        if end > start:
            self.works.append(self.launch(self.grads.flat[start:end]))
        self.next = k + 1

    def disarm(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def finish(self) -> list[Any]:
        """At ALLREDUCE_G: stop hooking, start what has not started; every handle, in order."""
        self.disarm()
        self.grads.sync()  # parameters this backward did not reach, as the unbucketed path does
        while self.next < len(self.buckets):
            self._start(self.next)
        works, self.works = self.works, []
        return works
