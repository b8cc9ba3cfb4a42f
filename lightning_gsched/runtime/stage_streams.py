"""Each stage draws its random numbers (dropout masks) from a stream of its own.

Why: ranks start a run with equal generators (``seed_everything`` seeds every rank alike, and
the engine aligns a tensor-parallel worker's ranks), so stage 1's forward on rank 1 drew exactly
what stage 0's forward drew on rank 0: a transformer's dropout layers in different stages got the
same mask for the same microbatch (found by probing: 8 of 8 microbatches, where one device's
layers never matched). Megatron-LM offsets each pipeline rank's seed for the same reason.

Here every ``F`` of stage ``s`` runs with the default generators (the CPU one and those of the
stage's CUDA devices) set to stage ``s``'s stream, which is saved back afterwards; the ambient
streams are put back as they were, so the schedule's computations no longer advance them (what
the ranks draw outside the steps, e.g. a sampler's seed, stays the same on every rank seeded
alike). A stage's stream starts, at its first forward on this rank, from a hash of the ambient
CPU generator's state and the stage index: equal on a tensor-parallel worker's ranks (their
states are aligned before the first step, and they run the same program), different for every
stage, and the same in every run with the same seed. A checkpointed stage captures the stream's
state at ``F`` and replays from it (runtime/compute.py). Masks still cannot equal one device's:
they are drawn per stage and microbatch, in another order.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch


def _seed(state: torch.Tensor, stage: int) -> int:
    """A 63-bit seed from a generator state and a stage index (no draw from the generator)."""
    digest = hashlib.sha256(state.numpy().tobytes() + stage.to_bytes(8, "little")).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class StageStreams:
    """Per stage, the CPU generator's state and each of its CUDA devices' (lazily made)."""

    def __init__(self, devices: Sequence[Sequence[int]]) -> None:
        self.devices = [list(d) for d in devices]  # per stage: its CUDA device indices
        self.cpu: dict[int, torch.Tensor] = {}
        self.cuda: dict[int, list[torch.Tensor]] = {}

    def _start(self, stage: int) -> None:
        seed = _seed(torch.get_rng_state(), stage)
        self.cpu[stage] = torch.Generator().manual_seed(seed).get_state()
        self.cuda[stage] = [torch.Generator(f"cuda:{d}").manual_seed(seed).get_state()
                            for d in self.devices[stage]]

    @contextmanager
    def drawing(self, stage: int) -> Iterator[None]:
        """Inside: the default generators hold ``stage``'s stream; after: each goes back to
        what it held before, and the stream keeps what was drawn."""
        if stage not in self.cpu:
            self._start(stage)
        devices = self.devices[stage]
        outer_cpu = torch.get_rng_state()
        outer_cuda = [torch.cuda.get_rng_state(d) for d in devices]
        torch.set_rng_state(self.cpu[stage])
        for d, state in zip(devices, self.cuda[stage], strict=True):
            torch.cuda.set_rng_state(state, d)
        try:
            yield
        finally:
            self.cpu[stage] = torch.get_rng_state()
            self.cuda[stage] = [torch.cuda.get_rng_state(d) for d in devices]
            torch.set_rng_state(outer_cpu)
            for d, state in zip(devices, outer_cuda, strict=True):
                torch.cuda.set_rng_state(state, d)
