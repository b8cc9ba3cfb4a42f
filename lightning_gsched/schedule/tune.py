"""The tuner's search: which schedule, data-parallel G and mode, S, B, R, cap and checkpointing
is fastest within a budget.

Why in the planner: every candidate is an ordinary plan whose programs the runtime would
execute unchanged (:mod:`.tune_cost`), so its predicted step time and bytes are those of the
real run, not of a separate model of the schedule. The space (:mod:`.tune_space`): every
library schedule, composed with G data-parallel replicas (each divisor of W, replicated or
sharded), its R, S and B choices, checkpointing off and on; and, for a schedule whose default
plan stashes more than one (stage, microbatch) per stage chunk on a worker, smaller uniform
activation caps (half the default plan's peak stash, and one per stage chunk) that trade bubble
for activation memory; a cap whose programs equal an already tried one's is dropped.

Why bounded: the space at W=8 holds hundreds of candidates and costing one (replaying every
rank's program, walking its bytes) takes tens of milliseconds to a second, at the first batch
of a run, on rank 0, while the other ranks wait. The search ranks exactly the ``top`` fastest
candidates that fit (branch and bound), and costs a candidate only when its lower bound does not
rule it out:

1. a candidate's work bound (:func:`~.tune_cost.work_bound`: its compute over W, one
   microbatch's chain) needs no plan;
2. planned (cheap: the planner plans one replica and renames it), its bound grows to the plan's
   own latency (:func:`~.tune_cost.plan_bound`), and with a budget a plan whose owned weights,
   gradients and optimizer state plus the least its timeline stashes exceed it cannot fit
   (:func:`~.tune_cost.memory_bound`);
3. only then is it costed (:func:`~.tune_cost.evaluate`).

Candidates are taken lowest bound first; once the lowest bound left exceeds the ``top``-th
fastest fitting step time found, nothing left can enter the table, and the search stops: its
``top`` rows, and so its pick, are those of costing every candidate (tests compare). A
candidate at a smaller cap is considered when its default-cap plan is costed, as a cap only
holds jobs back (its plan is no faster than the default's). ``top=None`` costs every
candidate. When nothing fits the budget, the candidates skipped for their bytes bound are
sized, smallest bound first, until the smallest peak is known (the error names it).
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
    work_bound,
)
from lightning_gsched.schedule.tune_space import (
    Candidate,
    candidates,
    microbatch_counts,
    most_microbatches,
    replica_counts,
)

__all__ = [
    "TOP", "Candidate", "StageProfile", "TuneResult", "Verdict", "cap_choices",
    "candidate_arguments", "candidate_costs", "candidates", "evaluate", "microbatch_counts",
    "most_microbatches", "plan_candidate", "replica_counts", "tune",
]

TOP = 10  # the fitting candidates ranked exactly by default (the startup table's rows)
OVER_ROWS = 3  # the fastest candidates over the budget whose step time the table shows
_SLACK = 1e-9  # relative: a bound and a replay summing the same seconds in another order


@dataclass
class TuneResult:
    """Every verdict: the costed ones fastest fitting first, then those the search skipped,
    then those the planner refused; ``best`` is the pick (None when nothing fits). ``top``:
    the fitting rows ranked exactly (None: every candidate costed)."""

    verdicts: list[Verdict]
    budget: int | None
    workers: int
    global_rows: int
    profiles: dict[int, StageProfile] = field(default_factory=dict)  # per S, as measured
    top: int | None = None

    @property
    def best(self) -> Verdict | None:
        fitting = [v for v in self.verdicts if v.fits]
        return fitting[0] if fitting else None

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
        lines += self._uncosted_lines()
        best = self.best
        lines.append("pick: " + (f"{best.candidate.text()}" if best is not None else
                                 "nothing fits"))
        return "\n".join(lines)

    def _uncosted_lines(self) -> list[str]:
        """What was not costed: skipped by the search's bounds, or refused by the planner."""
        lines = []
        skipped = [v for v in self.verdicts if v.skipped]
        over = [v for v in skipped if v.reason.endswith("budget")]
        slower = [v for v in skipped if not v.reason.endswith("budget")]
        for group, what in ((slower, f"slower than the {self.top} fastest that fit"),
                            (over, "over the budget")):
            if group:
                lines.append(f"not costed: {len(group)} {what} by their lower bounds (e.g. "
                             f"{group[0].candidate.text()}: {group[0].reason})")
        invalid = [v for v in self.verdicts
                   if v.step_time is None and v.peak is None and not v.skipped]
        if invalid:
            lines.append(f"dropped before costing: {len(invalid)} (e.g. "
                         f"{invalid[0].candidate.text()}: {invalid[0].reason})")
        return lines


@dataclass(order=True)
class _Entry:
    """One candidate waiting in the search: its lower bound (the heap's key), its plan once
    made, and the programs of the caps already costed for its configuration (``family``)."""

    bound: float
    order: int
    candidate: Candidate = field(compare=False)
    profile: StageProfile = field(compare=False)
    planned: Plan | None = field(default=None, compare=False)
    family: list[object] = field(default_factory=list, compare=False)


@dataclass
class _Over:
    """A candidate over the budget: its entry, its peak (None: only bounded) and the least
    peak known for it (its peak, or its bytes bound)."""

    entry: _Entry
    peak: int | None
    least: int


class _Search:
    """The bounded search's state (module docstring): a heap of candidates by lower bound,
    the costed verdicts, and the ``top``-th fastest fitting step time (the threshold)."""

    def __init__(self, workers: int, costs: RuntimeCosts, budget: int | None,
                 top: int | None) -> None:
        self.workers, self.costs, self.budget, self.top = workers, costs, budget, top
        self.heap: list[_Entry] = []
        self.costed: list[Verdict] = []
        self.uncosted: list[Verdict] = []
        self.over: list[_Over] = []  # over the budget, not timed yet
        self._fit_times: list[float] = []  # distinct fitting verdicts' step times, sorted
        self._over_times: list[float] = []  # and those over the budget
        self._keys: set[tuple[object, ...]] = set()
        self._order = 0

    def push(self, entry: _Entry) -> None:
        entry.order, self._order = self._order, self._order + 1
        heapq.heappush(self.heap, entry)

    def add(self, candidate: Candidate, profile: StageProfile) -> None:
        """A candidate of the space, bounded by its work (not planned yet)."""
        bound = work_bound(candidate, profile, self.workers, self.costs)
        self.push(_Entry(bound, 0, candidate, profile))

    def threshold(self) -> float:
        """A candidate with a larger bound cannot enter the ``top`` fastest that fit."""
        if self.top is None or len(self._fit_times) < self.top:
            return float("inf")
        return self._fit_times[self.top - 1] * (1 + _SLACK)

    def run(self) -> None:
        """Take candidates lowest bound first until none left can enter the table; then
        the fastest few over the budget (the table's "what more memory would buy")."""
        while self.heap:
            entry = heapq.heappop(self.heap)
            if entry.bound > self.threshold():
                self._skip([entry, *self.heap])
                self.heap = []
            elif entry.planned is None:
                self._plan(entry)
            else:
                self._cost(entry)
        if self.budget is not None and not self._fit_times:
            self._smallest_peak()
        self._time_fastest_over()

    def _skip(self, entries: list[_Entry]) -> None:
        limit = self.threshold()
        for e in entries:
            self.uncosted.append(Verdict(
                e.candidate, reason=f"step >= {e.bound * 1e3:.1f} ms (its bound) > "
                f"{limit * 1e3:.1f} ms", skipped=True))

    def _plan(self, entry: _Entry) -> None:
        """Plan the candidate: refused, it is dropped with the reason (a smaller cap
        silently: its default's verdict stands for the configuration); over the budget by
        its bytes bound, set aside; else back in the heap with its plan's bound."""
        try:
            entry.planned = plan_candidate(entry.candidate, entry.profile, self.workers)
        except GschedError as exc:
            if entry.candidate.cap is None:
                self.uncosted.append(Verdict(
                    entry.candidate, reason=f"invalid: {str(exc).splitlines()[0][:120]}"))
            return
        entry.bound = max(entry.bound, plan_bound(entry.planned, self.costs))
        least = None if self.budget is None or self.top is None else memory_bound(
            entry.candidate, entry.profile, entry.planned)
        if least is not None and self.budget is not None and least > self.budget:
            self.over.append(_Over(entry, None, least))
        else:
            self.push(entry)
        if entry.candidate.cap is None:  # its smaller caps may fit where it does not
            for cap in cap_choices(entry.planned):
                self._add_capped(entry, cap)

    def _cost(self, entry: _Entry) -> None:
        """The candidate's peak, then, when it fits (or every candidate is costed), its step
        time; over the budget, it waits for :meth:`_time_fastest_over`."""
        planned, c = entry.planned, entry.candidate
        assert planned is not None
        programs = planned.programs.ranks
        if programs in entry.family:
            return  # a cap whose programs another cap of this configuration has
        entry.family.append(programs)
        peak = predict_peak(c, entry.profile, planned)
        reason = over_budget(peak, self.budget)
        if reason and self.top is not None:
            self.over.append(_Over(entry, peak, peak))
        else:
            self._record(Verdict(c, predict_time(c, entry.profile, planned, self.costs), peak,
                                 not reason, reason))

    def _add_capped(self, parent: _Entry, cap: int) -> None:
        """The parent's configuration at a smaller uniform cap, bounded by the parent's plan
        (a cap only holds jobs back) and planned when its turn comes."""
        capped = dataclasses.replace(parent.candidate, cap=cap)
        self.push(_Entry(parent.bound, 0, capped, parent.profile, None, parent.family))

    def _record(self, v: Verdict) -> None:
        self.costed.append(v)
        key = _distinct_key(v)
        assert v.step_time is not None
        if key not in self._keys:
            self._keys.add(key)
            bisect.insort(self._fit_times if v.fits else self._over_times, v.step_time)

    def _smallest_peak(self) -> None:
        """Nothing fits: size the candidates set aside by their bytes bound, smallest bound
        first, until no bound is below the smallest peak found (the error names it)."""
        waiting = sorted((o for o in self.over if o.peak is None),
                         key=lambda o: (o.least, o.entry.order))
        sized = [o.peak for o in self.over if o.peak is not None]
        smallest = min(sized, default=None)
        for o in waiting:
            if smallest is not None and o.least >= smallest:
                break
            assert o.entry.planned is not None
            o.peak = o.least = predict_peak(o.entry.candidate, o.entry.profile,
                                            o.entry.planned)
            smallest = o.peak if smallest is None else min(smallest, o.peak)

    def _time_fastest_over(self) -> None:
        """Time the candidates over the budget, lowest bound first, until no bound left is
        below the :data:`OVER_ROWS`-th fastest of them; the rest keep their peak (or their
        bytes bound) without a step time."""
        for o in sorted(self.over, key=lambda o: (o.entry.bound, o.entry.order)):
            entry, c = o.entry, o.entry.candidate
            assert entry.planned is not None
            if len(self._over_times) >= OVER_ROWS and \
                    entry.bound > self._over_times[OVER_ROWS - 1] * (1 + _SLACK):
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


def _distinct_key(v: Verdict) -> tuple[object, ...]:
    c = v.candidate
    return (c.schedule, c.stages, c.R, c.cap, c.checkpoint, c.replicas, c.mode, v.step_time,
            v.peak)


def _distinct(ranked: list[Verdict]) -> list[Verdict]:
    """Drop a candidate predicted exactly like a better-ranked one of the same schedule, S, R,
    cap, checkpointing, G and mode (e.g. DDP with more, smaller microbatches): fewer
    microbatches first."""
    seen: set[tuple[object, ...]] = set()
    out = []
    for v in ranked:
        key = _distinct_key(v)
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out


def _profiles(profile_of: Callable[[int], StageProfile], counts: Sequence[int]
              ) -> dict[int, StageProfile | str]:
    """The profile per stage count, or why the model cannot be cut into that many."""
    out: dict[int, StageProfile | str] = {}
    for S in counts:
        try:
            out[S] = profile_of(S)
        except GschedError as exc:
            out[S] = f"cannot cut {S} stages: {str(exc).splitlines()[0]}"
    return out


def tune(workers: int, global_rows: int, profile_of: Callable[[int], StageProfile],
         budget: int | None = None, costs: RuntimeCosts | None = None,
         schedules: Sequence[str] | None = None,
         checkpoint: Sequence[bool] = (False, True), *, stages: int | None = None,
         micro: int | None = None, R: int | None = None, replicas: int | None = None,
         top: int | None = TOP) -> TuneResult:
    """Rank the candidates (see :func:`~.tune_space.candidates`) by predicted step time; the
    ``top`` fastest that fit exactly (module docstring), those over the budget kept in the
    table as "no", those the planner refuses as dropped.

    ``profile_of(S)``: the model measured at S stages (called once per S, rising; raise a
    GschedError when the model cannot be cut into S stages, and the candidates with that S are
    dropped). ``stages``/``micro`` (B per replica)/``R``/``replicas`` (G): fixed values.
    ``costs``: the runtime's costs (default :data:`~.runtime_costs.DEFAULT_COSTS`).
    ``top``: the fitting candidates ranked exactly (None: cost every candidate).
    Raises :class:`ScheduleConfigError` when nothing fits, naming the smallest peak reached.
    """
    if top is not None and top < 1:
        raise ScheduleConfigError(f"top={top!r} must be a positive int (or None: every "
                                  "candidate costed), e.g. top=10")
    costs = costs or DEFAULT_COSTS
    space = candidates(workers, global_rows, schedules, checkpoint, stages=stages, micro=micro,
                       R=R, replicas=replicas)
    profiles = _profiles(profile_of, sorted({c.stages for c in space}))
    search = _Search(workers, costs, budget, top)
    for c in space:
        profile = profiles[c.stages]
        if isinstance(profile, str):
            search.uncosted.append(Verdict(c, reason=profile))
        else:
            search.add(c, profile)
    search.run()
    costed = _distinct(sorted(search.costed, key=lambda v: (
        not v.fits, v.step_time, v.peak, v.candidate.step_micro, v.candidate.replicas)))
    # sized only (peak known), then skipped by a bound, then refused by the planner
    uncosted = sorted(search.uncosted, key=lambda v: (v.peak is None, not v.skipped))
    result = TuneResult(costed + uncosted, budget, workers, global_rows,
                        profiles={S: p for S, p in profiles.items()
                                  if isinstance(p, StageProfile)}, top=top)
    if budget is not None and result.best is None:
        _nothing_fits(budget, result.verdicts)
    return result


def _nothing_fits(budget: int, verdicts: list[Verdict]) -> None:
    smallest = min((v for v in verdicts if v.peak is not None), key=lambda v: v.peak or 0,
                   default=None)
    raise ScheduleConfigError(
        f"no candidate fits the memory budget of {byte_text(budget)} per rank; the smallest "
        f"predicted peak is "
        + (f"{byte_text(smallest.peak)} ({smallest.candidate.text()})"
           if smallest is not None and smallest.peak is not None else "unknown")
        + ". Raise the budget, add workers, or shrink the per-rank batch."
    )
