"""The tuner's search: which schedule, data-parallel G and mode, S, B, R, cap and checkpointing
is fastest within a budget.

Why in the planner: every candidate is an ordinary plan whose programs the runtime would
execute unchanged (:mod:`.tune_cost`), so its predicted step time and bytes are those of the
real run, not of a separate model of the schedule. The space (:mod:`.tune_space`): every
library schedule, composed with G data-parallel replicas (each divisor of W below W, replicated
or sharded), its R, S and B choices, checkpointing off and on; and, for a schedule whose default
plan stashes more than one (stage, microbatch) per stage chunk on a worker, smaller uniform
activation caps (half the default plan's peak stash, and one microbatch in flight) that trade
bubble for activation memory; a cap whose programs equal an already tried one's is dropped.

Why bounded: the space at W=8 holds hundreds of candidates and costing one (replaying every
rank's program, walking its bytes) takes tens of milliseconds to a second, at the first batch
of a run, on rank 0, while the other ranks wait. The search ranks exactly the ``top`` fastest
candidates that fit (branch and bound; its state: :mod:`.tune_search`), and costs a candidate
only when its lower bound does not rule it out:

1. a candidate's work bound (:func:`~.tune_cost.work_bound`: its compute over W, one
   microbatch's chain) needs no plan;
2. planned (cheap: the planner plans one replica and renames it), its bound grows to the plan's
   own latency (:func:`~.tune_cost.plan_bound`), and with a budget a plan whose owned weights,
   gradients and optimizer state plus the least its timeline stashes exceed it cannot fit
   (:func:`~.tune_cost.memory_bound`);
3. only then is it sized (:func:`~.tune_cost.predict_peak`) and, when it fits, timed
   (:func:`~.tune_cost.predict_time`); over the budget, only the fastest few are timed, for
   the table's "what more memory would buy" rows.

Candidates are taken lowest bound first; once the lowest bound left exceeds the ``top``-th
fastest fitting step time found, nothing left can enter the table, and the search stops: its
``top`` rows, and so its pick, are those of costing every candidate (tests compare). A
candidate at a smaller cap enters when its default-cap plan is planned, with that plan's bound,
as a cap only holds jobs back (its plan is no faster than the default's). ``top=None`` costs
every candidate. When nothing fits the budget, the candidates skipped for their bytes bound are
sized, smallest bound first, until the smallest peak is known (the error names it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from lightning_gsched.errors import GschedError, ScheduleConfigError
from lightning_gsched.schedule.describe import byte_text
from lightning_gsched.schedule.runtime_costs import DEFAULT_COSTS, RuntimeCosts
from lightning_gsched.schedule.tune_cost import (
    StageProfile,
    Verdict,
    candidate_arguments,
    candidate_costs,
    cap_choices,
    evaluate,
    plan_candidate,
)
from lightning_gsched.schedule.tune_search import BoundedSearch, distinct_key
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


def _distinct(ranked: list[Verdict]) -> list[Verdict]:
    """Drop a candidate predicted exactly like a better-ranked one of the same schedule, S, R,
    cap, checkpointing, G and mode (e.g. DDP with more, smaller microbatches): fewer
    microbatches first."""
    seen: set[tuple[object, ...]] = set()
    out = []
    for v in ranked:
        key = distinct_key(v)
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
    search = BoundedSearch(workers, costs, budget, top)
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
    """Raise the error naming the smallest peak (and its candidate): what to raise the budget
    to, or which configuration comes closest."""
    smallest = min((v for v in verdicts if v.peak is not None), key=lambda v: v.peak or 0,
                   default=None)
    raise ScheduleConfigError(
        f"no candidate fits the memory budget of {byte_text(budget)} per rank; the smallest "
        f"predicted peak is "
        + (f"{byte_text(smallest.peak)} ({smallest.candidate.text()})"
           if smallest is not None and smallest.peak is not None else "unknown")
        + ". Raise the budget, add workers, or shrink the per-rank batch."
    )
