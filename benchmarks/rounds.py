"""Alternated rounds: how every ours-vs-anchor ratio of the table is measured.

Why: on this small shared machine the speed of the cores drifts over seconds to minutes (other
processes, frequency). One long run per side, or the median of all steps pooled, lets a drift
that hits one side more than the other move the ratio by 10% between two runs of the same
commit. So each side runs several short fits, alternated A B B A A B ... (the order flips every
round so neither side always goes first), and the ratio is computed **per round** from the two
sides' median steady step times in that round, i.e. from runs a few seconds apart. The row's
ratio is the median of the round ratios; their minimum and maximum are its spread.

Beside the wall time, every step's process CPU time (``time.process_time``: all threads of the
process, gloo's included) is summed over all ranks: a wall-time gap that the CPU ratio shares is
work one side does and the other does not; one it does not share is waiting (communication,
a rank idle in a bubble, or another process holding the core).

Two ways to run the rounds (``PROCESSES``: ``run.py --processes``, or the environment
variable ``GSCHED_BENCH_PROCESSES``):

* ``"reused"`` (default): one launch of W processes runs every round of every side, one fit
  after another (:func:`rounds_in_process`). No interpreter start-up (3-5 s per launch here) per
  round, so more rounds fit in the same time; each fit still builds its model, strategy and
  Trainer from scratch, and drops its own warm-up steps. The process group is created once and
  shared by all fits.
* ``"fresh"``: every fit of every round in new processes (:func:`benchmarks.common.launch`), as
  the suite did before; nothing carries over from one fit to the next, at the cost of start-up.

A side is a worker function ``fn(rank, world, **kwargs)`` returning at least ``times`` (this
rank's wall seconds per step, all steps) and ``cpu_times`` (the same steps' process CPU seconds);
the anchors' plain torch loops create the default process group only when none exists and then
leave it to the caller, so they run in either way.
"""

from __future__ import annotations

import gc
import importlib
import os
from dataclasses import dataclass, field
from typing import Any

from benchmarks.common import Result, launch_ranks, median, steady

# "reused" or "fresh"; run.py --processes and the environment variable set it
PROCESSES = os.environ.get("GSCHED_BENCH_PROCESSES", "reused")


@dataclass(frozen=True)
class Side:
    """One side of a comparison: a worker function (``"module:function"``) and its kwargs."""

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class SideRuns:
    """What one side measured: per round, every rank's return value of the worker function."""

    outputs: list[list[dict[str, Any]]]  # [round][rank]
    warmup: int

    def wall(self, round_: int) -> list[float]:
        """Rank 0's steady step times (seconds) in one round."""
        return steady(self.outputs[round_][0]["times"], self.warmup)

    def cpu(self, round_: int) -> list[float]:
        """Steady steps' process CPU seconds, summed over all ranks, in one round."""
        per_rank = [steady(out["cpu_times"], self.warmup) for out in self.outputs[round_]]
        return [sum(step) for step in zip(*per_rank, strict=True)]

    @property
    def rounds(self) -> int:
        return len(self.outputs)

    def all_wall(self) -> list[float]:
        return [t for r in range(self.rounds) for t in self.wall(r)]

    def all_cpu(self) -> list[float]:
        return [t for r in range(self.rounds) for t in self.cpu(r)]

    def last(self, rank: int = 0) -> dict[str, Any]:
        """The last round's return value on ``rank`` (losses, byte probes, ...)."""
        return self.outputs[-1][rank]


def _order(names: list[str], round_: int) -> list[str]:
    """A B, then B A, then A B ...: each side goes first in every other round."""
    return names if round_ % 2 == 0 else names[::-1]


def _call(target: str, rank: int, world: int, kwargs: dict[str, Any]) -> Any:
    module_name, func_name = target.split(":")
    return getattr(importlib.import_module(module_name), func_name)(rank, world, **kwargs)


def rounds_in_process(rank: int, world: int, sides: dict[str, list[Any]],
                      rounds: int) -> dict[str, list[Any]]:
    """Worker side of ``"reused"``: every round of every side in these processes, in turn.

    ``sides``: name -> [target, kwargs]. Returns name -> this rank's outputs, one per round.
    Ranks meet at a barrier before each fit so that both start it together; garbage is
    collected between fits so one side's leftovers (a DDP reducer, stage buffers) are gone
    before the other side is timed.
    """
    import torch.distributed as dist

    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    out: dict[str, list[Any]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in _order(list(sides), r):
            target, kwargs = sides[name]
            gc.collect()
            if dist.is_initialized():
                dist.barrier()
            out[name].append(_call(target, rank, world, kwargs))
    return out


def measure(sides: dict[str, Side], world: int, rounds: int, warmup: int,
            processes: str | None = None, timeout: float = 600.0) -> dict[str, SideRuns]:
    """Run ``sides`` alternated for ``rounds`` rounds on ``world`` processes; per-side runs.
    ``timeout``: seconds for one launch (all of it, in ``"reused"`` processes)."""
    processes = processes or PROCESSES
    names = list(sides)
    if processes == "reused":
        per_rank = launch_ranks("benchmarks.rounds:rounds_in_process", world, timeout,
                                sides={n: [s.target, s.kwargs] for n, s in sides.items()},
                                rounds=rounds)
        return {n: SideRuns([[per_rank[k][n][r] for k in range(world)] for r in range(rounds)],
                            warmup) for n in names}
    if processes != "fresh":
        raise ValueError(f"processes must be 'reused' or 'fresh', got {processes!r}")
    outputs: dict[str, list[list[dict[str, Any]]]] = {n: [] for n in names}
    for r in range(rounds):
        for name in _order(names, r):
            outputs[name].append(launch_ranks(sides[name].target, world, timeout,
                                              **sides[name].kwargs))
    return {n: SideRuns(outputs[n], warmup) for n in names}


def round_ratios(ours: SideRuns, anchor: SideRuns) -> tuple[list[float], list[float]]:
    """Per round: ours / anchor of the median steady wall time, and of the median CPU time."""
    wall = [median(ours.wall(r)) / median(anchor.wall(r)) for r in range(ours.rounds)]
    cpu = [median(ours.cpu(r)) / median(anchor.cpu(r)) for r in range(ours.rounds)]
    return wall, cpu


def describe(ours: SideRuns, result: Result) -> str:
    """The measurement in words, for a row's notes."""
    steps = len(ours.wall(0))
    lo_hi = result.spread
    spread = "" if lo_hi is None else f" (min {lo_hi[0]:.3f}, max {lo_hi[1]:.3f})"
    cpu = result.cpu_ratio
    return (f"ratio = median over {ours.rounds} alternated rounds ({PROCESSES} processes) of "
            f"per-round median step ratios{spread}, {steps} steady steps per side and round "
            f"after {ours.warmup} warm-up; CPU per step, all ranks: ours "
            f"{1e3 * (result.ours_cpu_s or 0):.0f} ms, anchor "
            f"{1e3 * (result.anchor_cpu_s or 0):.0f} ms, ratio "
            f"{'-' if cpu is None else f'{cpu:.3f}'}")


def ratio_result(name: str, ours: SideRuns, anchor: SideRuns, goal: str, notes: str,
                 extra: dict[str, Any] | None = None) -> Result:
    """A table row from two sides' runs: pooled medians, per-round ratios, CPU times.

    ``ours_s`` / ``anchor_s`` are the medians of every steady step pooled over the rounds (what
    a step costs); the row's ratio is the median of the per-round ratios (what the comparison
    says), which is not in general ``ours_s / anchor_s``. ``notes`` get :func:`describe` added.
    """
    wall, cpu = round_ratios(ours, anchor)
    result = Result(
        name=name, ours_s=median(ours.all_wall()), anchor_s=median(anchor.all_wall()),
        goal=goal, round_ratios=wall, round_cpu_ratios=cpu,
        ours_cpu_s=median(ours.all_cpu()), anchor_cpu_s=median(anchor.all_cpu()),
        extra={**(extra or {}), "processes": PROCESSES, "rounds": ours.rounds,
               "ours_round_ms": [[round(1e3 * t, 1) for t in ours.wall(r)]
                                 for r in range(ours.rounds)],
               "anchor_round_ms": [[round(1e3 * t, 1) for t in anchor.wall(r)]
                                   for r in range(anchor.rounds)]},
    )
    result.notes = f"{notes}; {describe(ours, result)}" if notes else describe(ours, result)
    return result
