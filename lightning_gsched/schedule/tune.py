"""The tuner: which schedule, data-parallel G and mode, S, B, R, cap and checkpointing is
fastest within a memory budget.

Every candidate (:mod:`.tune_space`, plus smaller uniform caps: :func:`cap_choices`) is an ordinary
plan whose programs the runtime would execute unchanged, so its predicted step time
(``predict_step_time`` with the runtime's costs) and bytes per rank (``predict_memory``) are those
of the real run. A profile (:class:`StageProfile`) is measured at one microbatch size; at another,
stashes and messages scale linearly with the rows (weights, gradients and optimizer state do not)
and compute times affinely: each job's ``fixed_share`` (per-op dispatch, autograd set-up) stays, the
rest scales (linear alone is optimistic for smaller microbatches).

Why bounded: the space holds hundreds of candidates, costing one replays every rank's program and
walks its bytes, and the search runs at the first batch on rank 0 while the others wait. So it ranks
exactly the ``top`` fastest candidates that fit (branch and bound), taking candidates lowest lower
bound first: the bound grows from the work (:func:`work_bound`) to the plan's own latency once
planned (:func:`plan_bound`), a plan whose bytes bound (:func:`memory_bound`) exceeds the budget is
set aside, and only then is a candidate sized and, when it fits, timed. Once the lowest bound left
exceeds the ``top``-th fastest fitting step time, nothing left can enter the table, so its rows and
pick are those of costing every candidate (tests compare). A smaller cap enters with its default-cap
plan's bound, as a cap only holds jobs back; one whose programs equal an already costed cap's is
dropped. Over the budget, only the fastest :data:`OVER_ROWS` are timed (the table's "what more
memory would buy" rows); when nothing fits, the candidates set aside are sized, smallest bound
first, until the smallest peak is known (the error names it).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

from lightning_gsched.errors import GschedError, ScheduleConfigError
from lightning_gsched.schedule.arguments import DEFAULT, ScheduleArguments
from lightning_gsched.schedule.describe import byte_text
from lightning_gsched.schedule.jobs import Phase
from lightning_gsched.schedule.library import get_schedule
from lightning_gsched.schedule.memory import ModelSizes, predict_memory
from lightning_gsched.schedule.plan import Plan, plan_arguments
from lightning_gsched.schedule.predict import predict_step_time
from lightning_gsched.schedule.runtime_costs import DEFAULT_COSTS, RuntimeCosts
from lightning_gsched.schedule.simulate import Costs
from lightning_gsched.schedule.tune_space import Candidate as Candidate
from lightning_gsched.schedule.tune_space import candidates as candidates
from lightning_gsched.schedule.tune_space import microbatch_counts as microbatch_counts
from lightning_gsched.schedule.tune_space import most_microbatches as most_microbatches

TOP = 10  # the fitting candidates ranked exactly by default (the startup table's rows)
OVER_ROWS = 3  # the fastest candidates over the budget whose step time the table shows
_SLACK = 1e-9  # relative: a bound and a replay summing the same seconds in another order


@dataclass(frozen=True)
class StageProfile:
    """The model cut into ``stages`` stages, measured on one microbatch of ``rows`` rows: seconds
    per stage (``backward`` the whole backward; ``split``: (B, W) measured with the zero-bubble
    runtime's split backward, None to halve it) and bytes per stage (``sizes``)."""

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
    if get_schedule(candidate.schedule).split_backward and profile.split is not None:
        return forward, scaled(profile.split[0], fixed_b), scaled(profile.split[1], fixed_b)
    return forward, scaled(profile.backward, fixed_b), None


def _scaled_sizes(profile: StageProfile, rows: int) -> ModelSizes:
    """The profile's sizes for microbatches of ``rows`` rows (module docstring)."""
    f = rows / profile.rows
    stages = tuple(dataclasses.replace(
        st, activations=int(st.activations * f), message=int(st.message * f),
        received_activations=int(st.stash_from_message * f), inputs=int(st.inputs * f),
        loss_graph=int(st.loss_graph * f)) for st in profile.sizes.stages)
    return dataclasses.replace(profile.sizes, stages=stages)


def candidate_arguments(candidate: Candidate, profile: StageProfile) -> ScheduleArguments:
    """What a user would pass ``plan()`` for ``candidate``, plus the profile's seconds and tied
    weights: ``GeneralParallel("auto")`` trains its pick with these, as the tuner costed them."""
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


def _refused(candidate: Candidate, exc: GschedError) -> Verdict:
    """The verdict on a candidate the planner refuses: the first line of its error."""
    return Verdict(candidate, reason=f"invalid: {str(exc).splitlines()[0][:120]}")


def cap_choices(default: Plan) -> list[int]:
    """Smaller uniform caps worth trying beside a schedule's default plan, trading bubble for
    activation memory: half its peak stash count (read off the timeline: no program lowered),
    and one microbatch in flight per worker, below which nothing completes (a worker computing k
    stages of a microbatch holds k stashes when its last stage's backward starts)."""
    timeline = default.timeline
    release = Phase.W if Phase.W in timeline.phases else Phase.B
    ones = [1] * default.stages
    peak = max((_peak_stash(order, default, ones, release) for order in timeline.order),
               default=0)
    chunk = max(Counter(row[0] for row in default.table.compute).values(), default=1)
    return [c for c in dict.fromkeys(((peak + 1) // 2, chunk)) if chunk <= c < peak]


def predict_peak(candidate: Candidate, profile: StageProfile, planned: Plan) -> int:
    """The candidate's predicted peak bytes, the most of any rank."""
    sizes = _scaled_sizes(profile, candidate.rows)
    return max(m.peak for m in predict_memory(planned.programs, sizes, planned.checkpointed))


def predict_time(candidate: Candidate, profile: StageProfile, planned: Plan,
                 costs: RuntimeCosts) -> float:
    """The candidate's predicted step time, messages at their bytes."""
    sizes = _scaled_sizes(profile, candidate.rows)
    return predict_step_time(planned, costs=costs, sizes=sizes).latency


def _over_budget(peak: int, budget: int | None) -> str:
    """Why a peak does not fit, or "" when it does."""
    return "" if budget is None or peak <= budget else f"peak {byte_text(peak)} > budget"


def evaluate(candidate: Candidate, profile: StageProfile, workers: int, costs: RuntimeCosts,
             budget: int | None) -> Verdict:
    """Plan the candidate with the profile's costs: its step time and peak bytes."""
    try:
        planned = plan_candidate(candidate, profile, workers)
    except GschedError as exc:
        return _refused(candidate, exc)
    peak = predict_peak(candidate, profile, planned)
    reason = _over_budget(peak, budget)
    return Verdict(candidate, predict_time(candidate, profile, planned, costs), peak,
                   not reason, reason)


def work_bound(candidate: Candidate, profile: StageProfile, workers: int,
               costs: RuntimeCosts) -> float:
    """A lower bound of the candidate's predicted step time, without planning it: the replay
    charges every compute job its cost plus ``costs.job_cpu`` on its worker, keeps each
    microbatch's chain (F of every stage, then B of every stage), adds ``costs.step_cpu``, and
    every other charge only delays; so it lasts at least the mean worker's work or the chain."""
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
    only adds non-negative charges to its (compute-only) latency, then ``costs.step_cpu``."""
    return planned.metrics.latency + costs.step_cpu


def memory_bound(candidate: Candidate, profile: StageProfile, planned: Plan) -> int:
    """A lower bound of the plan's predicted peak bytes from its owners and timeline, no program
    walked: a rank holds its stages' weights, gradients and optimizer state all step, and at least
    the smaller of a stage's two stash sizes (its inputs, checkpointed) from each ``F`` to its
    ``B``, in its timeline's order, which is its program's."""
    sizes = _scaled_sizes(profile, candidate.rows).stages
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


@dataclass
class TuneResult:
    """Every verdict: the timed ones, fastest fitting first; then those over the budget only
    sized; those the search's bounds skipped; those the planner refused. ``top``: the fitting
    rows ranked exactly (None: every candidate costed)."""

    verdicts: list[Verdict]
    budget: int | None
    workers: int
    global_rows: int
    profiles: dict[int, StageProfile] = field(default_factory=dict)  # per S, as measured
    top: int | None = None

    @property
    def best(self) -> Verdict | None:  # the pick; None when nothing fits
        return next((v for v in self.verdicts if v.fits), None)

    def table(self, limit: int = 20) -> str:
        """The ranked table `gsched tune` prints (G and the data-parallel mode per row)."""
        row = "{:>4}  {:<34} {:>2}  {:<9} {:>10}  {:>10}  {}".format
        lines = [f"gsched tune: W={self.workers}, global batch {self.global_rows} rows, budget "
                 + (byte_text(self.budget) if self.budget is not None else "none"),
                 row("rank", "candidate", "G", "mode", "step time", "peak/rank", "fits"),
                 row(*("-" * n for n in (4, 34, 2, 9, 10, 10, 4)))]
        costed = [v for v in self.verdicts if v.step_time is not None]
        fitting, over = [v for v in costed if v.fits], [v for v in costed if not v.fits]
        # the fastest that fit, then the fastest few over the budget (what it would buy)
        shown = fitting[:limit] + over[:max(3, limit - len(fitting))]
        for i, v in enumerate(shown, 1):
            assert v.step_time is not None and v.peak is not None
            c = v.candidate
            lines.append(row(i, c.shape_text(), c.replicas, c.mode if c.replicas > 1 else "-",
                             f"{v.step_time * 1e3:.1f} ms", byte_text(v.peak),
                             "yes" if v.fits else "no: " + v.reason))
        sized = [v for v in self.verdicts if v.step_time is None and v.peak is not None]
        if len(over) + len(sized) > len(shown) - len(fitting[:limit]):
            lines.append(f"over the budget: {len(over) + len(sized)} candidates sized"
                         + (f", {len(sized)} of them not timed (slower than those shown, by "
                            "their bounds)" if sized else ""))
        skipped = [v for v in self.verdicts if v.skipped]
        for group, what in (
                ([v for v in skipped if not v.reason.endswith("budget")],
                 f"slower than the {self.top} fastest that fit"),
                ([v for v in skipped if v.reason.endswith("budget")], "over the budget")):
            if group:
                lines.append(f"not costed: {len(group)} {what} by their lower bounds (e.g. "
                             f"{group[0].candidate.text()}: {group[0].reason})")
        invalid = [v for v in self.verdicts
                   if v.step_time is None and v.peak is None and not v.skipped]
        if invalid:
            lines.append(f"dropped before costing: {len(invalid)} (e.g. "
                         f"{invalid[0].candidate.text()}: {invalid[0].reason})")
        best = self.best
        lines.append("pick: " + (best.candidate.text() if best is not None else "nothing fits"))
        return "\n".join(lines)


def _distinct_key(v: Verdict) -> tuple[object, ...]:
    """What makes two verdicts the same row: the configuration but B, and the predictions (a
    schedule predicted alike at more, smaller microbatches adds nothing to the table)."""
    return dataclasses.replace(v.candidate, micro=0, rows=0), v.step_time, v.peak


@dataclass(order=True)
class _Entry:
    """A candidate in the search: its lower bound (the heap's key), its plan once made, the
    programs of the caps costed for its configuration; set aside over the budget, its peak (None:
    only bounded) and the least peak known (its peak or bytes bound)."""

    bound: float
    order: int
    candidate: Candidate = field(compare=False)
    profile: StageProfile = field(compare=False)
    planned: Plan | None = field(default=None, compare=False)
    family: list[object] = field(default_factory=list, compare=False)
    peak: int | None = field(default=None, compare=False)
    least: int = field(default=0, compare=False)


class _BoundedSearch:
    """The branch and bound (module docstring): a heap of candidates by lower bound."""

    def __init__(self, workers: int, costs: RuntimeCosts, budget: int | None,
                 top: int | None) -> None:
        self.workers, self.costs, self.budget, self.top = workers, costs, budget, top
        self.heap: list[_Entry] = []
        self.costed: list[Verdict] = []
        self.uncosted: list[Verdict] = []
        self.over: list[_Entry] = []  # over the budget, not timed yet
        self.fit_times: list[float] = []  # distinct fitting verdicts' step times, sorted
        self.over_times: list[float] = []  # and those over the budget
        self.keys: set[tuple[object, ...]] = set()
        self.pushed = 0

    def push(self, entry: _Entry) -> None:
        entry.order, self.pushed = self.pushed, self.pushed + 1
        heapq.heappush(self.heap, entry)

    def threshold(self) -> float:
        """A candidate with a larger bound cannot enter the ``top`` fastest that fit."""
        if self.top is None or len(self.fit_times) < self.top:
            return float("inf")
        return self.fit_times[self.top - 1] * (1 + _SLACK)

    def run(self) -> None:
        while self.heap:
            entry = heapq.heappop(self.heap)
            if entry.bound > (limit := self.threshold()):
                for e in [entry, *self.heap]:
                    self.uncosted.append(Verdict(
                        e.candidate, reason=f"step >= {e.bound * 1e3:.2f} ms (its bound) > "
                        f"{limit * 1e3:.2f} ms", skipped=True))
                self.heap = []
            elif entry.planned is None:
                self._plan(entry)
            else:
                self._cost(entry)
        if self.budget is not None and not self.fit_times:
            self._smallest_peak()
        self._time_fastest_over()

    def _plan(self, entry: _Entry) -> None:
        """Plan the candidate: refused, it is dropped (a smaller cap silently: its default's
        verdict stands for the configuration); over the budget by its bytes bound, set aside;
        else back in the heap with its plan's bound, which its smaller caps join it with."""
        c = entry.candidate
        try:
            entry.planned = plan_candidate(c, entry.profile, self.workers)
        except GschedError as exc:
            if c.cap is None:
                self.uncosted.append(_refused(c, exc))
            return
        entry.bound = max(entry.bound, plan_bound(entry.planned, self.costs))
        if self.budget is not None and self.top is not None and \
                (least := memory_bound(c, entry.profile, entry.planned)) > self.budget:
            entry.least = least
            self.over.append(entry)
        else:
            self.push(entry)
        if c.cap is None:
            for cap in cap_choices(entry.planned):
                capped = dataclasses.replace(c, cap=cap)
                self.push(_Entry(entry.bound, 0, capped, entry.profile, None, entry.family))

    def _cost(self, entry: _Entry) -> None:
        """The candidate's peak, then, when it fits (or every candidate is costed), its step
        time; over the budget, it waits for :meth:`_time_fastest_over`."""
        planned, c = entry.planned, entry.candidate
        assert planned is not None
        if planned.programs.ranks in entry.family:
            return  # a cap whose programs another cap of this configuration has
        entry.family.append(planned.programs.ranks)
        peak = predict_peak(c, entry.profile, planned)
        reason = _over_budget(peak, self.budget)
        if reason and self.top is not None:
            entry.peak = entry.least = peak
            self.over.append(entry)
        else:
            self._record(Verdict(c, predict_time(c, entry.profile, planned, self.costs), peak,
                                 not reason, reason))

    def _record(self, v: Verdict) -> None:
        assert v.step_time is not None
        self.costed.append(v)
        key = _distinct_key(v)
        if key not in self.keys:
            self.keys.add(key)
            bisect.insort(self.fit_times if v.fits else self.over_times, v.step_time)

    def _smallest_peak(self) -> None:
        """Nothing fits: size the candidates set aside by their bytes bound, smallest bound
        first, until no bound is below the smallest peak found (the error names it)."""
        waiting = sorted((e for e in self.over if e.peak is None), key=lambda e: (e.least, e.order))
        smallest = min((e.peak for e in self.over if e.peak is not None), default=None)
        for e in waiting:
            if smallest is not None and e.least >= smallest:
                break
            assert e.planned is not None
            e.peak = e.least = predict_peak(e.candidate, e.profile, e.planned)
            smallest = e.peak if smallest is None else min(smallest, e.peak)

    def _time_fastest_over(self) -> None:
        """Time the candidates over the budget, lowest bound first, until no bound left is below
        the :data:`OVER_ROWS`-th fastest of them; the rest keep their peak or bytes bound."""
        for e in sorted(self.over):  # by bound, then order pushed
            c = e.candidate
            assert e.planned is not None
            if len(self.over_times) >= OVER_ROWS and \
                    e.bound > self.over_times[OVER_ROWS - 1] * (1 + _SLACK):
                self.uncosted.append(
                    Verdict(c, None, e.peak, False, _over_budget(e.peak, self.budget))
                    if e.peak is not None else
                    Verdict(c, reason=f"peak >= {byte_text(e.least)} (its bound) > the budget",
                            skipped=True))
                continue
            peak = e.peak if e.peak is not None else predict_peak(c, e.profile, e.planned)
            step = predict_time(c, e.profile, e.planned, self.costs)
            self._record(Verdict(c, step, peak, False, _over_budget(peak, self.budget)))


def tune(workers: int, global_rows: int, profile_of: Callable[[int], StageProfile],
         budget: int | None = None, costs: RuntimeCosts | None = None,
         schedules: Sequence[str] | None = None, checkpoint: Sequence[bool] = (False, True), *,
         stages: int | None = None, micro: int | None = None, R: int | None = None,
         replicas: int | None = None, top: int | None = TOP) -> TuneResult:
    """Rank the candidates by predicted step time (module docstring). ``profile_of(S)``: the
    model measured at S stages (called once per S, rising; its GschedError drops the candidates
    with that S). ``stages``, ``micro`` (B per replica), ``R``, ``replicas`` (G): fixed values.
    ``top``: the fitting candidates ranked exactly (None: cost every one). Raises
    :class:`ScheduleConfigError` when nothing fits, naming the smallest peak reached."""
    if top is not None and top < 1:
        raise ScheduleConfigError(f"top={top!r} must be a positive int (or None: every "
                                  "candidate costed), e.g. top=10")
    costs = costs or DEFAULT_COSTS
    space = candidates(workers, global_rows, schedules, checkpoint, stages=stages, micro=micro,
                       R=R, replicas=replicas)
    profiles: dict[int, StageProfile] = {}
    cannot: dict[int, str] = {}  # why the model cannot be cut into S stages
    for S in sorted({c.stages for c in space}):
        try:
            profiles[S] = profile_of(S)
        except GschedError as exc:
            cannot[S] = f"cannot cut {S} stages: {str(exc).splitlines()[0]}"
    search = _BoundedSearch(workers, costs, budget, top)
    for c in space:
        if c.stages in cannot:
            search.uncosted.append(Verdict(c, reason=cannot[c.stages]))
        else:
            bound = work_bound(c, profiles[c.stages], workers, costs)
            search.push(_Entry(bound, 0, c, profiles[c.stages]))
    search.run()
    # fewer microbatches first, so that a row predicted like a better-ranked one is dropped
    first: dict[tuple[object, ...], Verdict] = {}
    for v in sorted(search.costed, key=lambda v: (
            not v.fits, v.step_time, v.peak, v.candidate.step_micro, v.candidate.replicas)):
        first.setdefault(_distinct_key(v), v)
    # sized only (peak known), then skipped by a bound, then refused by the planner
    uncosted = sorted(search.uncosted, key=lambda v: (v.peak is None, not v.skipped))
    result = TuneResult([*first.values(), *uncosted], budget, workers, global_rows, profiles, top)
    if budget is not None and result.best is None:
        smallest = min((v for v in result.verdicts if v.peak is not None),
                       key=lambda v: v.peak or 0, default=None)
        raise ScheduleConfigError(
            f"no candidate fits the memory budget of {byte_text(budget)} per rank; the smallest "
            f"predicted peak is "
            + (f"{byte_text(smallest.peak)} ({smallest.candidate.text()})"
               if smallest is not None and smallest.peak is not None else "unknown")
            + ". Raise the budget, add workers, or shrink the per-rank batch.")
    return result
