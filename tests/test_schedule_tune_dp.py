"""The tuner with data parallelism (schedule/tune*.py): G and the mode searched, the bounded
search, budgets only a sharded 2D plan meets, G fixed by the user.

Two synthetic models, measured at 8 rows per microbatch, forward 1.0 s and backward 2.0 s in
all (B and W 1.0 each when split), 100 MiB of weights, as many of gradients, twice that of
optimizer state:

* ``uniform`` (tests/test_schedule_tune.py): 64 MiB of stashed activations per microbatch,
  spread evenly over the stages;
* ``front_loaded``: 16 layers, the first stashing 64 MiB per microbatch and every other 2 MiB
  (long inputs, a wide first layer). A pipeline's first worker keeps about P microbatches of
  its first stage in flight (1F1B: P), so a shallower pipeline in replicas stashes less there:
  a budget can admit a sharded 2D plan and no pipeline over all W at its own cap (throttled to
  one microbatch in flight, or checkpointed, such a pipeline holds less, but runs slower).

What is asserted is derived from independent plans (``plan()`` + ``predict_step_time`` /
``predict_memory`` here) or from the search costing every candidate (``top=None``), not read
back from the bounded search.
"""

from __future__ import annotations

import functools
import re

import pytest

from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule import plan
from lightning_gsched.schedule.memory import ModelSizes, StageSizes, predict_memory
from lightning_gsched.schedule.predict import predict_step_time
from lightning_gsched.schedule.runtime_costs import DEFAULT_COSTS
from lightning_gsched.schedule.tune import (
    StageProfile,
    TuneResult,
    Verdict,
    candidates,
    memory_bound,
    microbatch_counts,
    most_microbatches,
    plan_bound,
    plan_candidate,
    tune,
    work_bound,
)
from test_schedule_tune import profile as uniform

MiB = 2**20
LAYERS = 16
PIPELINES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv")  # stages over all W
SHARDED_AT_G1 = ("fsdp", "fslpp", "fslpp-seed")
# W=8 searched over fewer schedules, to keep the every-candidate reference fast
SOME = ("gpipe", "1f1b", "zb-h1", "zbv", "interleaved", "fsdp", "fslpp")


def front_loaded(S: int) -> StageProfile:
    if LAYERS % S:
        raise ScheduleConfigError(f"16 layers do not cut into {S} equal stages")
    k = LAYERS // S
    stages = []
    for s in range(S):
        weights = 100 * MiB // LAYERS * k
        acts = sum(64 * MiB if layer == 0 else 2 * MiB for layer in range(s * k, (s + 1) * k))
        stages.append(StageSizes(weights, weights, 2 * weights, acts, 1 * MiB, inputs=1 * MiB))
    return StageProfile(S, 8, (1.0 / S,) * S, (2.0 / S,) * S, ModelSizes(tuple(stages)),
                        split=((1.0 / S,) * S, (1.0 / S,) * S))


@functools.lru_cache(maxsize=None)
def every(model: str, W: int, rows: int, schedules: tuple[str, ...] | None = None
          ) -> TuneResult:
    """The search costing every candidate, without a budget: the reference."""
    return tune(W, rows, {"uniform": uniform, "front": front_loaded}[model],
                costs=DEFAULT_COSTS, schedules=schedules, top=None)


def costed(result: TuneResult) -> list[Verdict]:
    return [v for v in result.verdicts if v.step_time is not None]


@pytest.mark.parametrize("W", [4, 8])
def test_the_space_has_every_G_below_W_in_both_modes(W: int) -> None:
    rows = 16 * W
    space = candidates(W, rows)
    divisors = [G for G in range(2, W) if W % G == 0]
    assert {(c.replicas, c.mode) for c in space} == {(1, "replicate")} | {
        (G, m) for G in divisors for m in ("replicate", "shard")}
    for c in space:
        # B per replica: a step cuts W, 2W or 4W microbatches of rows / (B x G) rows each
        assert c.step_micro in (W, 2 * W, 4 * W) and c.rows * c.step_micro == rows
        if c.replicas > 1:  # ddp and fsdp are data parallel already; lpp in replicas is lpp
            assert c.schedule not in ("ddp", "fsdp", "lpp")
    # S: the schedule's default for that shape (plan()'s own) and twice it
    for name in ("1f1b", "zbv"):
        for mode in ("replicate", "shard"):
            S = plan(name, workers=W, data_parallel_size=2, data_parallel=mode).stages
            assert {c.stages for c in space if (c.schedule, c.replicas, c.mode)
                    == (name, 2, mode)} == {S, 2 * S}


def test_lpp_in_replicas_is_lpp_over_all_workers() -> None:
    """Why the search leaves lpp out at G > 1: lpp(W / G, R) in G replicas is predicted
    exactly as lpp(W, R) with G times the microbatches."""
    for W, G, R in ((4, 2, 2), (8, 2, 2), (8, 4, 2), (8, 2, 4)):
        sizes = front_loaded(8).sizes
        one = plan("lpp", workers=W, R=R, stages=8, microbatches=2 * W)
        lifted = plan("lpp", workers=W, R=R, stages=8, microbatches=2 * W // G,
                      data_parallel_size=G)
        times = [predict_step_time(p, costs=DEFAULT_COSTS, sizes=sizes).latency
                 for p in (one, lifted)]
        assert times[0] == pytest.approx(times[1], rel=1e-12)
        peaks = [sorted(m.peak for m in predict_memory(p.programs, sizes)) for p in (one, lifted)]
        assert peaks[0] == peaks[1]


def _independent(v: Verdict, W: int, model: str) -> tuple[float, int]:
    """A verdict's step time and peak from plan() + predict, with the costs and sizes
    scaled here (linearly: the profiles have no fixed share)."""
    c = v.candidate
    base = (uniform if model == "uniform" else front_loaded)(c.stages)
    f = c.rows / base.rows
    S = c.stages
    split = c.schedule in ("zb-h1", "zb-h2", "zbv")
    p = plan(c.schedule, workers=W, stages=S, microbatches=c.micro, R=c.R,
             checkpoint_activations=c.checkpoint, data_parallel_size=c.replicas,
             data_parallel=c.mode, forward_cost=[t * f for t in base.forward],
             backward_cost=[t * f for t in (base.split[0] if split else base.backward)],
             weight_cost=[t * f for t in base.split[1]] if split else None,
             **({"cap": c.cap} if c.cap is not None else {}))
    sizes = ModelSizes(tuple(
        StageSizes(st.params, st.grads, st.optimizer, int(st.activations * f),
                   int(st.message * f), inputs=int(st.inputs * f)) for st in base.sizes.stages))
    step = predict_step_time(p, costs=DEFAULT_COSTS, sizes=sizes).latency
    return step, max(m.peak for m in predict_memory(p.programs, sizes, p.checkpointed))


@pytest.mark.parametrize("W", [4, 8])
def test_2d_candidates_are_ranked_by_the_predictions_of_their_plans(W: int) -> None:
    """The search costs G > 1 candidates of both modes at every G below W; each verdict is
    what plan() and predict give for those arguments, and the ranking follows them."""
    result = every("front", W, 16 * W, schedules=None if W == 4 else SOME)
    ranked = costed(result)
    times = [v.step_time for v in ranked]
    assert times == sorted(times)
    twod = [v for v in ranked if v.candidate.replicas > 1]
    assert {(v.candidate.replicas, v.candidate.mode) for v in twod} == {
        (G, m) for G in range(2, W) if W % G == 0 for m in ("replicate", "shard")}
    sample = [next(v for v in twod if (v.candidate.replicas, v.candidate.mode) == key)
              for key in sorted({(v.candidate.replicas, v.candidate.mode) for v in twod})]
    for v in sample + [v for v in twod if v.candidate.cap is not None][:1]:
        step, peak = _independent(v, W, "front")
        assert v.step_time == pytest.approx(step, rel=1e-12) and v.peak == peak, v.candidate


@pytest.mark.parametrize(("model", "W", "budgets_mib"), [
    ("uniform", 4, (None, 250)), ("front", 4, (None, 235, 300)), ("front", 8, (None, 210))])
def test_the_bounded_search_ranks_the_top_as_costing_every_candidate(
        model: str, W: int, budgets_mib: tuple[int | None, ...]) -> None:
    """The fastest ``top`` that fit, and so the pick, are those of costing every candidate
    (under a budget: the fastest of them whose peak is within it); every bound the search
    skips by holds for the candidates costed."""
    schedules = None if W == 4 else SOME
    reference = every(model, W, 16 * W, schedules=schedules)
    profile_of = uniform if model == "uniform" else front_loaded
    for budget in (None if b is None else b * MiB for b in budgets_mib):
        bounded = tune(W, 16 * W, profile_of, budget=budget, costs=DEFAULT_COSTS,
                       schedules=schedules, top=10)
        want = [(v.candidate, v.step_time, v.peak) for v in costed(reference)
                if budget is None or (v.peak or 0) <= budget][:10]
        got = [(v.candidate, v.step_time, v.peak) for v in bounded.verdicts if v.fits][:10]
        assert len(want) == 10 and got == want, budget
        assert len(costed(bounded)) < len(costed(reference)) / 4  # what the bounds saved
        assert any(v.skipped for v in bounded.verdicts)
    for v in costed(reference)[::1 if W == 4 else 10]:
        c = v.candidate
        profile, planned = reference.profiles[c.stages], plan_candidate(
            c, reference.profiles[c.stages], W)
        assert v.step_time is not None and v.peak is not None
        assert work_bound(c, profile, W, DEFAULT_COSTS) <= v.step_time * (1 + 1e-9)
        assert plan_bound(planned, DEFAULT_COSTS) <= v.step_time * (1 + 1e-9)
        assert memory_bound(c, profile, planned) <= v.peak


@pytest.mark.parametrize("W", [4, 8])
def test_a_budget_no_pipeline_over_all_ranks_meets_picks_a_sharded_plan(W: int) -> None:
    """Below what every pipeline over all W (G = 1) needs at its own cap without
    checkpointing, but above a sharded 2D candidate's peak: the pick is a 2D plan (or
    fsdp/fslpp), the fastest of every candidate that fits. Pipelines over all W throttled to
    a smaller cap, or checkpointed, fit too (one microbatch in flight holds least of all), but
    run slower."""
    schedules = None if W == 4 else SOME
    free = every("front", W, 16 * W, schedules=schedules)
    plain = [v for v in costed(free) if v.candidate.cap is None and not v.candidate.checkpoint]
    pipelines = min(v.peak or 0 for v in plain if v.candidate.replicas == 1
                    and v.candidate.schedule in PIPELINES)
    sharded = min(v.peak or 0 for v in plain if v.candidate.mode == "shard")
    assert sharded < pipelines  # the model makes it so (module docstring)
    budget = (sharded + pipelines) // 2
    result = tune(W, 16 * W, front_loaded, budget=budget, costs=DEFAULT_COSTS,
                  schedules=schedules)
    best = result.best
    assert best is not None and best.peak is not None and best.peak <= budget
    assert best.candidate.replicas > 1 or best.candidate.schedule in SHARDED_AT_G1
    fitting = [v for v in costed(free) if v.peak is not None and v.peak <= budget]
    assert best.step_time == min(v.step_time or 0 for v in fitting)
    assert any(v.candidate.replicas == 1 and v.candidate.schedule in PIPELINES
               for v in fitting)  # throttled or checkpointed: slower
    c = best.candidate  # its table row shows G and the mode
    mode = c.mode if c.replicas > 1 else "-"
    assert re.search(rf"^\s+1\s+{re.escape(c.shape_text())}\s+{c.replicas}\s+{mode}\s",
                     result.table(), re.M)


def test_a_fixed_G_restricts_the_search() -> None:
    for G in (1, 2, 4):
        result = tune(8, 128, uniform, replicas=G, checkpoint=(False,), costs=DEFAULT_COSTS)
        assert {v.candidate.replicas for v in result.verdicts} == {G}
        assert result.best is not None and result.best.candidate.replicas == G
    # fixed, G = W is searched too (one-worker pipelines in replicas), and lpp in replicas
    space = candidates(4, 64, replicas=4)
    assert {c.replicas for c in space} == {4} and "lpp" in {c.schedule for c in space}
    with pytest.raises(ScheduleConfigError, match=r"data_parallel_size=3 does not divide.*"
                                                  r"\[1, 2, 4, 8\]"):
        candidates(8, 128, replicas=3)


def test_microbatches_are_per_replica_and_the_profile_is_of_the_smallest() -> None:
    # B per replica: W, 2W, 4W microbatches per step whatever G
    assert microbatch_counts(8, 128) == [8, 16, 32]
    assert microbatch_counts(8, 128, replicas=2) == [4, 8, 16]
    assert microbatch_counts(8, 128, replicas=4) == [2, 4, 8]
    # a global batch W does not divide: the largest step count <= W that G divides
    assert microbatch_counts(4, 6) == [3] and microbatch_counts(4, 6, replicas=2) == [1]
    # fixed B: per replica, where B x G divides the global batch
    assert microbatch_counts(8, 128, micro=8, replicas=2) == [8]
    assert microbatch_counts(8, 24, micro=8, replicas=2) == []
    # the profiled microbatch: the global batch over the most microbatches any candidate cuts
    assert most_microbatches(8, 128) == 32
    assert most_microbatches(8, 128, micro=8) == 32  # 8 per replica x G = 4
    assert most_microbatches(8, 128, micro=8, replicas=2) == 16
    for c in candidates(8, 128, micro=4):
        assert c.micro == 4 and c.rows == 128 // (4 * c.replicas)


def test_a_fixed_b_or_r_no_candidate_can_take_is_refused_naming_why() -> None:
    """``gsched tune -b 5`` with 16 rows ranked "gpipe S=4 B=5" at G = 1 (the step would cut
    unequal microbatches and fail), and ``--R 3`` at W=4 ended in "nothing fits" with no
    reason: both are refused up front, naming what would do."""
    assert microbatch_counts(4, 16, micro=5) == []  # at G = 1 too
    with pytest.raises(ScheduleConfigError, match=r"microbatches=5 does not cut the global "
                       r"batch of 16 rows.*among \[1, 2, 4, 8, 16\]"):
        candidates(4, 16, micro=5)
    with pytest.raises(ScheduleConfigError, match=r"R=3 divides no pipeline's workers.*"
                       r"among \[1, 2, 4\]"):
        candidates(4, 16, R=3)
    assert candidates(4, 16, micro=4) and candidates(4, 16, R=2)  # what does fit is kept
