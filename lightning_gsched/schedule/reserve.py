"""Stash reservations: a microbatch entering a worker claims, against its cap, every stash it
will hold there. On a V placement a plain cap below 2W deadlocks: worker 0 fills it with
first-stage forwards (always ready), and the second-stage forward of its oldest microbatch, which
every backward waits for, never starts. Reserving keeps room for it: any cap of at least a
worker's stages completes, the stash never above it. Opt in: ``reserves_stash`` (v-half, v-min)."""

from __future__ import annotations

from typing import Sequence


def stash_charges(compute: Sequence[Sequence[int]]) -> list[int]:
    """What each forward adds to its worker's count under the cap, by flat (stage * B + micro):
    the first forward of microbatch b on a worker the number of stages b has there, its later
    forwards there 0. Every stash is still released one by one, by its last backward phase."""
    stages, micro = len(compute), len(compute[0]) if compute else 0
    charges = [0] * (stages * micro)
    for b in range(micro):
        first: dict[int, int] = {}  # worker -> flat index of b's first forward on it
        for s in range(stages):
            charges[first.setdefault(compute[s][b], s * micro + b)] += 1
    return charges
