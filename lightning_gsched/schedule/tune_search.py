"""The tuner's bounded search, its state: candidates in a heap by lower bound (branch and bound).

Why a module of its own: :mod:`.tune` says what the search returns and prints; this is how it
gets there without costing every candidate (the module docstring of :mod:`.tune` gives the
bounds and why the ranked rows are exact). Pure Python.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from dataclasses import dataclass, field

from lightning_gsched.errors import GschedError
from lightning_gsched.schedule.describe import byte_text
from lightning_gsched.schedule.plan import Plan
from lightning_gsched.schedule.runtime_costs import RuntimeCosts
from lightning_gsched.schedule.tune_cost import (
    StageProfile,
    Verdict,
    cap_choices,
    memory_bound,
    over_budget,
    plan_bound,
    plan_candidate,
    predict_peak,
    predict_time,
    work_bound,
)
from lightning_gsched.schedule.tune_space import Candidate

OVER_ROWS = 3  # the fastest candidates over the budget whose step time the table shows
_SLACK = 1e-9  # relative: a bound and a replay summing the same seconds in another order


@dataclass(order=True)
class Entry:
    """One candidate waiting in the search: its lower bound (the heap's key), its plan once
    made, and the programs of the caps already costed for its configuration (``family``)."""

    bound: float
    order: int
    candidate: Candidate = field(compare=False)
    profile: StageProfile = field(compare=False)
    planned: Plan | None = field(default=None, compare=False)
    family: list[object] = field(default_factory=list, compare=False)


@dataclass
class Over:
    """A candidate over the budget: its entry, its peak (None: only bounded) and the least
    peak known for it (its peak, or its bytes bound)."""

    entry: Entry
    peak: int | None
    least: int


class BoundedSearch:
    """The bounded search's state (module docstring): a heap of candidates by lower bound,
    the costed verdicts, and the ``top``-th fastest fitting step time (the threshold)."""

    def __init__(self, workers: int, costs: RuntimeCosts, budget: int | None,
                 top: int | None) -> None:
        self.workers, self.costs, self.budget, self.top = workers, costs, budget, top
        self.heap: list[Entry] = []
        self.costed: list[Verdict] = []
        self.uncosted: list[Verdict] = []
        self.over: list[Over] = []  # over the budget, not timed yet
        self._fit_times: list[float] = []  # distinct fitting verdicts' step times, sorted
        self._over_times: list[float] = []  # and those over the budget
        self._keys: set[tuple[object, ...]] = set()
        self._order = 0

    def push(self, entry: Entry) -> None:
        entry.order, self._order = self._order, self._order + 1
        heapq.heappush(self.heap, entry)

    def add(self, candidate: Candidate, profile: StageProfile) -> None:
        """A candidate of the space, bounded by its work (not planned yet)."""
        bound = work_bound(candidate, profile, self.workers, self.costs)
        self.push(Entry(bound, 0, candidate, profile))

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

    def _skip(self, entries: list[Entry]) -> None:
        limit = self.threshold()
        for e in entries:
            self.uncosted.append(Verdict(
                e.candidate, reason=f"step >= {e.bound * 1e3:.2f} ms (its bound) > "
                f"{limit * 1e3:.2f} ms", skipped=True))

    def _plan(self, entry: Entry) -> None:
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
            self.over.append(Over(entry, None, least))
        else:
            self.push(entry)
        if entry.candidate.cap is None:  # its smaller caps may fit where it does not
            for cap in cap_choices(entry.planned):
                self._add_capped(entry, cap)

    def _cost(self, entry: Entry) -> None:
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
            self.over.append(Over(entry, peak, peak))
        else:
            self._record(Verdict(c, predict_time(c, entry.profile, planned, self.costs), peak,
                                 not reason, reason))

    def _add_capped(self, parent: Entry, cap: int) -> None:
        """The parent's configuration at a smaller uniform cap, bounded by the parent's plan
        (a cap only holds jobs back) and planned when its turn comes."""
        capped = dataclasses.replace(parent.candidate, cap=cap)
        self.push(Entry(parent.bound, 0, capped, parent.profile, None, parent.family))

    def _record(self, v: Verdict) -> None:
        self.costed.append(v)
        key = distinct_key(v)
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


def distinct_key(v: Verdict) -> tuple[object, ...]:
    """What makes two verdicts the same row: the configuration but B, and the predictions
    (a schedule predicted alike at more, smaller microbatches adds nothing to the table)."""
    c = v.candidate
    return (c.schedule, c.stages, c.R, c.cap, c.checkpoint, c.replicas, c.mode, v.step_time,
            v.peak)
