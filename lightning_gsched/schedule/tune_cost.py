"""What one tuner candidate is and costs: its plan arguments, its predicted step time and peak
bytes, and the cheap lower bounds on both that let the search (:mod:`.tune`) skip it.

A candidate is an ordinary plan whose programs the runtime would execute unchanged, so its step
time (``predict_step_time`` with the runtime's costs: messages, reductions, replica all-reduces,
sharded weight fetches) and bytes per rank (``predict_memory``) are those of the real run.

Scaling: a profile is measured on microbatches of ``rows`` rows. At another microbatch size,
stashed activations and messages scale linearly with the rows (weights, gradients and optimizer
state do not), and compute times affinely: each job's ``fixed_share`` of its profiled time (what
does not shrink with the rows: per-op dispatch, autograd set-up) stays, the rest scales. Linear
scaling alone (no ``fixed_share``) is optimistic for microbatches smaller than the profile's.

Checkpointing recomputes each stage's forward at B: the planner charges it to B, and the bytes
model holds the stage's inputs instead of its graph. Pure Python: the model comes in as numbers
(:class:`StageProfile`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
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
    # per stage, the share of (forward, backward) seconds that does not scale with the rows;
    # the backward's share also applies to the split B and W
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
    """The per-stage (forward, backward, weight) seconds ``plan()`` gets for ``candidate``, scaled
    to its rows; B and W apart for a split-backward schedule (weight None otherwise)."""
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
    profile's seconds as costs and its tied weights. ``GeneralParallel("auto")`` trains its pick
    with these, so the programs that run are the ones the tuner costed."""
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


def refused(candidate: Candidate, exc: GschedError) -> Verdict:
    """The verdict on a candidate the planner refuses: the first line of its error."""
    return Verdict(candidate, reason=f"invalid: {str(exc).splitlines()[0][:120]}")


def cap_choices(default: Plan) -> list[int]:
    """Smaller uniform caps worth trying beside a schedule's default plan, trading bubble for
    activation memory: half its peak stash count, and one microbatch in flight per worker, both
    below the peak. Nothing smaller completes: a worker computing k stages of a microbatch holds
    k stashes when its last stage's backward starts (k = S / P for a pipeline, S for fsdp)."""
    # the programs' peak_activations, read off the timeline (no program lowered): a stash lasts
    # from F to W when the backward is split, else to B
    timeline = default.timeline
    release = Phase.W if Phase.W in timeline.phases else Phase.B
    ones = [1] * default.stages
    peak = max((_peak_stash(order, default, ones, release) for order in timeline.order),
               default=0)
    chunk = max(Counter(row[0] for row in default.table.compute).values(), default=1)
    return [c for c in dict.fromkeys(((peak + 1) // 2, chunk)) if chunk <= c < peak]


def predict_peak(candidate: Candidate, profile: StageProfile, planned: Plan) -> int:
    """The candidate's predicted peak bytes, the most of any rank."""
    sizes = scaled_sizes(profile, candidate.rows)
    return max(m.peak for m in predict_memory(planned.programs, sizes, planned.checkpointed))


def predict_time(candidate: Candidate, profile: StageProfile, planned: Plan,
                 costs: RuntimeCosts) -> float:
    """The candidate's predicted step time, messages at their bytes."""
    sizes = scaled_sizes(profile, candidate.rows)
    return predict_step_time(planned, costs=costs, sizes=sizes).latency


def over_budget(peak: int, budget: int | None) -> str:
    """Why a peak does not fit, or "" when it does."""
    return "" if budget is None or peak <= budget else f"peak {byte_text(peak)} > budget"


def evaluate(candidate: Candidate, profile: StageProfile, workers: int, costs: RuntimeCosts,
             budget: int | None) -> Verdict:
    """Plan the candidate with the profile's costs: its step time and peak bytes."""
    try:
        planned = plan_candidate(candidate, profile, workers)
    except GschedError as exc:
        return refused(candidate, exc)
    peak = predict_peak(candidate, profile, planned)
    reason = over_budget(peak, budget)
    return Verdict(candidate, predict_time(candidate, profile, planned, costs), peak,
                   not reason, reason)


def work_bound(candidate: Candidate, profile: StageProfile, workers: int,
               costs: RuntimeCosts) -> float:
    """A lower bound of the candidate's predicted step time, without planning it.

    ``predict_step_time`` charges every compute job its cost plus ``costs.job_cpu`` on its
    worker, respects each microbatch's chain (F of every stage, then B of every stage) and adds
    ``costs.step_cpu`` at the end; every other charge only delays. So the step lasts at least the
    larger of the mean worker's work (all jobs over W) and one microbatch's chain, plus
    ``step_cpu``."""
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
    """A lower bound of the plan's predicted step time: the replay keeps the plan's orders and
    only adds non-negative charges, so it ends no earlier than the plan's own (compute-only)
    latency, plus ``costs.step_cpu``."""
    return planned.metrics.latency + costs.step_cpu


def memory_bound(candidate: Candidate, profile: StageProfile, planned: Plan) -> int:
    """A lower bound of the plan's predicted peak bytes, from its owners and its timeline, not
    its programs (cheaper than the bytes walk by the messages and, lowered per rank, by the
    lowering): a rank holds the weights, gradients and optimizer state of the stages it owns for
    the whole step, and at least the smaller of a stage's two stash sizes (its inputs,
    checkpointed) from each ``F`` to its ``B``, in its timeline's order, which is its
    program's."""
    sizes = scaled_sizes(profile, candidate.rows).stages
    held = [0] * planned.workers
    for stage, owners in zip(sizes, planned.programs.owners, strict=True):
        for rank in owners:
            held[rank] += stage.params + stage.grads + stage.optimizer
    least = [st.inputs if ckpt else min(st.activations, st.stash_from_message)
             for st, ckpt in zip(sizes, planned.checkpointed, strict=True)]
    return max(owned + _peak_stash(order, planned, least)
               for owned, order in zip(held, planned.timeline.order, strict=True))


def _peak_stash(order: Sequence[int], planned: Plan, held_bytes: Sequence[int],
                release: Phase = Phase.B) -> int:
    """The most of ``held_bytes[s]`` per (stage, microbatch) held from ``F`` to ``release``
    along one worker's timeline order (flat job indices: ``(stage * micro + b) * phases + k``)."""
    phases = planned.timeline.phases
    per_stage = len(phases) * planned.timeline.micro
    step = [1 if phase is Phase.F else -1 if phase is release else 0 for phase in phases]
    held = peak = 0
    for i in order:
        held += step[i % len(phases)] * held_bytes[i // per_stage]
        peak = max(peak, held)
    return peak
