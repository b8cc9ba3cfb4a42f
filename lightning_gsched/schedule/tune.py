"""The tuner: which schedule, data-parallel G and mode, S, B, R, cap and checkpointing is
fastest within a memory budget, by a bounded search over real plans.

Every candidate is an ordinary plan whose programs the runtime would execute unchanged
(:mod:`.tune_cost`), so its predicted step time and bytes are those of the real run. The space is
:mod:`.tune_space`'s plus, for a schedule whose default plan stashes more than one (stage,
microbatch) per stage chunk on a worker, smaller uniform caps (:func:`~.tune_cost.cap_choices`);
a cap whose programs equal an already costed one's is dropped.

Why bounded: at W=8 the space holds hundreds of candidates, costing one (replaying every rank's
program, walking its bytes) takes up to a second, and the search runs at the first batch on rank
0 while the other ranks wait. So it ranks exactly the ``top`` fastest candidates that fit (branch
and bound), costing a candidate only when its lower bound does not rule it out:

1. unplanned, its bound is its work (:func:`~.tune_cost.work_bound`);
2. planned (cheap: one replica, renamed), the bound grows to the plan's own latency
   (:func:`~.tune_cost.plan_bound`), and with a budget a plan whose bytes bound
   (:func:`~.tune_cost.memory_bound`) exceeds it is set aside;
3. only then is it sized and, when it fits, timed; over the budget only the fastest
   :data:`OVER_ROWS` are timed, for the table's "what more memory would buy" rows.

Candidates are taken lowest bound first; once the lowest bound left exceeds the ``top``-th
fastest fitting step time, nothing left can enter the table, so its rows and pick are those of
costing every candidate (tests compare). A smaller cap enters with its default-cap plan's bound,
as a cap only holds jobs back. When nothing fits, the candidates set aside are sized, smallest
bound first, until the smallest peak is known (the error names it).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from dataclasses import dataclass, field
from typing import Callable, Sequence

from lightning_gsched.errors import GschedError, ScheduleConfigError
from lightning_gsched.schedule.describe import byte_text
from lightning_gsched.schedule.plan import Plan
from lightning_gsched.schedule.runtime_costs import DEFAULT_COSTS, RuntimeCosts
from lightning_gsched.schedule.tune_cost import (
    StageProfile,
    Verdict,
    candidate_arguments,
    candidate_costs,
    cap_choices,
    evaluate,
    memory_bound,
    over_budget,
    plan_bound,
    plan_candidate,
    predict_peak,
    predict_time,
    refused,
    work_bound,
)
from lightning_gsched.schedule.tune_space import (
    Candidate,
    candidates,
    microbatch_counts,
    most_microbatches,
)

__all__ = [
    "TOP", "Candidate", "StageProfile", "TuneResult", "Verdict", "candidate_arguments",
    "candidate_costs", "candidates", "evaluate", "microbatch_counts", "most_microbatches",
    "plan_candidate", "tune",
]

TOP = 10  # the fitting candidates ranked exactly by default (the startup table's rows)
OVER_ROWS = 3  # the fastest candidates over the budget whose step time the table shows
_SLACK = 1e-9  # relative: a bound and a replay summing the same seconds in another order


@dataclass
class TuneResult:
    """Every verdict: the timed ones, fastest fitting first; then those over the budget only
    sized (peak, no step time); those the search's bounds skipped (``skipped``); those the
    planner refused. ``best`` is the pick (None when nothing fits). ``top``: the fitting rows
    ranked exactly (None: every candidate costed)."""

    verdicts: list[Verdict]
    budget: int | None
    workers: int
    global_rows: int
    profiles: dict[int, StageProfile] = field(default_factory=dict)  # per S, as measured
    top: int | None = None

    @property
    def best(self) -> Verdict | None:
        return next((v for v in self.verdicts if v.fits), None)

    def table(self, limit: int = 20) -> str:
        """The ranked table `gsched tune` prints (G and the data-parallel mode per row)."""
        lines = [f"gsched tune: W={self.workers}, global batch {self.global_rows} rows, budget "
                 + (byte_text(self.budget) if self.budget is not None else "none"),
                 f"{'rank':>4}  {'candidate':<34} {'G':>2}  {'mode':<9} {'step time':>10}  "
                 f"{'peak/rank':>10}  fits",
                 f"{'-' * 4}  {'-' * 34} {'-' * 2}  {'-' * 9} {'-' * 10}  {'-' * 10}  ----"]
        costed = [v for v in self.verdicts if v.step_time is not None]
        fitting, over = [v for v in costed if v.fits], [v for v in costed if not v.fits]
        # the fastest that fit, then the fastest few over the budget (what it would buy)
        shown = fitting[:limit] + over[:max(3, limit - len(fitting))]
        for i, v in enumerate(shown, 1):
            assert v.step_time is not None and v.peak is not None
            c = v.candidate
            mode = c.mode if c.replicas > 1 else "-"
            lines.append(f"{i:>4}  {c.shape_text():<34} {c.replicas:>2}  {mode:<9} "
                         f"{v.step_time * 1e3:>7.1f} ms  {byte_text(v.peak):>10}  "
                         f"{'yes' if v.fits else 'no: ' + v.reason}")
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
    c = v.candidate
    return (c.schedule, c.stages, c.R, c.cap, c.checkpoint, c.replicas, c.mode, v.step_time,
            v.peak)


@dataclass(order=True)
class _Entry:
    """A candidate waiting in the search: its lower bound (the heap's key), its plan once made,
    and the programs of the caps already costed for its configuration (``family``)."""

    bound: float
    order: int
    candidate: Candidate = field(compare=False)
    profile: StageProfile = field(compare=False)
    planned: Plan | None = field(default=None, compare=False)
    family: list[object] = field(default_factory=list, compare=False)


@dataclass
class _Over:
    """A planned candidate over the budget: its peak (None: only bounded) and the least peak
    known for it (its peak, or its bytes bound)."""

    entry: _Entry
    peak: int | None
    least: int


class _BoundedSearch:
    """The branch and bound's state (module docstring): a heap of candidates by lower bound, the
    costed verdicts, and the distinct step times that set the threshold."""

    def __init__(self, workers: int, costs: RuntimeCosts, budget: int | None,
                 top: int | None) -> None:
        self.workers, self.costs, self.budget, self.top = workers, costs, budget, top
        self.heap: list[_Entry] = []
        self.costed: list[Verdict] = []
        self.uncosted: list[Verdict] = []
        self.over: list[_Over] = []  # over the budget, not timed yet
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
        else back in the heap with its plan's bound. Its smaller caps join the heap with that
        bound (a cap only holds jobs back), and may fit where it does not."""
        c = entry.candidate
        try:
            entry.planned = plan_candidate(c, entry.profile, self.workers)
        except GschedError as exc:
            if c.cap is None:
                self.uncosted.append(refused(c, exc))
            return
        entry.bound = max(entry.bound, plan_bound(entry.planned, self.costs))
        least = None if self.budget is None or self.top is None else memory_bound(
            c, entry.profile, entry.planned)
        if least is not None and self.budget is not None and least > self.budget:
            self.over.append(_Over(entry, None, least))
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
        reason = over_budget(peak, self.budget)
        if reason and self.top is not None:
            self.over.append(_Over(entry, peak, peak))
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
        waiting = sorted((o for o in self.over if o.peak is None),
                         key=lambda o: (o.least, o.entry.order))
        smallest = min((o.peak for o in self.over if o.peak is not None), default=None)
        for o in waiting:
            if smallest is not None and o.least >= smallest:
                break
            assert o.entry.planned is not None
            o.peak = o.least = predict_peak(o.entry.candidate, o.entry.profile,
                                            o.entry.planned)
            smallest = o.peak if smallest is None else min(smallest, o.peak)

    def _time_fastest_over(self) -> None:
        """Time the candidates over the budget, lowest bound first, until no bound left is below
        the :data:`OVER_ROWS`-th fastest of them; the rest keep their peak (or their bytes
        bound) without a step time."""
        for o in sorted(self.over, key=lambda o: (o.entry.bound, o.entry.order)):
            entry, c = o.entry, o.entry.candidate
            assert entry.planned is not None
            if len(self.over_times) >= OVER_ROWS and \
                    entry.bound > self.over_times[OVER_ROWS - 1] * (1 + _SLACK):
                self.uncosted.append(
                    Verdict(c, None, o.peak, False, over_budget(o.peak, self.budget))
                    if o.peak is not None else
                    Verdict(c, reason=f"peak >= {byte_text(o.least)} (its bound) > the budget",
                            skipped=True))
                continue
            peak = o.peak if o.peak is not None else predict_peak(c, entry.profile,
                                                                  entry.planned)
            step = predict_time(c, entry.profile, entry.planned, self.costs)
            self._record(Verdict(c, step, peak, False, over_budget(peak, self.budget)))


def tune(workers: int, global_rows: int, profile_of: Callable[[int], StageProfile],
         budget: int | None = None, costs: RuntimeCosts | None = None,
         schedules: Sequence[str] | None = None,
         checkpoint: Sequence[bool] = (False, True), *, stages: int | None = None,
         micro: int | None = None, R: int | None = None, replicas: int | None = None,
         top: int | None = TOP) -> TuneResult:
    """Rank the candidates (:func:`~.tune_space.candidates`) by predicted step time: the ``top``
    fastest that fit exactly (module docstring), those over the budget kept in the table as
    "no", those the planner refuses as dropped.

    ``profile_of(S)``: the model measured at S stages (called once per S, rising; a GschedError
    when the model cannot be cut into S stages drops the candidates with that S).
    ``stages``/``micro`` (B per replica)/``R``/``replicas`` (G): fixed values. ``costs``: the
    runtime's (default :data:`~.runtime_costs.DEFAULT_COSTS`). ``top``: the fitting candidates
    ranked exactly (None: cost every candidate). Raises :class:`ScheduleConfigError` when
    nothing fits, naming the smallest peak reached.
    """
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
    verdicts = list(first.values()) + uncosted
    result = TuneResult(verdicts, budget, workers, global_rows, profiles, top)
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
