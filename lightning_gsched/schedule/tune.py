"""The tuner: which schedule, data-parallel G and mode, S, B, R, cap and checkpointing is fastest
within a memory budget.

Every candidate (:func:`candidates`, plus smaller caps: :func:`cap_choices`) is an ordinary plan the
runtime would execute unchanged. B per replica takes P, 2P and 4P (P = W / G), so a step's
microbatch counts and sizes are the same at every G and one profile serves them all; at another
microbatch size than the profile's, stashes and messages scale linearly with the rows, compute times
affinely (each job's ``fixed_share``, dispatch and autograd set-up, stays). Left out unless G is
fixed, as searched under another name: G = W (ddp or fsdp) and lpp with G > 1 (replicas of a loop).

Why bounded: costing a candidate replays every rank's program, at the first batch while all ranks
wait, and there are hundreds. So a branch and bound ranks exactly the ``top`` fastest that fit,
lowest lower bound first: :func:`work_bound`, then :func:`plan_bound` once planned; a plan over the
budget by :func:`memory_bound` is set aside; only then is a candidate sized and, fitting, timed.
Once the lowest bound left exceeds the ``top``-th fastest fitting time, nothing left can enter the
table, so rows and pick equal costing every candidate (tests compare). A smaller cap enters with
its default-cap plan's bound (a cap only holds jobs back), and is dropped if its programs equal a
costed cap's. Over the budget only the :data:`OVER_ROWS` fastest are timed; when nothing fits, those
set aside are sized, smallest bound first, until the smallest peak is known (the error names it).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

from lightning_gsched.errors import GschedError, ScheduleConfigError
from lightning_gsched.schedule.arguments import DEFAULT, ScheduleArguments
from lightning_gsched.schedule.data_parallel import (
    ALREADY_DATA_PARALLEL,
    MODES,
    check_data_parallel,
    pipeline_size,
)
from lightning_gsched.schedule.describe import byte_text
from lightning_gsched.schedule.jobs import Phase
from lightning_gsched.schedule.library import LIBRARY, get_schedule
from lightning_gsched.schedule.memory import ModelSizes, predict_memory
from lightning_gsched.schedule.plan import Plan, plan_arguments, resolve_arguments
from lightning_gsched.schedule.predict import predict_step_time
from lightning_gsched.schedule.runtime_costs import DEFAULT_COSTS, RuntimeCosts
from lightning_gsched.schedule.simulate import Costs

TOP = 10  # the fitting candidates ranked exactly by default (the startup table's rows)
OVER_ROWS = 3  # the fastest candidates over the budget whose step time the table shows
_SLACK = 1e-9  # relative: a bound and a replay summing the same seconds in another order


@dataclass(frozen=True)
class Candidate:
    """What ``plan()`` is asked for. ``micro``: B per replica; ``replicas``: G; ``rows``: one
    microbatch's rows (global batch / (B x G)); ``cap``: uniform per worker, None: the default."""

    schedule: str
    stages: int
    micro: int
    R: int | None
    checkpoint: bool
    rows: int
    cap: int | None = None
    replicas: int = 1
    mode: str = "replicate"

    @property
    def step_micro(self) -> int:  # microbatches one step cuts the global batch into: B x G
        return self.micro * self.replicas

    def shape_text(self) -> str:
        """Schedule, S, B, R, cap and checkpointing (the table's candidate column)."""
        r = f" R={self.R}" if self.R is not None else ""
        cap = f" cap={self.cap}" if self.cap is not None else ""
        return (f"{self.schedule} S={self.stages} B={self.micro}{r}{cap}"
                + (" ckpt" if self.checkpoint else ""))

    def text(self) -> str:  # the whole configuration: shape_text, then G and the mode
        return self.shape_text() + (f" G={self.replicas} {self.mode}" if self.replicas > 1 else "")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def replica_counts(workers: int, fixed: int | None = None) -> list[int]:
    """The G values searched: each divisor of W below W (1 when W = 1), or the user's ``fixed``."""
    return [fixed] if fixed is not None else _divisors(workers)[:-1] or [1]


def microbatch_counts(workers: int, global_rows: int, micro: int | None = None,
                      replicas: int = 1) -> list[int]:
    """The B values per replica searched at G = ``replicas``: those giving W, 2W and 4W
    microbatches per step that divide the global batch, else the largest step count <= W that
    divides it and that G divides; only the user's ``micro`` (when B x G divides the batch:
    the step cuts equal microbatches, at G = 1 too)."""
    G = replicas
    if micro is not None:
        return [micro] if global_rows % (micro * G) == 0 else []
    counts = [T for T in dict.fromkeys((workers, 2 * workers, 4 * workers)) if global_rows % T == 0]
    if not counts:
        counts = [T for T in _divisors(global_rows) if T <= workers and T % G == 0][-1:]
    return [T // G for T in counts]


def most_microbatches(workers: int, global_rows: int, micro: int | None = None,
                      replicas: int | None = None) -> int:
    """The most microbatches any candidate cuts a step into (B x G): the engine profiles a
    microbatch of ``global_rows`` / that many rows, the smallest any candidate runs."""
    steps = [B * G for G in replica_counts(workers, replicas)
             for B in microbatch_counts(workers, global_rows, micro, G)]
    return max(steps, default=micro or 1)


def _Rs(name: str, pipeline: int, R: int | None) -> list[int | None]:
    """The user's R (None where R is no parameter), else the default on P workers and, unless it
    is P (one group), the divisors of P strictly between 1 and P (1, P: ddp, gpipe placements)."""
    default_R = get_schedule(name).default_R
    if R is not None or default_R is None:
        return [R]
    default = default_R(pipeline)
    middle = [d for d in _divisors(pipeline) if 1 < d < pipeline]
    return list(dict.fromkeys([default] + (middle if default < pipeline else [])))


def _default_stages(name: str, workers: int, R: int | None, G: int, mode: str) -> int:
    """``plan()``'s default S for this shape; for an R it refuses (the user's, not dividing P),
    the P-worker default, so that the candidate's verdict names the reason."""
    try:
        return resolve_arguments(ScheduleArguments(
            schedule=name, R=R, data_parallel_size=G, data_parallel=mode), workers)[0]
    except GschedError:
        return get_schedule(name).stages(workers // G, R or 1)


def candidates(workers: int, global_rows: int, schedules: Sequence[str] | None = None,
               checkpoint: Sequence[bool] = (False, True), *, stages: int | None = None,
               micro: int | None = None, R: int | None = None,
               replicas: int | None = None) -> list[Candidate]:
    """Every library schedule at every G in each mode it takes, with its R choices on P workers,
    its default S for that shape and twice that, each B, checkpointing off and on; or the user's
    ``stages``, ``micro``, ``R`` (only the looped schedules then), ``replicas``."""
    if replicas is not None:
        pipeline_size(workers, replicas)  # G divides W, or the error naming the divisors
    replica_sizes = replica_counts(workers, replicas)
    _check_fixed(workers, global_rows, schedules, micro, R, replica_sizes)
    out: list[Candidate] = []
    for G in replica_sizes:
        micros = microbatch_counts(workers, global_rows, micro, G)
        for name in schedules or list(LIBRARY):
            if R is not None and get_schedule(name).default_R is None:
                continue
            # refused by plan(), or searched already (module docstring)
            skip = name in ALREADY_DATA_PARALLEL or (name == "lpp" and replicas is None)
            modes: Sequence[str] = ["replicate"] if G == 1 else [] if skip else MODES
            for mode, r in itertools.product(modes, _Rs(name, workers // G, R)):
                default_s = _default_stages(name, workers, r, G, mode)
                Ss = [stages] if stages is not None else [default_s, 2 * default_s]
                out += [Candidate(name, S, B, r, ckpt, global_rows // (B * G), None, G, mode)
                        for S, B, ckpt in itertools.product(Ss, micros, checkpoint)]
    return out


def _check_fixed(workers: int, global_rows: int, schedules: Sequence[str] | None,
                 micro: int | None, R: int | None, replica_sizes: Sequence[int]) -> None:
    """Refuse a user's B or R that no candidate can take, naming why and what would: the search
    would otherwise end in "nothing fits" with no reason (every candidate dropped)."""
    if schedules is not None and 1 not in replica_sizes:
        for name in schedules:  # a schedule refused at every G searched: say so, as plan() does
            if name in ALREADY_DATA_PARALLEL:
                check_data_parallel(name, min(replica_sizes), "replicate")

    def searched(b: int) -> bool:  # some G takes B = b (microbatch_counts' rule)
        return any(microbatch_counts(workers, global_rows, b, G) for G in replica_sizes)

    if micro is not None and not searched(micro):
        steps = "B" if list(replica_sizes) == [1] else f"B x G (G in {list(replica_sizes)})"
        raise ScheduleConfigError(
            f"microbatches={micro} does not cut the global batch of {global_rows} rows into "
            f"equal microbatches: {steps} must divide it. Choose microbatches among "
            f"{[b for b in _divisors(global_rows) if searched(b)]}, or leave it out to search")
    looped = [n for n in schedules or list(LIBRARY) if get_schedule(n).default_R is not None]
    if R is not None and looped and not any((workers // G) % R == 0 for G in replica_sizes):
        pipelines = sorted({workers // G for G in replica_sizes})
        raise ScheduleConfigError(
            f"R={R} divides no pipeline's workers: each replica runs on P = W / G = "
            f"{', '.join(map(str, pipelines))} workers (G in {list(replica_sizes)}), and a looped "
            f"schedule's R must divide P. Choose R among "
            f"{sorted({r for P in pipelines for r in _divisors(P)})}, or leave it out to search")


@dataclass(frozen=True)
class StageProfile:
    """The model cut into ``stages`` stages, measured on one microbatch of ``rows`` rows: seconds
    and bytes per stage (``split``: B and W of the split backward, None to halve ``backward``;
    ``fixed_share``: per stage, the share of (forward, backward) seconds not scaling with rows)."""

    stages: int
    rows: int
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    sizes: ModelSizes
    split: tuple[tuple[float, ...], tuple[float, ...]] | None = None
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
    """Per-stage (forward, backward, weight) seconds at the candidate's rows (weight: if split)."""
    f = candidate.rows / profile.rows
    fixed_f, fixed_b = profile.fixed_share or ((0.0,) * profile.stages,) * 2

    def scaled(times: Sequence[float], fixed: Sequence[float]) -> list[float]:
        return [t * (k + (1 - k) * f) for t, k in zip(times, fixed, strict=True)]

    forward = scaled(profile.forward, fixed_f)
    if get_schedule(candidate.schedule).split_backward and profile.split is not None:
        return forward, scaled(profile.split[0], fixed_b), scaled(profile.split[1], fixed_b)
    return forward, scaled(profile.backward, fixed_b), None


def _scaled_sizes(profile: StageProfile, rows: int) -> ModelSizes:
    f = rows / profile.rows
    stages = tuple(dataclasses.replace(
        st, activations=int(st.activations * f), message=int(st.message * f),
        received_activations=int(st.stash_from_message * f), inputs=int(st.inputs * f),
        loss_graph=int(st.loss_graph * f)) for st in profile.sizes.stages)
    return dataclasses.replace(profile.sizes, stages=stages)


def candidate_arguments(candidate: Candidate, profile: StageProfile) -> ScheduleArguments:
    """What a user would pass ``plan()`` for ``candidate``, with the profile's seconds and tied
    weights: ``GeneralParallel("auto")`` trains its pick with these, as the tuner costed them."""
    c = candidate
    forward, backward, weight = candidate_costs(c, profile)
    return ScheduleArguments(
        schedule=c.schedule, stages=c.stages, microbatches=c.micro, R=c.R,
        cap=DEFAULT if c.cap is None else c.cap, checkpoint_activations=c.checkpoint,
        forward_cost=forward, backward_cost=backward, weight_cost=weight,
        ties=profile.sizes.tie_map, data_parallel_size=c.replicas, data_parallel=c.mode)


def plan_candidate(candidate: Candidate, profile: StageProfile, workers: int) -> Plan:
    return plan_arguments(candidate_arguments(candidate, profile), workers)


def _clipped(text: str, limit: int = 300) -> str:
    """``text``, or its first ``limit`` characters cut at a word and marked: a verdict's reason
    is one line of a table's notes (the planner's errors are long, their point up front)."""
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def _refused(candidate: Candidate, exc: GschedError) -> Verdict:
    return Verdict(candidate, reason=f"invalid: {_clipped(str(exc).splitlines()[0])}")


def cap_choices(default: Plan) -> list[int]:
    """Smaller uniform caps worth trying, trading bubble for activation memory: half the default
    plan's peak stash count (off its timeline), and one microbatch in flight per worker, below
    which nothing completes (a worker computing k stages of a microbatch holds k stashes)."""
    timeline, ones = default.timeline, [1] * default.stages
    release = Phase.W if Phase.W in timeline.phases else Phase.B
    peak = max((_peak_stash(order, default, ones, release) for order in timeline.order),
               default=0)
    chunk = max(Counter(row[0] for row in default.table.compute).values(), default=1)
    return [c for c in dict.fromkeys(((peak + 1) // 2, chunk)) if chunk <= c < peak]


def predict_peak(candidate: Candidate, profile: StageProfile, planned: Plan) -> int:
    sizes = _scaled_sizes(profile, candidate.rows)
    return max(m.peak for m in predict_memory(planned.programs, sizes, planned.checkpointed))


def _over_budget(peak: int, budget: int | None) -> str:
    return "" if budget is None or peak <= budget else f"peak {byte_text(peak)} > budget"


def _timed(c: Candidate, profile: StageProfile, planned: Plan, costs: RuntimeCosts,
           budget: int | None, peak: int | None = None) -> Verdict:
    """The candidate's verdict: its peak (predicted unless given), then its step time."""
    peak = predict_peak(c, profile, planned) if peak is None else peak
    reason = _over_budget(peak, budget)
    step = predict_step_time(planned, costs=costs, sizes=_scaled_sizes(profile, c.rows)).latency
    return Verdict(c, step, peak, not reason, reason)


def evaluate(candidate: Candidate, profile: StageProfile, workers: int, costs: RuntimeCosts,
             budget: int | None) -> Verdict:
    """Plan the candidate with the profile's costs: its step time and peak bytes."""
    try:
        planned = plan_candidate(candidate, profile, workers)
    except GschedError as exc:
        return _refused(candidate, exc)
    return _timed(candidate, profile, planned, costs, budget)


def work_bound(candidate: Candidate, profile: StageProfile, workers: int,
               costs: RuntimeCosts) -> float:
    """A lower bound of the candidate's step time, unplanned: the replay charges every compute
    job its cost plus ``costs.job_cpu`` on its worker, keeps each microbatch's chain (F of every
    stage, then B of every stage), adds ``costs.step_cpu``, and every other charge only delays."""
    S, split = candidate.stages, get_schedule(candidate.schedule).split_backward
    jobs = Costs.build(S, *candidate_costs(candidate, profile), split).with_recompute(
        [candidate.checkpoint] * S)
    per_micro = sum(jobs.forward) + sum(jobs.backward) + sum(jobs.weight)
    total = candidate.step_micro * (per_micro + S * (3 if split else 2) * costs.job_cpu)
    chain = sum(jobs.forward) + sum(jobs.backward) + 2 * S * costs.job_cpu
    return max(total / workers, chain) + costs.step_cpu


def plan_bound(planned: Plan, costs: RuntimeCosts) -> float:
    """A lower bound of the plan's step time: the replay keeps its orders and only adds
    non-negative charges to its compute-only latency, then ``costs.step_cpu``."""
    return planned.metrics.latency + costs.step_cpu


def memory_bound(candidate: Candidate, profile: StageProfile, planned: Plan) -> int:
    """A lower bound of the plan's peak bytes, no program walked: a rank holds its stages'
    weights, gradients and optimizer state all step, and at least the smaller of a stage's two
    stash sizes (its inputs, checkpointed) from each ``F`` to its ``B`` in its timeline's order."""
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
    deltas = (step[i % len(phases)] * held_bytes[i // per_stage] for i in order)
    return max(itertools.accumulate(deltas, initial=0))


@dataclass
class TuneResult:
    """Every verdict: the timed, fastest fitting first; then the sized only, the skipped by a bound,
    the refused by the planner. ``top``: the fitting rows ranked exactly (None: all costed).
    ``tensor_parallel_size``: T ranks per worker (``workers`` counts workers; the table says
    both)."""

    verdicts: list[Verdict]
    budget: int | None
    workers: int
    global_rows: int
    profiles: dict[int, StageProfile] = field(default_factory=dict)  # per S, as measured
    top: int | None = None
    tensor_parallel_size: int = 1

    @property
    def best(self) -> Verdict | None:  # the pick; None when nothing fits
        return next((v for v in self.verdicts if v.fits), None)

    def table(self, limit: int = 20) -> str:
        """The ranked table `gsched tune` prints."""
        row = "{:>4}  {:<34} {:>2}  {:<9} {:>10}  {:>10}  {}".format
        T = self.tensor_parallel_size
        W = f"W={self.workers}" if T == 1 else \
            f"W={self.workers * T} ({self.workers} workers of T={T} ranks)"
        lines = [f"gsched tune: {W}, global batch {self.global_rows} rows, budget "
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
        for mem, what in ((False, f"slower than the {self.top} fastest that fit"),
                          (True, "over the budget")):
            group = [v for v in self.verdicts if v.skipped and v.reason.endswith("budget") == mem]
            if group:
                lines.append(f"not costed: {len(group)} {what} by their lower bounds (e.g. "
                             f"{group[0].candidate.text()}: {group[0].reason})")
        invalid = [v for v in self.verdicts
                   if v.step_time is None and v.peak is None and not v.skipped]
        if invalid:
            lines.append(f"dropped before costing: {len(invalid)} (e.g. "
                         f"{invalid[0].candidate.text()}: {invalid[0].reason})")
        best = self.best
        if best is not None:
            pick = best.candidate.text()
        elif any(v.peak is not None or v.skipped for v in self.verdicts):
            pick = "nothing fits the budget"
        else:
            pick = "none: no candidate could be planned (see why above)"
        return "\n".join([*lines, "pick: " + pick])


def _distinct_key(v: Verdict) -> tuple[object, ...]:
    """What makes two verdicts the same row: the configuration but B, and the predictions (a
    schedule predicted alike at more, smaller microbatches adds nothing to the table)."""
    return dataclasses.replace(v.candidate, micro=0, rows=0), v.step_time, v.peak


def _kth(times: list[float], k: int | None) -> float:
    """A candidate with a larger bound cannot enter the ``k`` fastest of sorted ``times``."""
    return float("inf") if k is None or len(times) < k else times[k - 1] * (1 + _SLACK)


@dataclass(order=True)
class _Entry:
    """A candidate in the search: its bound (the heap's key), plan once made, the programs of its
    configuration's costed caps; set aside over budget, its peak (None: bounded) and least peak."""

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

    def run(self) -> None:
        while self.heap:
            entry = heapq.heappop(self.heap)
            if entry.bound > (limit := _kth(self.fit_times, self.top)):
                self.uncosted += [Verdict(e.candidate, reason=f"step >= {e.bound * 1e3:.2f} ms "
                                          f"(its bound) > {limit * 1e3:.2f} ms", skipped=True)
                                  for e in [entry, *self.heap]]
                self.heap = []
            elif entry.planned is None:
                self._plan(entry)
            else:
                self._cost(entry)
        if self.budget is not None and not self.fit_times:
            self._smallest_peak()
        self._time_fastest_over()

    def _plan(self, entry: _Entry) -> None:
        """Refused, drop it (a smaller cap silently: its default's verdict stands); over budget by
        its bytes bound, set it aside; else back in the heap at its plan's bound, its caps too."""
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
            for capped in (dataclasses.replace(c, cap=cap) for cap in cap_choices(entry.planned)):
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
        if self.top is not None and _over_budget(peak, self.budget):
            entry.peak = entry.least = peak
            self.over.append(entry)
        else:
            self._record(_timed(c, entry.profile, planned, self.costs, self.budget, peak))

    def _record(self, v: Verdict) -> None:
        assert v.step_time is not None
        self.costed.append(v)
        if (key := _distinct_key(v)) not in self.keys:
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
            assert e.planned is not None
            if e.bound <= _kth(self.over_times, OVER_ROWS):
                self._record(_timed(e.candidate, e.profile, e.planned, self.costs, self.budget,
                                    e.peak))
            elif e.peak is not None:
                self.uncosted.append(Verdict(e.candidate, None, e.peak, False,
                                             _over_budget(e.peak, self.budget)))
            else:
                self.uncosted.append(Verdict(e.candidate, skipped=True, reason=(
                    f"peak >= {byte_text(e.least)} (its bound) > the budget")))


def tune(workers: int, global_rows: int, profile_of: Callable[[int], StageProfile],
         budget: int | None = None, costs: RuntimeCosts | None = None,
         schedules: Sequence[str] | None = None, checkpoint: Sequence[bool] = (False, True), *,
         stages: int | None = None, micro: int | None = None, R: int | None = None,
         replicas: int | None = None, top: int | None = TOP) -> TuneResult:
    """Rank the candidates by predicted step time. ``profile_of(S)``: the model measured at S
    stages (called once per S, rising; its GschedError drops the candidates with that S). Raises
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
    search.uncosted += [Verdict(c, reason=cannot[c.stages]) for c in space if c.stages in cannot]
    for c in space:
        if (p := profiles.get(c.stages)) is not None:
            search.push(_Entry(work_bound(c, p, workers, costs), 0, c, p))
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
        peaks = [(v.peak, v.candidate.text()) for v in result.verdicts if v.peak is not None]
        least = min(peaks, key=lambda p: p[0], default=None)
        raise ScheduleConfigError(
            f"no candidate fits the memory budget of {byte_text(budget)} per rank; the smallest "
            f"predicted peak is {f'{byte_text(least[0])} ({least[1]})' if least else 'unknown'}. "
            "Raise the budget, add workers, or shrink the per-rank batch.")
    return result
