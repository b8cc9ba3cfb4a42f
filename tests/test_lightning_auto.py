"""``GeneralParallel("auto", memory_budget=...)``: the strategy picks its schedule at the first batch.

* without a budget it trains like one device (weights after 3 SGD steps against a single-process
  Trainer in this test), every rank runs the same picked plan, and rank 0 prints the ranked table
  and the pick; the first build here is Lightning's sanity check (an evaluation batch), so the
  decision is made there and training, evaluation and the startup print read it;
* with a budget between the smallest and the largest peak of that search (decided in a training
  step this time), the pick's predicted peak is under it, and so is the memory report's
  prediction for the plan the run executed;
* a refused calibration (CalibrationError on every rank) falls back to the default costs, says
  so in the startup text, and trains like one device;
* an impossible budget fails the fit on every rank with the tuner's ScheduleConfigError naming
  the smallest peak (no hang);
* ``GeneralParallelFabric("auto", stages=2)`` trains like a single-device Fabric loop, every
  rank on the same pick, with S fixed as asked;
* wrong arguments fail at construction (both front ends, one place).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
import torch

from dist_harness import RankError, WorkerContext
from lightning_models import (
    as_worker,
    assert_same_state,
    make_lit_gpt,
    rank_loader,
    state_of,
    tokens,
    trainer,
)

WORLD, STEPS, GLOBAL_BATCH = 2, 3, 8
WORLD_TIMEOUT = 300.0  # seconds per check: whole Trainer fits, with the tuner's profiling


def _data() -> torch.Tensor:
    return tokens(GLOBAL_BATCH * STEPS)


@functools.lru_cache(maxsize=1)
def _reference() -> dict:
    model = make_lit_gpt()
    trainer(1, "auto", max_steps=STEPS).fit(model, rank_loader(_data(), GLOBAL_BATCH, 1, 0))
    return state_of(model)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


REFUSED = "simulated: the all-reduce bandwidth cannot be fitted"


def fit_auto(ctx: WorkerContext, validate_first: bool, refuse_calibration: bool = False,
             stall_calibration: float = 0.0, **options: Any) -> dict:
    """One 3-step fit under GeneralParallel("auto", **options); what the test compares.
    ``refuse_calibration``: the runtime's calibration raises CalibrationError on every rank
    (as it does alike on every rank when the measured figures do not fit the cost model).
    ``stall_calibration``: rank 1 enters the calibration that many seconds late (a stuck rank)."""
    import time

    from lightning_gsched import GeneralParallel
    from lightning_gsched.engine import auto
    from lightning_gsched.errors import CalibrationError

    as_worker(ctx.rank)
    calibrations: list[str] = []
    real_calibrate = auto.calibrate

    def refused(*args: Any) -> Any:
        calibrations.append("refused")
        raise CalibrationError(REFUSED)

    def late(*args: Any) -> Any:
        time.sleep(stall_calibration)
        return real_calibrate(*args)

    if refuse_calibration:
        auto.calibrate = refused
    elif stall_calibration and ctx.rank == 1:
        auto.calibrate = late
    printed = _Lines()
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(printed)
    logger.setLevel(logging.INFO)
    strategy = GeneralParallel("auto", **options)
    model = make_lit_gpt()
    loader = rank_loader(_data(), GLOBAL_BATCH, ctx.world_size, ctx.rank)
    extra: dict[str, Any] = {}
    if validate_first:  # the sanity check builds the engine in eval mode, before training
        extra = dict(num_sanity_val_steps=1, limit_val_batches=1, val_check_interval=STEPS)
    try:
        run = trainer(ctx.world_size, strategy, max_steps=STEPS, **extra)
        run.fit(model, loader, val_dataloaders=loader if validate_first else None)
    finally:
        logger.removeHandler(printed)
        auto.calibrate = real_calibrate
    config = strategy.schedule_config
    chosen = config.chosen
    plan = config.training_plan(ctx.world_size)
    result = config.tune_result
    report = strategy.memory_report
    return {
        "state": state_of(model),
        "chosen": (chosen.schedule, chosen.arguments.stages, chosen.arguments.microbatches,
                   chosen.arguments.R, chosen.arguments.checkpoint_activations,
                   list(chosen.arguments.forward_cost), chosen.arguments.data_parallel_size,
                   chosen.arguments.data_parallel),
        "programs": [[str(a) for a in program] for program in plan.programs.ranks],
        "pick_peak": result.best.peak,
        "peaks": [v.peak for v in result.verdicts if v.peak is not None],
        "fits": [(v.peak, v.fits) for v in result.verdicts if v.peak is not None],
        "reported_peak": max(m.peak for m in report.predicted) if report.predicted else None,
        "printed": "\n".join(printed.lines),
        "calibrations": calibrations,
    }


@pytest.fixture(scope="module")
def free(worlds) -> list[dict]:
    """The run without a budget (decided at the sanity check's evaluation batch)."""
    return worlds.get(WORLD).run(fit_auto, True)


@pytest.mark.distributed
def test_auto_trains_like_one_device_and_every_rank_runs_the_pick(free) -> None:
    want = _reference()
    for rank, out in enumerate(free):
        assert_same_state(out["state"], want, f"auto rank {rank}")
    assert free[0]["chosen"] == free[1]["chosen"]  # schedule, S, B, R, ckpt and the costs
    assert free[0]["programs"] == free[1]["programs"]
    schedule, S, B = free[0]["chosen"][:3]
    assert GLOBAL_BATCH % B == 0
    text = free[0]["printed"]
    assert "schedule='auto': rank 0 profiled the model" in text
    assert f"pick: {schedule} S={S} B={B}" in text
    assert f"GeneralParallel plan: {schedule} W={WORLD} S={S} B={B}" in text  # the plan run
    assert free[1]["printed"] == ""  # rank 0 prints, once


@pytest.mark.distributed
def test_budget_between_the_peaks_picks_a_plan_under_it(worlds, free) -> None:
    """A budget below the unconstrained pick's peak (above some other candidate's) binds: the
    pick fits it. Which candidates the bounded search costs follows the calibrated link, which
    a loaded machine changes, so the check is against the free run's pick, not on whether the
    budgeted search happened to size an over-budget candidate (it once sized none, with a
    second test job running beside it)."""
    peaks = sorted(free[0]["peaks"])
    free_pick = free[0]["pick_peak"]
    smaller = [peak for peak in peaks if peak < free_pick]
    budget = (smaller[-1] + free_pick) // 2 if smaller else (peaks[0] + peaks[-1]) // 2
    assert peaks[0] <= budget < peaks[-1]
    out = worlds.get(WORLD).run(fit_auto, False, memory_budget=budget)
    for rank in range(WORLD):
        pick, reported = out[rank]["pick_peak"], out[rank]["reported_peak"]
        assert pick <= budget
        # the startup prediction sizes the executed plan anew, on a microbatch of the pick's
        # rows, without the loss; the tuner scaled its profile of the smallest microbatch up
        # (over-counting what does not grow with the rows) and counted the loss: never less
        assert reported <= pick
        assert all(fits == (peak <= budget) for peak, fits in out[rank]["fits"])
        if smaller:  # the free run's pick is over this budget: the budget changed the pick
            assert pick <= budget < free_pick
    assert out[0]["chosen"] == out[1]["chosen"]
    assert out[0]["programs"] == out[1]["programs"]
    for rank in range(WORLD):  # another schedule, the same training
        assert_same_state(out[rank]["state"], _reference(), f"budgeted auto rank {rank}")


@pytest.mark.distributed
def test_a_fixed_data_parallel_size_picks_replicas_that_train_like_one_device(worlds) -> None:
    """``data_parallel_size=2`` on the 2 ranks: the tuner ranks one-worker schedules in 2
    replicas (replicated or sharded), every rank runs the pick, and it trains like one
    device (each replica's microbatches, the gradients joined across the replicas)."""
    out = worlds.get(WORLD).run(fit_auto, False, data_parallel_size=2)
    assert out[0]["chosen"] == out[1]["chosen"] and out[0]["programs"] == out[1]["programs"]
    schedule, S, B, *_, G, mode = out[0]["chosen"]
    assert G == 2 and mode in ("replicate", "shard") and GLOBAL_BATCH % (B * G) == 0
    text = out[0]["printed"]
    assert f"pick: {schedule} S={S} B={B}" in text and f"G=2 {mode}" in text
    assert f"data_parallel_size=2, data_parallel={mode!r}" in text
    for rank in range(WORLD):
        assert_same_state(out[rank]["state"], _reference(), f"auto G=2 rank {rank}")


@pytest.mark.distributed
def test_a_refused_calibration_ranks_with_the_default_costs_and_trains(worlds) -> None:
    """calibrate() raising CalibrationError (every rank alike) does not stop the run: the
    tuner ranks with DEFAULT_COSTS, the startup text says so and why, every rank runs the same
    pick, and it trains like one device."""
    out = worlds.get(WORLD).run(fit_auto, False, True)
    assert [r["calibrations"] for r in out] == [["refused"]] * WORLD  # once, on every rank
    assert out[0]["chosen"] == out[1]["chosen"] and out[0]["programs"] == out[1]["programs"]
    text = out[0]["printed"]
    assert "runtime costs (defaults):" in text
    assert (f"the runtime's costs could not be measured ({REFUSED}); the tuner ranked with "
            "the default costs (DEFAULT_COSTS)") in text
    for rank in range(WORLD):
        assert_same_state(out[rank]["state"], _reference(), f"refused calibration rank {rank}")


@pytest.mark.distributed
def test_a_stuck_rank_in_the_calibration_ends_the_job_within_step_timeout(worlds) -> None:
    """The calibration measured on the default group, whose waits end after the launcher's
    timeout (30 minutes): a rank stuck before it kept its peer waiting that long, and a lost
    peer was a bare gloo error naming neither (found by probing). Now it runs on the engine's
    group: rank 0 ends after step_timeout naming the calibration and the stuck rank."""
    results = worlds.get(WORLD).run(fit_auto, False, stall_calibration=8.0, step_timeout=3.0,
                                    expect_errors=True)
    first = results[0]
    assert isinstance(first, RankError) and first.type_name == "RuntimeFault", first
    assert ("rank 0 stopped in the runtime's cost calibration (schedule='auto'): nothing "
            "arrived within 3 s (step_timeout)") in first.message, first.message
    assert isinstance(results[1], RankError), results[1]  # its peer gone when it arrives


@pytest.mark.distributed
def test_impossible_budget_fails_every_rank_naming_the_smallest_peak(worlds) -> None:
    results = worlds.get(WORLD).run(fit_auto, False, memory_budget="1KiB", stages=2,
                                    expect_errors=True)
    for result in results:
        assert isinstance(result, RankError), result
        assert result.type_name == "ScheduleConfigError", result.traceback
        assert "smallest predicted peak" in result.message
        assert "1.0 KiB" in result.message or "1 KiB" in result.message


def fabric_auto(ctx: WorkerContext) -> dict:
    from test_fabric import global_batches, pipelined_fabric, setup, share, train

    fabric = pipelined_fabric(ctx, "auto", options={"stages": 2})
    model, optimizer = setup(fabric)
    batches = [share(b, ctx.rank, ctx.world_size) for b in global_batches()]
    losses = train(fabric, model, optimizer, batches, pipelined=True)
    fabric.strategy.finish()
    chosen = fabric.strategy.schedule_config.chosen
    return {"losses": losses, "weights": state_of(model),
            "chosen": (chosen.schedule, chosen.arguments.stages, chosen.arguments.microbatches,
                       chosen.arguments.R, list(chosen.arguments.forward_cost))}


@pytest.mark.distributed
def test_fabric_auto_trains_like_one_device(worlds) -> None:
    from test_fabric import reference

    want = reference()
    out = worlds.get(WORLD).run(fabric_auto)
    assert out[0]["chosen"] == out[1]["chosen"] and out[0]["chosen"][1] == 2
    for rank in range(WORLD):
        assert_same_state(out[rank]["weights"], want["weights"][-1], f"fabric auto rank {rank}")
        assert out[rank]["losses"] == pytest.approx(want["losses"], rel=1e-5)


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
def test_arguments_are_checked_at_construction(front_end: str) -> None:
    from lightning_gsched import GeneralParallel
    from lightning_gsched.errors import ScheduleConfigError, StrategyConfigError
    from lightning_gsched.fabric import GeneralParallelFabric

    make = GeneralParallel if front_end == "trainer" else GeneralParallelFabric
    assert make("auto", memory_budget="20GiB").schedule_config.memory_budget == 20 * 2**30
    assert make("auto", memory_budget=10**9).schedule_config.memory_budget == 10**9
    with pytest.raises(ScheduleConfigError, match="memory_budget='lots'"):
        make("auto", memory_budget="lots")
    with pytest.raises(ScheduleConfigError, match="only used by schedule='auto'"):
        make("1f1b", memory_budget="20GiB")
    for conflict in ({"order": "1f1b"}, {"cap": 2}, {"placement": lambda s, b, d: (0, 0)},
                     {"priority": lambda s, b, d: b}, {"forward_cost": 3.0},
                     {"fetch_window": 1}):
        (name,) = conflict
        with pytest.raises(ScheduleConfigError, match=f"schedule='auto' chooses.*{name}="):
            make("auto", **conflict)
    with pytest.raises(ScheduleConfigError, match="checkpoint_activations"):
        make("auto", checkpoint_activations=[True, False])
    with pytest.raises(ScheduleConfigError, match="microbatches=0"):
        make("auto", microbatches=0)
    # fixed R is checked against W at setup; before the first batch there is no plan
    config = make("auto", R=3, stages=6).schedule_config
    with pytest.raises(ScheduleConfigError, match="R=3 does not divide"):
        config.check(2)
    make("auto").schedule_config.check(2)  # nothing to check yet
    # data_parallel_size is a constraint (G fixed), checked against W at setup, R against
    # each replica's W / G; the mode is the tuner's to choose
    config = make("auto", data_parallel_size=2, R=2).schedule_config
    assert config.auto.data_parallel_size == 2
    config.check(4)
    with pytest.raises(ScheduleConfigError, match=r"data_parallel_size=2 does not divide the "
                                                  r"W=3 workers.*leave data_parallel_size"):
        config.check(3)
    with pytest.raises(ScheduleConfigError, match=r"R=2 does not divide the 3 devices of each "
                                                  r"of the data_parallel_size=2 replicas"):
        config.check(6)
    assert make("auto").schedule_config.auto.data_parallel_size is None  # 1: searched
    with pytest.raises(ScheduleConfigError, match="data_parallel='shard'.*data_parallel_size="):
        make("auto", data_parallel="shard")
    with pytest.raises(ScheduleConfigError, match="data_parallel_size=0"):
        make("auto", data_parallel_size=0)
    with pytest.raises(StrategyConfigError, match="decided at the first batch"):
        make("auto").schedule_config.training_plan(2)
    # profile_costs: a named schedule's costs measured at the build; "auto" always measures
    # them, and cost arguments would be overwritten
    assert make("zbv", profile_costs=True).schedule_config.profile_costs
    with pytest.raises(ScheduleConfigError, match="profile_costs=True.*'auto'.*drop profile"):
        make("auto", profile_costs=True)
    with pytest.raises(ScheduleConfigError, match="profile_costs=True.*weight_cost=2.0"):
        make("zbv", profile_costs=True, weight_cost=2.0)
    with pytest.raises(ScheduleConfigError, match="profile_costs='yes'"):
        make("zbv", profile_costs="yes")


def test_fixed_stages_microbatches_and_r_restrict_the_candidates() -> None:
    from lightning_gsched.schedule.library import get_schedule
    from lightning_gsched.schedule.tune import candidates

    free = candidates(4, 64)
    # B per replica: 4, 8 and 16 microbatches a step at every G
    assert {c.stages for c in free} > {4} and {c.step_micro for c in free} == {4, 8, 16}
    assert {c.replicas for c in free} == {1, 2}
    fixed = candidates(4, 64, stages=4, micro=8)
    assert fixed and {(c.stages, c.micro) for c in fixed} == {(4, 8)}
    assert {c.schedule for c in fixed} == {c.schedule for c in free}
    looped = candidates(4, 64, R=2)
    assert looped and {c.R for c in looped} == {2}
    assert all(get_schedule(c.schedule).default_R is not None for c in looped)
    assert [c for c in candidates(4, 64, checkpoint=(True,)) if not c.checkpoint] == []
    pairs = candidates(8, 128, replicas=2, stages=4)
    assert pairs and {(c.replicas, c.stages) for c in pairs} == {(2, 4)}


def test_a_capped_pick_runs_with_its_cap() -> None:
    """A pick the tuner found at a smaller activation cap becomes a config whose training plan
    has that cap on every worker (and so the programs the tuner costed)."""
    from lightning_gsched.engine.auto import pick_as_config
    from lightning_gsched.schedule.memory import ModelSizes, StageSizes
    from lightning_gsched.schedule.tune import StageProfile, tune

    def profile(S: int) -> StageProfile:
        stage = StageSizes(100, 100, 200, 1000, 10)
        return StageProfile(S, 4, (1.0,) * S, (2.0,) * S, ModelSizes((stage,) * S))

    result = tune(2, 16, profile, schedules=["gpipe"], checkpoint=(False,), stages=2, micro=8)
    capped = next(v for v in result.verdicts if v.candidate.cap is not None)
    p = pick_as_config(capped, result).training_plan(2)
    assert p.caps == [capped.candidate.cap] * 2
    assert p.metrics.max_of("peak_activations") <= capped.candidate.cap < 8


def test_a_2d_pick_runs_as_the_plan_the_tuner_costed() -> None:
    """A pick with G = 2 becomes a config whose training plan is the tuner's plan of it (the
    same programs: G, the mode and the costs carried over) and whose training step cuts
    B x G microbatches."""
    from lightning_gsched.engine.auto import pick_as_config
    from lightning_gsched.schedule.memory import ModelSizes, StageSizes
    from lightning_gsched.schedule.tune import StageProfile, plan_candidate, tune

    def profile(S: int) -> StageProfile:
        stage = StageSizes(100, 100, 200, 1000, 10)
        return StageProfile(S, 4, (1.0,) * S, (2.0,) * S, ModelSizes((stage,) * S))

    for mode_wanted in ("replicate", "shard"):
        result = tune(4, 32, profile, replicas=2, schedules=["1f1b", "zbv"], top=None)
        v = next(v for v in result.verdicts if v.candidate.mode == mode_wanted
                 and v.step_time is not None)
        config = pick_as_config(v, result)
        assert config.arguments.data_parallel_size == 2
        assert config.arguments.data_parallel == mode_wanted
        planned = config.training_plan(4)
        tuned = plan_candidate(v.candidate, result.profiles[v.candidate.stages], 4)
        assert [[str(a) for a in p] for p in planned.programs.ranks] == \
            [[str(a) for a in p] for p in tuned.programs.ranks]
        assert config.training_micro(4) == v.candidate.micro * 2 == v.candidate.step_micro
