"""What one tuner candidate costs: its plan, its predicted step time and peak, and bounds on both.

Why a module of its own: the search (:mod:`.tune`) decides *which* candidates to plan and cost;
this module says what a candidate *is* (the ``ScheduleArguments`` a front end would plan it
with: :func:`candidate_arguments`) and what it costs (:func:`evaluate`), plus the cheap lower
bounds that let the search skip candidates that cannot make its table
(:func:`work_bound`, :func:`plan_bound`, :func:`memory_bound`).

Every candidate is an ordinary plan whose programs the runtime would execute unchanged, so its
predicted step time (``predict_step_time`` with the runtime's costs: the messages, the
reductions, the replica all-reduces of a data-parallel plan and the weight fetches of a sharded
one, each at its bytes) and its predicted bytes per rank (``predict_memory``) are those of the
real run.

Scaling: a profile is measured on microbatches of ``rows`` rows; a candidate with another
microbatch size scales stashed activations and messages linearly with the rows (weights,
gradients and optimizer state do not change), and compute times affinely: each job's
``fixed_share`` of its profiled time (per stage, forward and backward; what does not shrink
with the rows: per-op dispatch, autograd set-up) stays, the rest scales with the rows.
Linear scaling alone (``fixed_share`` None or 0) scales the fixed costs too, so it is
optimistic for microbatches smaller than the profile's: it made the tuner prefer the smallest
microbatches on the benchmark GPT (docs/benchmarks.md, "Measurements behind design choices").

Checkpointing (``checkpoint_activations=True``, every stage) keeps only each stage's inputs
between F and B and recomputes the forward at B: the planner charges the recompute to B, and the
bytes model holds the inputs instead of the graph (``schedule/memory.py``).
Pure Python: what the model costs comes in as numbers (:class:`StageProfile`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from lightning_gsched.errors import GschedError
from lightning_gsched.schedule.arguments import DEFAULT, ScheduleArguments
from lightning_gsched.schedule.describe import byte_text
from lightning_gsched.schedule.jobs import Phase
from lightning_gsched.schedule.library import get_schedule
from lightning_gsched.schedule.memory import ModelSizes, StageSizes, predict_memory
from lightning_gsched.schedule.plan import Plan, plan_arguments
from lightning_gsched.schedule.predict import predict_step_time
from lightning_gsched.schedule.runtime_costs import RuntimeCosts
from lightning_gsched.schedule.simulate import Costs
from lightning_gsched.schedule.tune_space import Candidate


@dataclass(frozen=True)
class StageProfile:
    """The model cut into ``stages`` stages, measured on one microbatch of ``rows`` rows.

    ``forward``/``backward``: seconds per stage (the whole backward); ``split``: (B, W) seconds
    per stage measured with the zero-bubble runtime's split backward, None to halve the
    backward. ``sizes``: bytes per stage (``measure.measure_stage_bytes``).
    """

    stages: int
    rows: int
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    sizes: ModelSizes
    split: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    # per stage, the share of (forward, backward) seconds that does not scale with the rows
    # (the module docstring); the backward's share also applies to the split B and W
    fixed_share: tuple[tuple[float, ...], tuple[float, ...]] | None = None


@dataclass(frozen=True)
class Verdict:
    """A candidate's predicted step time and peak bytes (max over ranks), or why it was not
    costed (``reason``; ``skipped``: the search's bounds showed it cannot make the table)."""

    candidate: Candidate
    step_time: float | None = None
    peak: int | None = None
    fits: bool = False
    reason: str = ""
    skipped: bool = False


def candidate_costs(candidate: Candidate, profile: StageProfile
                    ) -> tuple[list[float], list[float], list[float] | None]:
    """The per-stage (forward, backward, weight) seconds ``plan()`` gets for ``candidate``:
    the profile's, scaled to the candidate's rows; B and W apart for a split-backward schedule
    (weight None otherwise). What the front ends plan the picked candidate with, so the run's
    programs are the ones evaluated."""
    f = candidate.rows / profile.rows
    fixed_f, fixed_b = profile.fixed_share or ((0.0,) * profile.stages,) * 2

    def scaled(times: Sequence[float], fixed: Sequence[float]) -> list[float]:
        return [t * (k + (1 - k) * f) for t, k in zip(times, fixed, strict=True)]

    forward = scaled(profile.forward, fixed_f)
    backward, weight = scaled(profile.backward, fixed_b), None
    if get_schedule(candidate.schedule).split_backward and profile.split is not None:
        backward = scaled(profile.split[0], fixed_b)
        weight = scaled(profile.split[1], fixed_b)
    return forward, backward, weight


def scaled_sizes(profile: StageProfile, rows: int) -> ModelSizes:
    """The profile's sizes for microbatches of ``rows`` rows (module docstring)."""
    f = rows / profile.rows

    def stage(st: StageSizes) -> StageSizes:
        return dataclasses.replace(
            st, activations=int(st.activations * f),
            received_activations=int(st.stash_from_message * f), message=int(st.message * f),
            inputs=int(st.inputs * f), loss_graph=int(st.loss_graph * f))

    return dataclasses.replace(profile.sizes, stages=tuple(map(stage, profile.sizes.stages)))


def candidate_arguments(candidate: Candidate, profile: StageProfile) -> ScheduleArguments:
    """The arguments ``plan()`` gets for ``candidate``: what a user would write, plus the
    profile's seconds as costs and its tied weights. ``GeneralParallel("auto")`` trains its
    pick with these, so the programs that run are the ones the tuner costed."""
    c = candidate
    forward, backward, weight = candidate_costs(c, profile)
    return ScheduleArguments(
        schedule=c.schedule, stages=c.stages, microbatches=c.micro, R=c.R,
        cap=DEFAULT if c.cap is None else c.cap, checkpoint_activations=c.checkpoint,
        forward_cost=forward, backward_cost=backward, weight_cost=weight,
        ties=profile.sizes.tie_map, data_parallel_size=c.replicas, data_parallel=c.mode)


def plan_candidate(candidate: Candidate, profile: StageProfile, workers: int) -> Plan:
    """The candidate's plan with the profile's costs (raises the planner's GschedError)."""
    return plan_arguments(candidate_arguments(candidate, profile), workers)


def cap_choices(default: Plan) -> list[int]:
    """Smaller uniform caps worth trying beside a schedule's default plan: half its peak
    stash, and one microbatch in flight per worker (:func:`microbatch_chunk`), both below the
    peak and neither below one microbatch (no order completes under that). They trade bubble
    for activation memory."""
    peak = peak_stash_count(default)
    chunk = microbatch_chunk(default)
    return [c for c in dict.fromkeys(((peak + 1) // 2, chunk)) if chunk <= c < peak]


def microbatch_chunk(planned: Plan) -> int:
    """The most (stage, microbatch) pairs one microbatch stashes on one worker: a worker
    computing k of its stages holds k of them when its last stage's backward starts, so a
    smaller uniform cap never completes (k = S / P for a pipeline, S for fsdp)."""
    counts: dict[int, int] = {}
    for row in planned.table.compute:
        counts[row[0]] = counts.get(row[0], 0) + 1
    return max(counts.values(), default=1)


def predict_peak(candidate: Candidate, profile: StageProfile, planned: Plan) -> int:
    """The candidate's predicted peak bytes, the most of any rank (``predict_memory``)."""
    sizes = scaled_sizes(profile, candidate.rows)
    return max(m.peak for m in predict_memory(planned.programs, sizes, planned.checkpointed))


def predict_time(candidate: Candidate, profile: StageProfile, planned: Plan,
                 costs: RuntimeCosts) -> float:
    """The candidate's predicted step time (``predict_step_time`` with the runtime's costs
    and the messages' bytes)."""
    sizes = scaled_sizes(profile, candidate.rows)
    return predict_step_time(planned, costs=costs, sizes=sizes).latency


def over_budget(peak: int, budget: int | None) -> str:
    """Why a peak does not fit, or "" when it does."""
    return "" if budget is None or peak <= budget else f"peak {byte_text(peak)} > budget"


def evaluate(candidate: Candidate, profile: StageProfile, workers: int, costs: RuntimeCosts,
             budget: int | None, planned: Plan | None = None) -> Verdict:
    """Plan the candidate with the profile's costs; its step time and peak bytes
    (``planned``: its plan when the caller already has it)."""
    try:
        result = planned or plan_candidate(candidate, profile, workers)
    except GschedError as exc:
        return Verdict(candidate, reason=f"invalid: {str(exc).splitlines()[0][:120]}")
    peak = predict_peak(candidate, profile, result)
    reason = over_budget(peak, budget)
    return Verdict(candidate, predict_time(candidate, profile, result, costs), peak,
                   not reason, reason)


def work_bound(candidate: Candidate, profile: StageProfile, workers: int,
               costs: RuntimeCosts) -> float:
    """A lower bound of the candidate's predicted step time, without planning it.

    ``predict_step_time`` charges every compute job its cost plus ``costs.job_cpu`` on its
    worker, respects each microbatch's chain (F of every stage, then B of every stage) and
    adds ``costs.step_cpu`` at the end; every other charge only delays. So the step lasts at
    least the larger of the busiest worker's work (at least the mean: all jobs over W) and one
    microbatch's chain, plus ``step_cpu``."""
    forward, backward, weight = candidate_costs(candidate, profile)
    S, split = candidate.stages, get_schedule(candidate.schedule).split_backward
    jobs = Costs.build(S, forward, backward, weight, split).with_recompute(
        [candidate.checkpoint] * S)
    per_micro = sum(jobs.forward) + sum(jobs.backward) + sum(jobs.weight)
    phases = 3 if split else 2
    total = candidate.step_micro * (per_micro + S * phases * costs.job_cpu)
    chain = sum(jobs.forward) + sum(jobs.backward) + 2 * S * costs.job_cpu
    return max(total / workers, chain) + costs.step_cpu


def plan_bound(planned: Plan, costs: RuntimeCosts) -> float:
    """A lower bound of the plan's predicted step time, from its plan alone: the replay keeps
    the plan's orders and only adds non-negative charges, so it ends no earlier than the
    plan's own (compute-only) latency, plus ``costs.step_cpu``."""
    return planned.metrics.latency + costs.step_cpu


def memory_bound(candidate: Candidate, profile: StageProfile, planned: Plan) -> int:
    """A lower bound of the plan's predicted peak bytes, from its owners and its timeline
    (no program read): a rank holds the weights, gradients and optimizer state of the stages
    it owns for the whole step, and at least the smaller of a stage's two stash sizes (its
    inputs, checkpointed) from each ``F`` to its ``B``, in its timeline's order, which is its
    program's (``schedule/memory.py``). Cheaper than the bytes walk by the programs' messages
    and, for a plan lowered per rank, by the lowering."""
    sizes = scaled_sizes(profile, candidate.rows).stages
    held = [0] * planned.workers
    for stage, owners in zip(sizes, planned.programs.owners, strict=True):
        for rank in owners:
            held[rank] += stage.params + stage.grads + stage.optimizer
    least = [st.inputs if ckpt else min(st.activations, st.stash_from_message)
             for st, ckpt in zip(sizes, planned.checkpointed, strict=True)]
    return max(owned + _peak_stash(order, planned, least)
               for owned, order in zip(held, planned.timeline.order, strict=True))


def peak_stash_count(planned: Plan) -> int:
    """The most (stage, microbatch) pairs a worker stashes at once (the programs'
    ``peak_activations``), read off the timeline: from each ``F`` to the job that ends its
    stash (``W`` when the backward is split, else ``B``), in each worker's order, which is its
    program's; no program is lowered."""
    release = Phase.W if Phase.W in planned.timeline.phases else Phase.B
    ones = [1] * planned.stages
    return max((_peak_stash(order, planned, ones, release) for order in planned.timeline.order),
               default=0)


def _peak_stash(order: Sequence[int], planned: Plan, held_bytes: Sequence[int],
                release: Phase = Phase.B) -> int:
    """The most of ``held_bytes[s]`` per (stage, microbatch) held from ``F`` to ``release``
    along one worker's timeline order (flat job indices: ``(stage * micro + b) * phases +
    k``)."""
    phases = planned.timeline.phases
    per_stage = len(phases) * planned.timeline.micro
    step = [1 if phase is Phase.F else -1 if phase is release else 0 for phase in phases]
    held = peak = 0
    for i in order:
        held += step[i % len(phases)] * held_bytes[i // per_stage]
        peak = max(peak, held)
    return peak
