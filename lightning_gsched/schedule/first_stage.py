"""The engine's default costs for a split backward: a first stage's B is free, its W whole.

Why: the runtime gives the model's input no gradient, so a first stage's B computes nothing and
its W the whole backward (``runtime/split_backward.py``). At the plain defaults (B and W each
half the backward, every stage alike) the greedy order takes that free B for a job as long as
any other. Planning with the true shape is not always better, though: the greedy rule fills
every gap it sees, and with the first stage's long W it may pack a worker's jobs so tightly
that every message latency lands on the critical path (``zb-h1`` at W=2 does).

So :func:`first_stage_costs` plans both and keeps the order that is faster *at the true
shape*: the default order is re-timed with the true durations (:func:`retimed_latency`, its
per-worker orders kept) and compared with the order planned at the true shape. Measured on the
benchmark GPT (docs/benchmarks.md), this picks the true shape for ``zbv`` (3-6% faster) and the
default order for ``zb-h1``, as side-by-side runs of both orders did. ``plan()`` keeps the costs
it is given, so unit-cost figures stay comparable with the papers'; the engine applies this only
when no cost argument is given and ``profile_costs`` is off (pure: every rank decides alike).

Not above :data:`~.plan.LAZY_FROM_JOBS` jobs per pipeline (3 S B): there the first stage is a
small share of each worker's work, and the re-timing (a few microseconds per job in Python)
would add seconds to the build (zbv at W=1024, 12.6 million jobs: about a minute).
"""

from __future__ import annotations

from lightning_gsched.errors import GschedError, ScheduleConfigError
from lightning_gsched.schedule.arguments import ScheduleArguments
from lightning_gsched.schedule.jobs import StageGraph
from lightning_gsched.schedule.plan import LAZY_FROM_JOBS, pipeline_workers, plan_arguments
from lightning_gsched.schedule.simulate import Costs, Timeline

# a first stage's B, in forwards: it computes nothing, and a duration must be positive
FREE_INPUT_GRADIENT = 0.01


def first_stage_backward_in_w(stages: int) -> dict[str, list[float]]:
    """The default costs with the first stage's whole backward in its W, per stage:
    ``backward_cost`` (B) and ``weight_cost`` (W)."""
    defaults = ScheduleArguments.defaults()
    forward, backward = float(defaults["forward_cost"]), float(defaults["backward_cost"])
    half = backward / 2
    return {"backward_cost": [FREE_INPUT_GRADIENT * forward] + [half] * (stages - 1),
            "weight_cost": [backward] + [half] * (stages - 1)}


def first_stage_costs(arguments: ScheduleArguments, ranks: int) -> dict[str, list[float]] | None:
    """The costs to plan ``arguments`` (S, B and R resolved, a split backward, default costs) on
    ``ranks`` with: :func:`first_stage_backward_in_w`'s, or None where the default order is at
    least as fast at that shape, or where the shaped order would need other caps (a given cap it
    cannot complete under, or a default cap that moves: the memory target is not traded for
    speed here). Decided on one replica's pipeline (its P workers, without tensor parallelism):
    every replica runs the same order."""
    S = arguments.stages
    assert S is not None and arguments.microbatches is not None, "resolve S and B first"
    if 3 * S * arguments.microbatches > LAZY_FROM_JOBS:  # F, B and W of every (stage, micro)
        return None
    P = pipeline_workers(arguments, ranks)[1]
    one = arguments.replace(data_parallel_size=1, data_parallel="replicate",
                            tensor_parallel_size=1)
    true = first_stage_backward_in_w(S)
    base = plan_arguments(one, P, verify=False)
    try:
        shaped = plan_arguments(one.replace(**true), P, verify=False)
    except GschedError:  # e.g. a given cap the shaped order cannot complete under
        return None
    if list(shaped.caps) != list(base.caps):  # the default cap moved: another memory target
        return None
    graph = StageGraph(S, split_backward=True)
    if retimed_latency(base.timeline, graph, shaped.costs) <= shaped.timeline.latency:
        return None
    return true


def retimed_latency(timeline: Timeline, graph: StageGraph, costs: Costs) -> float:
    """The latency of ``timeline``'s per-worker orders with every job lasting what ``costs``
    say: each job starts once its worker's previous job and its predecessors (``graph``) end.
    Compute only, as the greedy plan counts it."""
    end: dict[int, float] = {}
    order = [list(jobs) for jobs in timeline.order]
    position = [0] * len(order)
    free = [0.0] * len(order)
    left = sum(map(len, order))
    while left:
        moved = False
        for w, jobs in enumerate(order):
            while position[w] < len(jobs):
                index = jobs[position[w]]
                job = timeline.job(index)
                before = [end.get(timeline.index(p)) for p in graph.pred(job)]
                if None in before:
                    break
                start = max([free[w], *(t for t in before if t is not None)])
                end[index] = free[w] = start + costs.of(job)
                position[w] += 1
                left -= 1
                moved = True
        if not moved:  # a plan's orders always complete; a broken timeline must not loop
            raise ScheduleConfigError("the timeline's orders cannot be re-timed: a job waits "
                                      "for one that never runs")
    return max(end.values(), default=0.0)
