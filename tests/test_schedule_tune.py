"""The tuner's search (schedule/tune.py) on a synthetic model: ranking, budget, checkpointing.

The model: S equal stages of a network with forward 1.0 s, backward 2.0 s (B and W 1.0 each when
split), 100 MiB of weights and 64 MiB of stashed activations per microbatch of 8 rows in all,
measured at 8 rows per microbatch. Everything asserted is derived here from those numbers or
from independent plans, not read back from the tuner.
"""

from __future__ import annotations

import functools

import pytest

from lightning_gsched.errors import GschedError, ScheduleConfigError
from lightning_gsched.schedule import plan
from lightning_gsched.schedule.memory import ModelSizes, StageSizes, predict_memory
from lightning_gsched.schedule.runtime_costs import RuntimeCosts
from lightning_gsched.schedule.tune import Candidate, StageProfile, TuneResult, evaluate, tune

MiB = 2**20
W, GLOBAL_ROWS = 4, 64


def profile(S: int) -> StageProfile:
    if S > 16:
        raise ScheduleConfigError(f"cannot cut {S} stages")
    weights, acts = 100 * MiB // S, 64 * MiB // S
    stage = StageSizes(weights, weights, 2 * weights, acts, 1 * MiB, inputs=1 * MiB)
    return StageProfile(S, 8, (1.0 / S,) * S, (2.0 / S,) * S, ModelSizes((stage,) * S),
                        split=((1.0 / S,) * S, (1.0 / S,) * S))


@functools.lru_cache(maxsize=1)
def exhaustive() -> TuneResult:
    """Every candidate costed, no budget (top=None): the reference the bounded search meets."""
    return tune(W, GLOBAL_ROWS, profile, top=None)


def test_ranked_by_predicted_step_time_and_everything_fits_without_budget() -> None:
    result = exhaustive()
    times = [v.step_time for v in result.verdicts if v.step_time is not None]
    assert times == sorted(times) and len(times) > 20
    assert all(v.fits for v in result.verdicts if v.step_time is not None)
    assert result.best is result.verdicts[0]
    # every library schedule was costed, and the pipelines with G = 2 replicas, both modes
    assert {v.candidate.schedule for v in result.verdicts if v.step_time is not None} >= {
        "ddp", "fsdp", "gpipe", "1f1b", "lpp", "interleaved", "fslpp", "zb-h1", "zbv"}
    assert {(v.candidate.replicas, v.candidate.mode) for v in result.verdicts
            if v.step_time is not None} == {(1, "replicate"), (2, "replicate"), (2, "shard")}


def test_a_verdict_is_the_plan_it_names() -> None:
    """The pick's peak equals the bytes model of an independently built plan."""
    best = tune(W, GLOBAL_ROWS, profile).best
    assert best is not None
    c = best.candidate
    p = plan(c.schedule, workers=W, stages=c.stages, microbatches=c.micro, R=c.R,
             checkpoint_activations=c.checkpoint, **({"cap": c.cap} if c.cap else {}))
    rows = GLOBAL_ROWS // c.micro
    f = rows / 8
    st = profile(c.stages).sizes.stages[0]
    scaled = StageSizes(st.params, st.grads, st.optimizer, int(st.activations * f),
                        int(st.message * f), inputs=int(st.inputs * f))
    want = max(m.peak for m in predict_memory(p.programs, ModelSizes((scaled,) * c.stages),
                                              p.checkpointed))
    assert best.peak == want


def test_budget_picks_the_fastest_that_fits() -> None:
    free = exhaustive()
    peaks = sorted(v.peak for v in free.verdicts if v.peak is not None)
    budget = (peaks[0] + peaks[-1]) // 2
    result = tune(W, GLOBAL_ROWS, profile, budget=budget)
    best = result.best
    assert best is not None and best.peak is not None and best.peak <= budget
    # over the budget: sized (peak known) or skipped by its bytes bound, never "fits"
    over = [v for v in result.verdicts if v.peak is not None and v.peak > budget]
    assert over and all(not v.fits and "budget" in v.reason for v in over)
    assert all(not v.fits for v in result.verdicts if v.peak is None)
    fitting = [v.step_time for v in free.verdicts if v.peak is not None and v.peak <= budget]
    assert best.step_time == min(fitting)  # the fastest of every candidate that fits
    assert best.step_time >= free.verdicts[0].step_time  # type: ignore[operator]


def test_impossible_budget_names_the_smallest_peak() -> None:
    """The bounded search, finding nothing under the budget, still finds the smallest peak of
    every candidate (costing every one: top=None)."""
    free = exhaustive()
    smallest = min(v.peak for v in free.verdicts if v.peak is not None)
    with pytest.raises(ScheduleConfigError, match="smallest predicted peak") as info:
        tune(W, GLOBAL_ROWS, profile, budget=smallest - 1)
    from lightning_gsched.schedule.describe import byte_text

    assert byte_text(smallest) in str(info.value)


def test_checkpointing_trades_time_for_activation_bytes() -> None:
    base = Candidate("gpipe", W, 2 * W, None, False, GLOBAL_ROWS // (2 * W))
    ckpt = Candidate("gpipe", W, 2 * W, None, True, GLOBAL_ROWS // (2 * W))
    plain = evaluate(base, profile(W), W, RuntimeCosts(), None)
    saved = evaluate(ckpt, profile(W), W, RuntimeCosts(), None)
    assert saved.peak < plain.peak  # type: ignore[operator]
    assert saved.step_time > plain.step_time  # type: ignore[operator]


def test_stage_counts_the_model_cannot_reach_are_dropped_with_the_reason() -> None:
    def shallow(S: int) -> StageProfile:
        if S > 4:
            raise ScheduleConfigError(f"the model has 4 blocks, not {S}")
        return profile(S)

    result = tune(W, GLOBAL_ROWS, shallow, top=None)
    dropped = [v for v in result.verdicts if v.step_time is None]
    assert dropped and all(v.candidate.stages > 4 or "invalid" in v.reason for v in dropped)
    assert any("4 blocks" in v.reason for v in dropped)
    assert "dropped before costing" in result.table()


def test_table_names_the_pick() -> None:
    result = tune(2, 16, profile, budget=400 * MiB)
    text = result.table()
    assert result.best is not None
    assert f"pick: {result.best.candidate.text()}" in text
    assert "budget 400.0 MiB" in text or "budget 400 MiB" in text


def test_error_type_is_a_gsched_error() -> None:
    with pytest.raises(GschedError):
        tune(W, GLOBAL_ROWS, profile, budget=1)


def test_smaller_caps_are_searched_and_trade_bubble_for_activations() -> None:
    """gpipe stashes all B microbatches; the capped candidates are plans with that uniform cap
    (built here independently) whose peak stash is at most the cap, and no two verdicts of one
    configuration share their programs."""
    result = tune(W, GLOBAL_ROWS, profile, schedules=["gpipe"], checkpoint=(False,), micro=16,
                  replicas=1, top=None)
    costed = [v for v in result.verdicts if v.step_time is not None]
    default = [v for v in costed if v.candidate.cap is None]
    capped = [v for v in costed if v.candidate.cap is not None]
    assert len(default) == 2 and capped  # S = W and 2W at the default cap, then smaller caps
    for v in capped:
        c = v.candidate
        p = plan("gpipe", workers=W, stages=c.stages, microbatches=16, cap=c.cap)
        uncapped = plan("gpipe", workers=W, stages=c.stages, microbatches=16)
        assert p.metrics.max_of("peak_activations") <= c.cap
        assert c.cap < uncapped.metrics.max_of("peak_activations") == 16 * (c.stages // W)
        assert p.programs.ranks != uncapped.programs.ranks
        base = next(d for d in default if d.candidate.stages == c.stages)
        assert v.peak is not None and base.peak is not None and v.peak < base.peak
    assert "cap=" in result.table(50)


def test_runtime_costs_rank_many_small_jobs_below_fewer_larger_ones() -> None:
    """With a per-job cost the same configuration at more microbatches is predicted slower by
    at least that cost times the extra jobs on the busiest worker; without it, not."""
    free = RuntimeCosts()
    busy = RuntimeCosts(job_cpu=0.05)
    few, many = (Candidate("ddp", 1, b, None, False, GLOBAL_ROWS // b) for b in (W, 4 * W))
    t = {(c.micro, k): evaluate(c, profile(1), W, costs, None).step_time
         for c in (few, many) for k, costs in (("free", free), ("busy", busy))}
    assert t[(4 * W, "free")] == pytest.approx(t[(W, "free")])  # same compute, split finer
    # ddp: every worker runs F and B of B/W microbatches: 2 jobs vs 8 jobs per worker
    assert t[(4 * W, "busy")] - t[(W, "busy")] == pytest.approx((8 - 2) * 0.05)


def test_compute_keeps_its_fixed_share_when_the_microbatch_shrinks() -> None:
    import dataclasses

    from lightning_gsched.schedule.tune import candidate_costs

    base = profile(2)  # 8 rows: forward 0.5 s, backward 1.0 s per stage
    half = Candidate("gpipe", 2, 8, None, False, rows=4)  # half the profile's rows
    # linear: every second scales with the rows
    assert candidate_costs(half, base)[:2] == ([0.25, 0.25], [0.5, 0.5])
    fixed = dataclasses.replace(base, fixed_share=((0.2, 0.2), (0.5, 0.0)))
    forward, backward, weight = candidate_costs(half, fixed)
    # forward: 0.5 * (0.2 + 0.8 / 2); backward: stage 0 half fixed, stage 1 all per row
    assert forward == pytest.approx([0.3, 0.3]) and backward == pytest.approx([0.75, 0.5])
    assert weight is None
    # a split-backward schedule scales B and W with the backward's share
    zb = Candidate("zb-h1", 2, 8, None, False, rows=4)
    _, b, w = candidate_costs(zb, fixed)
    assert b == pytest.approx([0.375, 0.25]) and w == pytest.approx([0.375, 0.25])
