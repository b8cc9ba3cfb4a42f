"""The tuner's search: which schedule, S, B, R, cap and checkpointing is fastest within a budget.

Why in the planner: every candidate is an ordinary ``plan()`` whose programs the runtime would
execute unchanged, so its predicted step time (``predict_step_time`` with the runtime's costs:
:class:`~.runtime_costs.RuntimeCosts`, measured on the job's process group when there is one)
and its predicted bytes per rank (``predict_memory``) are those of the real run, not of a
separate model of the schedule. Charging every message and every job its runtime cost keeps
the search from preferring many tiny jobs whose compute alone looks fast.

Activation caps: a schedule's default cap, and for a schedule whose default plan stashes more
than one (stage, microbatch) per stage chunk on a worker, smaller uniform caps (half the default
plan's peak stash, and one per stage chunk) that trade bubble for activation memory; a cap
whose programs equal an already tried one's is dropped. Pure Python: what the model costs comes in as numbers,
measured by the torch layers per stage count (:class:`StageProfile`, from
``measure.stage_profile``).

Scaling: a profile is measured on microbatches of ``rows`` rows; a candidate with another
microbatch size scales stashed activations and messages linearly with the rows (weights,
gradients and optimizer state do not change), and compute times affinely: each job's
``fixed_share`` of its profiled time (per stage, forward and backward; what does not shrink
with the rows: per-op dispatch, autograd set-up) stays, the rest scales with the rows.
Linear scaling alone (``fixed_share`` None or 0) scales the fixed costs too, so it is
optimistic for microbatches smaller than the profile's: it made the tuner prefer the smallest
microbatches on the benchmark GPT (docs/benchmarks.md, "Measurements behind design choices").

Checkpointing (``plan(checkpoint_activations=True)``, every stage) keeps only each stage's inputs
between F and B and recomputes the forward at B: the planner charges the recompute to B, and the
bytes model holds the inputs instead of the graph (``schedule/memory.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Sequence

from lightning_gsched.errors import GschedError, ScheduleConfigError
from lightning_gsched.schedule.arguments import DEFAULT
from lightning_gsched.schedule.describe import byte_text
from lightning_gsched.schedule.library import LIBRARY, get_schedule
from lightning_gsched.schedule.memory import ModelSizes, StageSizes, predict_memory
from lightning_gsched.schedule.plan import Plan, plan
from lightning_gsched.schedule.predict import predict_step_time
from lightning_gsched.schedule.runtime_costs import DEFAULT_COSTS, RuntimeCosts


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
class Candidate:
    """One configuration; ``rows``: rows of one microbatch (the global batch / ``micro``);
    ``cap``: a uniform activation cap per worker, None for the schedule's default."""

    schedule: str
    stages: int
    micro: int
    R: int | None
    checkpoint: bool
    rows: int
    cap: int | None = None

    def text(self) -> str:
        r = f" R={self.R}" if self.R is not None else ""
        cap = f" cap={self.cap}" if self.cap is not None else ""
        return (f"{self.schedule} S={self.stages} B={self.micro}{r}{cap}"
                + (" ckpt" if self.checkpoint else ""))


@dataclass(frozen=True)
class Verdict:
    """A candidate's predicted step time and peak bytes (max over ranks), or why it was dropped."""

    candidate: Candidate
    step_time: float | None = None
    peak: int | None = None
    fits: bool = False
    reason: str = ""


@dataclass
class TuneResult:
    """Every verdict, fastest fitting first; ``best`` is the pick (None when nothing fits)."""

    verdicts: list[Verdict]
    budget: int | None
    workers: int
    global_rows: int
    profiles: dict[int, StageProfile] = field(default_factory=dict)  # per S, as measured

    @property
    def best(self) -> Verdict | None:
        fitting = [v for v in self.verdicts if v.fits]
        return fitting[0] if fitting else None

    def table(self, limit: int = 20) -> str:
        """The ranked table `gsched tune` prints."""
        lines = [f"gsched tune: W={self.workers}, global batch {self.global_rows} rows, budget "
                 + (byte_text(self.budget) if self.budget is not None else "none"),
                 f"{'rank':>4}  {'candidate':<40} {'step time':>10}  {'peak/rank':>10}  fits",
                 f"{'-' * 4}  {'-' * 40} {'-' * 10}  {'-' * 10}  ----"]
        costed = [v for v in self.verdicts if v.step_time is not None]
        fitting, over = [v for v in costed if v.fits], [v for v in costed if not v.fits]
        # the fastest that fit, then the fastest few over the budget (what it would buy)
        shown = fitting[:limit] + over[:max(3, limit - len(fitting))]
        for i, v in enumerate(shown, 1):
            assert v.step_time is not None and v.peak is not None
            lines.append(f"{i:>4}  {v.candidate.text():<40} {v.step_time * 1e3:>7.1f} ms  "
                         f"{byte_text(v.peak):>10}  {'yes' if v.fits else 'no: ' + v.reason}")
        if len(over) > len(shown) - len(fitting[:limit]):
            lines.append(f"over the budget: {len(over)} candidates in all")
        invalid = [v for v in self.verdicts if v.step_time is None]
        if invalid:
            lines.append(f"dropped before costing: {len(invalid)} (e.g. "
                         f"{invalid[0].candidate.text()}: {invalid[0].reason})")
        best = self.best
        lines.append("pick: " + (f"{best.candidate.text()}" if best is not None else
                                 "nothing fits"))
        return "\n".join(lines)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def microbatch_counts(workers: int, global_rows: int, micro: int | None = None) -> list[int]:
    """The B values the search tries: W, 2W and 4W where they divide the global batch (else
    the largest divisor <= W); only ``micro`` when the user fixed it."""
    if micro is not None:
        return [micro]
    return ([b for b in dict.fromkeys((workers, 2 * workers, 4 * workers)) if global_rows % b == 0]
            or [d for d in _divisors(global_rows) if d <= workers][-1:])


def candidates(workers: int, global_rows: int, schedules: Sequence[str] | None = None,
               checkpoint: Sequence[bool] = (False, True), *, stages: int | None = None,
               micro: int | None = None, R: int | None = None) -> list[Candidate]:
    """The search space: every library schedule with its R choices (the default, and the
    divisors of W strictly between 1 and W), its default S and twice that, B in {W, 2W, 4W}
    (dividing the global batch), checkpointing on and off.

    ``stages``, ``micro``, ``R``: fixed by the user (``GeneralParallel("auto", stages=4)``):
    only that S, that B; with R only the schedules that take one (the looped ones), with that R.
    """
    out = []
    micros = microbatch_counts(workers, global_rows, micro)
    for name in schedules or list(LIBRARY):
        spec = get_schedule(name)
        if R is not None and spec.default_R is None:
            continue
        # R=1 and R=W are DDP's and GPipe's placements under another name (seed, Table 1):
        # the looped schedules try their default R and the R strictly between
        Rs: list[int | None] = [None]
        if R is not None:
            Rs = [R]
        elif spec.default_R is not None:
            default_R = spec.default_R(workers)
            middle = [d for d in _divisors(workers) if 1 < d < workers]
            # a schedule whose default is one group of all W (interleaved) has no other R
            Rs = list(dict.fromkeys([default_R] + (middle if default_R < workers else [])))
        for r in Rs:
            default_s = spec.stages(workers, r or 1)
            for S in [stages] if stages is not None else dict.fromkeys((default_s,
                                                                        2 * default_s)):
                for B in micros:
                    for ckpt in checkpoint:
                        out.append(Candidate(name, S, B, r, ckpt, global_rows // B))
    return out


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


def _scaled(profile: StageProfile, rows: int) -> ModelSizes:
    """Sizes for microbatches of ``rows`` rows."""
    f = rows / profile.rows

    def stage(st: StageSizes) -> StageSizes:
        return dataclasses.replace(
            st, activations=int(st.activations * f),
            received_activations=int(st.stash_from_message * f), message=int(st.message * f),
            inputs=int(st.inputs * f), loss_graph=int(st.loss_graph * f))

    return dataclasses.replace(profile.sizes, stages=tuple(map(stage, profile.sizes.stages)))


def plan_candidate(candidate: Candidate, profile: StageProfile, workers: int) -> Plan:
    """The candidate's plan with the profile's costs (raises the planner's GschedError)."""
    forward, backward, weight = candidate_costs(candidate, profile)
    return plan(candidate.schedule, workers=workers, stages=candidate.stages,
                microbatches=candidate.micro, R=candidate.R,
                cap=DEFAULT if candidate.cap is None else candidate.cap,
                checkpoint_activations=candidate.checkpoint, forward_cost=forward,
                backward_cost=backward, weight_cost=weight, ties=profile.sizes.tie_map)


def cap_choices(default: Plan) -> list[int]:
    """Smaller uniform caps worth trying beside a schedule's default plan (module docstring):
    half its peak stash and one (stage, microbatch) per stage chunk, both below the peak."""
    peak = int(default.metrics.max_of("peak_activations"))
    chunk = max(1, default.stages // default.workers)
    return [c for c in dict.fromkeys(((peak + 1) // 2, chunk)) if 0 < c < peak]


def evaluate(candidate: Candidate, profile: StageProfile, workers: int, costs: RuntimeCosts,
             budget: int | None, planned: Plan | None = None) -> Verdict:
    """Plan the candidate with the profile's costs; its step time and peak bytes
    (``planned``: its plan when the caller already has it)."""
    sizes = _scaled(profile, candidate.rows)
    try:
        result = planned or plan_candidate(candidate, profile, workers)
    except GschedError as exc:
        return Verdict(candidate, reason=f"invalid: {str(exc).splitlines()[0][:120]}")
    step = predict_step_time(result, costs=costs, sizes=sizes).latency
    peak = max(m.peak for m in predict_memory(result.programs, sizes, result.checkpointed))
    fits = budget is None or peak <= budget
    return Verdict(candidate, step, peak, fits,
                   "" if fits else f"peak {byte_text(peak)} > budget")


def _with_caps(c: Candidate, profile: StageProfile, workers: int, costs: RuntimeCosts,
               budget: int | None) -> list[Verdict]:
    """The candidate at its schedule's default cap, then at each smaller cap whose programs
    differ from every one tried before (a cap the planner refuses is dropped silently: the
    default's verdict already stands for the configuration)."""
    try:
        default = plan_candidate(c, profile, workers)
    except GschedError:
        return [evaluate(c, profile, workers, costs, budget)]
    verdicts = [evaluate(c, profile, workers, costs, budget, default)]
    seen = [default.programs.ranks]
    for cap in cap_choices(default):
        capped = dataclasses.replace(c, cap=cap)
        try:
            result = plan_candidate(capped, profile, workers)
        except GschedError:
            continue
        if result.programs.ranks in seen:
            continue
        seen.append(result.programs.ranks)
        verdicts.append(evaluate(capped, profile, workers, costs, budget, result))
    return verdicts


def _distinct(ranked: list[Verdict]) -> list[Verdict]:
    """Drop a candidate predicted exactly like a better-ranked one of the same schedule, S, R,
    cap and checkpointing (e.g. DDP with more, smaller microbatches): fewer microbatches first."""
    seen: set[tuple[object, ...]] = set()
    out = []
    for v in ranked:
        c = v.candidate
        key = (c.schedule, c.stages, c.R, c.cap, c.checkpoint, v.step_time, v.peak)
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out


def tune(workers: int, global_rows: int, profile_of: Callable[[int], StageProfile],
         budget: int | None = None, costs: RuntimeCosts | None = None,
         schedules: Sequence[str] | None = None,
         checkpoint: Sequence[bool] = (False, True), *, stages: int | None = None,
         micro: int | None = None, R: int | None = None) -> TuneResult:
    """Rank every candidate (see :func:`candidates`) by predicted step time; those over the
    budget are kept in the table as "no", those the planner refuses as dropped.

    ``profile_of(S)``: the model measured at S stages (called once per S; raise a GschedError
    when the model cannot be cut into S stages, and the candidates with that S are dropped).
    ``stages``/``micro``/``R``: fixed values (see :func:`candidates`). ``costs``: the
    runtime's costs (default :data:`~.runtime_costs.DEFAULT_COSTS`); each candidate is also
    tried at smaller activation caps (:func:`cap_choices`).
    Raises :class:`ScheduleConfigError` when nothing fits, naming the smallest peak reached.
    """
    costs = costs or DEFAULT_COSTS
    profiles: dict[int, StageProfile | str] = {}
    verdicts = []
    for c in candidates(workers, global_rows, schedules, checkpoint, stages=stages, micro=micro,
                        R=R):
        if c.stages not in profiles:
            try:
                profiles[c.stages] = profile_of(c.stages)
            except GschedError as exc:
                profiles[c.stages] = f"cannot cut {c.stages} stages: {str(exc).splitlines()[0]}"
        profile = profiles[c.stages]
        if isinstance(profile, str):
            verdicts.append(Verdict(c, reason=profile))
            continue
        verdicts.extend(_with_caps(c, profile, workers, costs, budget))
    costed = sorted((v for v in verdicts if v.step_time is not None),
                    key=lambda v: (not v.fits, v.step_time, v.peak, v.candidate.micro))
    costed = _distinct(costed)
    result = TuneResult(costed + [v for v in verdicts if v.step_time is None], budget, workers,
                        global_rows, profiles={S: p for S, p in profiles.items()
                                               if isinstance(p, StageProfile)})
    if budget is not None and result.best is None:
        smallest = min((v.peak for v in costed if v.peak is not None), default=None)
        raise ScheduleConfigError(
            f"no candidate fits the memory budget of {byte_text(budget)} per rank; the smallest "
            f"predicted peak is {byte_text(smallest) if smallest is not None else 'unknown'}"
            + (f" ({min(costed, key=lambda v: v.peak or 0).candidate.text()})" if costed else "")
            + ". Raise the budget, add workers, or shrink the per-rank batch."
        )
    return result
