"""Which parameters go into which flat buffer, sanity checks, and the step's result type.

Why here: the executor needs one decision made the same way on every rank: the parameters of
stage ``s`` (in ``stage.parameters()`` order) form its flat buffer, except parameters that several
stages read (tied weights), which stay replicated and get one flat gradient of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from lightning_gsched.errors import RuntimeConfigError
from lightning_gsched.runtime.counters import RuntimeCounters
from lightning_gsched.runtime.flat import FlatGrads, FlatStage
from lightning_gsched.schedule.program import Programs


@dataclass
class StepResult:
    """What one ``step()`` returns on one rank.

    ``losses``: ``{b: loss}`` (unscaled, detached) for the microbatches whose last stage ran here.
    ``counters``: what this rank did (:class:`RuntimeCounters`).
    """

    losses: dict[int, torch.Tensor]
    counters: RuntimeCounters


def check_programs(stages: Sequence[nn.Module], programs: Programs) -> None:
    if len(stages) != programs.num_stages:
        raise RuntimeConfigError(
            f"the programs are for {programs.num_stages} stages but {len(stages)} stage modules "
            f"were given; partition the model into {programs.num_stages} stages or plan with "
            f"stages={len(stages)}."
        )
    chain = [(s, s + 1) for s in range(programs.num_stages - 1)]
    if sorted(programs.edges) != chain:
        raise RuntimeConfigError(
            f"the runtime executes a chain of stages (stage s feeds s+1, as partition() "
            f"produces), but the programs' stage graph has edges {programs.edges}; plan without "
            "edges=."
        )


def build_flat_stages(
    stages: Sequence[nn.Module], owned: set[int]
) -> tuple[list[FlatStage], FlatGrads, torch.device]:
    """One :class:`FlatStage` per stage, the tied parameters' :class:`FlatGrads`, the device.

    Non-owned stages are released right away, so from here on a rank holds only its own stages
    (plus tied parameters).
    """
    per_stage = [list(dict.fromkeys(stage.parameters())) for stage in stages]
    readers: dict[int, int] = {}
    for params in per_stage:
        for p in params:
            readers[id(p)] = readers.get(id(p), 0) + 1
    shared = list(dict.fromkeys(p for params in per_stage for p in params if readers[id(p)] > 1))
    all_params = [p for params in per_stage for p in params]
    device = all_params[0].device if all_params else torch.device("cpu")
    dtype = all_params[0].dtype if all_params else torch.float32
    flats = [
        FlatStage(s, [p for p in params if readers[id(p)] == 1], owned=s in owned)
        for s, params in enumerate(per_stage)
    ]
    if shared:
        dtype = shared[0].dtype
    return flats, FlatGrads(shared, dtype, device), device
