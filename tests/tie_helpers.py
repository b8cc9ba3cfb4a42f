"""Helpers for runtime tests of partitioned models whose stages may share (tie) parameters.

A plan places tied weights only when it is told which stages share them, which the partition
knows: :func:`with_ties` plans the same library schedule again with the partition's ties (the
simulation and hence every stage action are unchanged; the tie actions are added).
:func:`held_parameters` lists what a rank's executor updates: its owned stages' and ties'
parameters.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_gsched.schedule import plan


def with_ties(p: Any, part: Any) -> Any:
    """``p`` (a library plan with default order and cap) planned with ``part``'s tied weights."""
    G = p.data_parallel_size  # microbatches= counts one replica's
    return plan(p.schedule, workers=p.workers, stages=p.stages, microbatches=p.micro // G,
                R=p.R, forward_only=p.forward_only,
                checkpoint_activations=list(p.checkpointed), fetch_window=p.fetch_window,
                ties=part.shared_parameters.values(), data_parallel_size=G,
                data_parallel=p.data_parallel)


def held_parameters(ex: Any) -> list[nn.Parameter]:
    """The parameters of the stages and ties ``ex`` (a ProgramExecutor) owns."""
    return ([q for s in sorted(ex.owned) for q in ex.flats[s].params]
            + [q for h in sorted(ex.owned_ties) for q in ex.ties[h].params])
