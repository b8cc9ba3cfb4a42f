"""Bad input is refused where it is typed, with a GschedError naming the argument (issue 11).

Covers every entry point a user types arguments into: ``plan()``, ``GeneralParallel(...)``
(construction only: no Trainer, no processes), the ``gsched`` CLI, ``partition()`` and
``profile_stages()``; plus failures inside user callables (placement, priority, cap) and an
example input that does not fit the model. Each case checks the exception type and that the
message names the argument (or callable, or unit) and the bad value.
"""

from __future__ import annotations

import math

import pytest
import torch

import models
from lightning_gsched.errors import (
    GschedError,
    PartitionError,
    PlacementError,
    ScheduleConfigError,
    StrategyConfigError,
    UnknownScheduleError,
    UserCallableError,
)
from lightning_gsched.measure import profile_stages
from lightning_gsched.partition import (
    BalanceError,
    ExampleInputError,
    UnknownNameError,
    partition,
)
from lightning_gsched.schedule import Phase, plan

# ----------------------------------------------------------------------------- plan()

PLAN_CASES = [
    (dict(workers=0), "workers=0"),
    (dict(workers=True), "workers=True"),
    (dict(microbatches=0), "microbatches=0"),
    (dict(microbatches=2.5), "microbatches=2.5"),
    (dict(stages=0), "stages=0"),
    (dict(R=0), "R=0"),
    (dict(R="2"), "R='2'"),
    (dict(forward_cost=math.inf), "forward_cost=inf"),
    (dict(forward_cost=math.nan), "forward_cost=nan"),
    (dict(forward_cost=0), "forward_cost=0"),
    (dict(backward_cost=-1), "backward_cost=-1"),
    (dict(forward_cost="1"), "forward_cost='1'"),
    (dict(forward_cost=[]), "forward_cost has 0 values"),
    (dict(forward_cost=[1, math.inf, 1, 1]), "forward_cost[1]=inf"),
    (dict(stages=4, forward_cost=[1, 2]), "forward_cost has 2 values but needs S=4"),
    (dict(cap="lots"), "cap='lots'"),
    (dict(cap=0), "cap=0"),
    (dict(cap=2.5), "cap=2.5"),
    (dict(cap=[1, "x"]), "cap for worker 1 is 'x'"),
    (dict(order="random"), "order='random'"),
    (dict(order=3), "order=3"),
    (dict(schedule=None), "schedule=None"),
    (dict(schedule=3), "schedule=3"),
    (dict(placement=3, stages=2, microbatches=2), "placement=3"),
    (dict(priority="x"), "priority='x'"),
    (dict(order="bfs", priority=lambda s, b, d: 0), "order='bfs' and priority="),
    (dict(edges=[(0,)]), "edges entry (0,)"),
    (dict(edges=5), "edges=5"),
    (dict(verify="yes"), "verify='yes'"),
    (dict(forward_only=1), "forward_only=1"),
    (dict(checkpoint_activations=1), "checkpoint_activations=1"),
    (dict(checkpoint_activations="yes"), "checkpoint_activations='yes'"),
    (dict(checkpoint_activations=[True, 0, True, True]), "checkpoint_activations[1]=0"),
    (dict(checkpoint_activations=[]), "checkpoint_activations has 0 values"),
    (dict(checkpoint_activations=[True, False]),
     "checkpoint_activations has 2 values but needs S=4"),
    (dict(fetch_window=0), "fetch_window=0"),
    (dict(fetch_window=1.5), "fetch_window=1.5"),
]


@pytest.mark.parametrize("kwargs, names", PLAN_CASES, ids=[c[1] for c in PLAN_CASES])
def test_plan_refuses_bad_arguments_at_entry(kwargs: dict, names: str) -> None:
    arguments = {"schedule": "gpipe", "workers": 4, **kwargs}
    with pytest.raises(ScheduleConfigError) as info:
        plan(**arguments)
    assert names in str(info.value)
    assert "e.g." in str(info.value) or "give" in str(info.value)  # a valid value or the fix


def test_plan_accepts_the_cap_word_none_and_numpy_free_ints() -> None:
    uncapped = plan("1f1b", workers=4, cap="none")
    assert uncapped.caps == [None] * 4
    assert plan("1f1b", workers=4, cap=None).caps == uncapped.caps


def test_unknown_schedule_still_suggests_close_names() -> None:
    with pytest.raises(UnknownScheduleError, match="did you mean 'fslpp'"):
        plan("fslp", workers=4)


# ----------------------------------------------------------------------------- user callables


def _boom(s: int, b: int, d: Phase) -> tuple[int, int]:
    if b == 1:
        return (0, 1 // 0)
    return (0, 0)


def _bad_priority(s: int, b: int, d: Phase) -> float:
    return 1 / (s - 1)


@pytest.mark.parametrize("kwargs, expected", [
    (dict(placement=_boom), "the placement callable _boom(s=0, b=1, d=F) raised ZeroDivisionError"),
    (dict(placement=lambda s, b, d: (0, 0), priority=_bad_priority),
     "the priority callable _bad_priority(s=1, b=0, d=F) raised ZeroDivisionError"),
    (dict(placement=lambda s, b, d: (0, 0), order=_bad_priority),
     "the priority callable _bad_priority(s=1, b=0, d=F) raised ZeroDivisionError"),
    (dict(placement=lambda s, b, d: (0, 0), cap=lambda w: [][w]),
     "the cap callable <lambda>(w=0) raised IndexError"),
], ids=["placement", "priority", "order-callable", "cap-callable"])
def test_a_failing_user_callable_is_named_with_its_arguments(kwargs: dict, expected: str) -> None:
    with pytest.raises(UserCallableError) as info:
        plan(workers=2, stages=2, microbatches=2, **kwargs)
    assert expected in str(info.value)
    assert isinstance(info.value.__cause__, (ZeroDivisionError, IndexError))


def test_a_placement_returning_garbage_is_still_a_placement_error() -> None:
    with pytest.raises(PlacementError, match="must return a pair"):
        plan(placement=lambda s, b, d: 3, workers=2, stages=2, microbatches=2)


def test_a_gsched_error_raised_by_a_callable_is_kept() -> None:
    def strict(s: int, b: int, d: Phase) -> tuple[int, int]:
        raise PlacementError("my placement refuses b=0")

    with pytest.raises(PlacementError, match="my placement refuses b=0"):
        plan(placement=strict, workers=2, stages=2, microbatches=2)


# ----------------------------------------------------------------------------- GeneralParallel

STRATEGY_CASES = [
    (dict(microbatches=0), ScheduleConfigError, "microbatches=0"),
    (dict(microbatches=2.5), ScheduleConfigError, "microbatches=2.5"),
    (dict(R=0), ScheduleConfigError, "R=0"),
    (dict(R="2"), ScheduleConfigError, "R='2'"),
    (dict(schedule="gpipe", R=2), ScheduleConfigError, "gpipe has no R parameter"),
    (dict(stages=-1), ScheduleConfigError, "stages=-1"),
    (dict(order="random"), ScheduleConfigError, "order='random'"),
    (dict(cap="lots"), ScheduleConfigError, "cap='lots'"),
    (dict(cap=[2, 0]), ScheduleConfigError, "cap for worker 1 is 0"),
    (dict(forward_cost=-1), ScheduleConfigError, "forward_cost=-1"),
    (dict(backward_cost=math.inf), ScheduleConfigError, "backward_cost=inf"),
    (dict(stages=3, forward_cost=[1, 2]), ScheduleConfigError, "forward_cost has 2 values"),
    (dict(placement=3, stages=2, microbatches=2), ScheduleConfigError, "placement=3"),
    (dict(placement=lambda s, b, d: (0, 0)), ScheduleConfigError,
     "explicit stages= and microbatches="),
    (dict(schedule=None), ScheduleConfigError, "schedule=None"),
    (dict(balance="flops"), BalanceError, "balance='flops'"),
    (dict(balance=[2, 0]), BalanceError, "balance[1]=0"),
    (dict(balance=5), BalanceError, "balance=5"),
    (dict(stages=2, balance=[1, 2, 3]), BalanceError, "balance=[1, 2, 3] has 3 entries"),
    (dict(split_points=5), BalanceError, "split_points=5"),
    (dict(stages=3, split_points=["blocks.1"]), BalanceError, "split_points has 1 names"),
    (dict(balance=[1, 1], split_points=["a"]), BalanceError, "not both"),
    (dict(leaf_modules=[3]), UnknownNameError, "leaf_modules entry 3"),
    (dict(static_shapes="yes"), PartitionError, "static_shapes='yes'"),
    (dict(step_timeout=-1), StrategyConfigError, "step_timeout=-1"),
    (dict(step_timeout=math.inf), StrategyConfigError, "step_timeout=inf"),
    (dict(step_timeout="60"), StrategyConfigError, "step_timeout='60'"),
    (dict(state_dict_type="zip"), StrategyConfigError, "state_dict_type='zip'"),
    (dict(transport="fast"), StrategyConfigError, "transport='fast'"),
    (dict(gather_on_teardown=1), StrategyConfigError, "gather_on_teardown=1"),
    (dict(stream_checkpoint="yes"), StrategyConfigError, "stream_checkpoint='yes'"),
    (dict(start_method="thread"), StrategyConfigError, "start_method='thread'"),
    (dict(timeout=30), StrategyConfigError, "timeout=30"),
    (dict(process_group_backend=1), StrategyConfigError, "process_group_backend=1"),
    (dict(checkpoint_activations="all"), ScheduleConfigError, "checkpoint_activations='all'"),
    (dict(checkpoint_activations=[True, None]), ScheduleConfigError,
     "checkpoint_activations[1]=None"),
    (dict(stages=3, checkpoint_activations=[True, False]), ScheduleConfigError,
     "checkpoint_activations has 2 values but needs S=3"),
    (dict(fetch_window=0), ScheduleConfigError, "fetch_window=0"),
]


@pytest.mark.parametrize("kwargs, error, names", STRATEGY_CASES,
                         ids=[c[2] for c in STRATEGY_CASES])
def test_general_parallel_refuses_bad_arguments_at_construction(kwargs: dict, error: type,
                                                                names: str) -> None:
    from lightning_gsched import GeneralParallel

    with pytest.raises(error) as info:
        GeneralParallel(**kwargs)
    assert isinstance(info.value, GschedError)
    assert names in str(info.value)


@pytest.mark.parametrize("kwargs", [
    dict(), dict(cap="auto"), dict(cap="none"), dict(cap=3), dict(cap=[2, 2]),
    dict(schedule="ddp", R=1), dict(stages=2, balance=[3, 4]), dict(balance="time"),
    dict(split_points="blocks.1", stages=2), dict(forward_cost=[1.0, 2.0, 3.0]),
    dict(checkpoint_activations=True), dict(checkpoint_activations=[False, True, True]),
    dict(schedule="fsdp", fetch_window=1),
    dict(schedule="mine", placement=lambda s, b, d: (0, 0), priority=lambda s, b, d: 0,
         stages=2, microbatches=2),
])
def test_general_parallel_accepts_valid_arguments(kwargs: dict) -> None:
    from lightning_gsched import GeneralParallel

    GeneralParallel(**kwargs)


def test_a_single_leaf_module_name_is_one_name_not_its_letters() -> None:
    from lightning_gsched import GeneralParallel

    assert GeneralParallel(leaf_modules="Block").partition_options.leaf_modules == ("Block",)


def test_what_needs_the_device_count_fails_at_setup_with_a_clear_error() -> None:
    """The training plan is built at setup on every rank; no processes are needed to check it."""
    from lightning_gsched import GeneralParallel

    with pytest.raises(ScheduleConfigError, match=r"R=3 does not divide the 2 devices"):
        GeneralParallel("fslpp", R=3).schedule_config.training_plan(2)
    with pytest.raises(ScheduleConfigError, match=r"cap list has 3 entries but there are W=2"):
        GeneralParallel("1f1b", cap=[2, 2, 2]).schedule_config.training_plan(2)
    # setup's own check (no plan built): the cap list's length too (it failed at the build)
    with pytest.raises(ScheduleConfigError, match=r"cap list has 3 entries but there are W=2"):
        GeneralParallel("1f1b", cap=[2, 2, 2]).schedule_config.check(2)
    with pytest.raises(ScheduleConfigError, match=r"forward_cost has 3 values but needs S=2"):
        GeneralParallel("gpipe", forward_cost=[1, 1, 1]).schedule_config.training_plan(2)
    with pytest.raises(ScheduleConfigError,
                       match=r"checkpoint_activations has 3 values but needs S=2"):
        GeneralParallel("1f1b", checkpoint_activations=[True] * 3).schedule_config.training_plan(2)
    failing = GeneralParallel(placement=_boom, stages=2, microbatches=2)
    with pytest.raises(UserCallableError, match=r"placement callable _boom\(s=0, b=1, d=F\)"):
        failing.schedule_config.training_plan(2)


def test_device_mesh_before_setup_says_when_it_exists() -> None:
    """``trainer.strategy.device_mesh`` / ``fabric.strategy.device_mesh`` read too early: a
    StrategyConfigError naming when the mesh is made (set-up, or the first batch for "auto"),
    not Lightning's RuntimeError or an AttributeError."""
    from lightning_gsched import GeneralParallel
    from lightning_gsched.fabric import GeneralParallelFabric

    for strategy in (GeneralParallel("1f1b", data_parallel_size=2), GeneralParallelFabric("auto")):
        with pytest.raises(StrategyConfigError, match=r"device_mesh is made once the processes "
                                                      r"have started.*schedule='auto'"):
            strategy.device_mesh  # noqa: B018  # the property's refusal is the point


# ----------------------------------------------------------------------------- CLI

CLI_CASES = [
    (["compare", "-w", "0"], "-w/--workers", "workers=0"),
    (["compare", "-w", "four"], "-w/--workers", "workers='four'"),
    (["plan", "gpipe", "-w", "2", "-b", "2.5"], "-b/--microbatches", "microbatches='2.5'"),
    (["plan", "gpipe", "-w", "2", "-s", "0"], "-s/--stages", "stages=0"),
    (["plan", "lpp", "-w", "4", "--R", "-2"], "--R", "R=-2"),
    (["plan", "gpipe", "-w", "2", "--forward-cost", "inf"], "--forward-cost", "forward_cost=inf"),
    (["plan", "gpipe", "-w", "2", "--backward-cost", "1,x"], "--backward-cost", "'1,x'"),
    (["plan", "gpipe", "-w", "2", "--cap", "0"], "--cap", "cap=0"),
    (["plan", "fsdp", "-w", "2", "--fetch-window", "0"], "--fetch-window", "fetch_window=0"),
    (["plan", "fsdp", "-w", "2", "--stage-bytes", "1,x"], "--stage-bytes", "'1,x'"),
    (["plan", "fsdp", "-w", "2", "--stage-bytes", "1,-2"], "--stage-bytes", "[1, -2]"),
    (["compare", "-w", "2", "--forward-cost", "0"], "--forward-cost", "forward_cost=0"),
]


@pytest.mark.parametrize("argv, option, value", CLI_CASES, ids=[" ".join(c[0]) for c in CLI_CASES])
def test_cli_refuses_bad_numbers_like_argparse(argv: list[str], option: str, value: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_gsched.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    error_line = captured.err.strip().splitlines()[-1]
    assert f"argument {option}: " in error_line and value in error_line
    assert "Traceback" not in captured.err and captured.out == ""


def test_cli_plan_error_is_one_line_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_gsched.cli import main

    assert main(["plan", "gpipe", "-w", "2", "--forward-cost", "1,2,3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gsched: error: forward_cost has 3 values")


def test_cli_png_creates_missing_parent_folders(tmp_path, capsys) -> None:
    from lightning_gsched.cli import main

    target = tmp_path / "missing" / "dir" / "x.png"
    assert main(["plan", "gpipe", "-w", "2", "-b", "2", "--png", str(target)]) == 0
    assert target.read_bytes()[:4] == b"\x89PNG"


def test_cli_png_unwritable_path_is_a_clear_error(tmp_path, capsys) -> None:
    from lightning_gsched.cli import main

    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    assert main(["plan", "gpipe", "-w", "2", "-b", "2", "--png", str(blocker / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gsched: error: --png ") and "Traceback" not in err


# ----------------------------------------------------------------------------- partition()


def test_example_that_does_not_fit_names_unit_module_and_torch_message() -> None:
    with pytest.raises(ExampleInputError) as info:
        partition(models.make_mlp(), 2, (torch.randn(4, 3),))
    message = str(info.value)
    assert isinstance(info.value, PartitionError)
    assert "does not fit MLP" in message and "layers_0 = layers.0(...)" in message
    assert "module 'layers.0' (Linear)" in message
    assert "mat1 and mat2 shapes cannot be multiplied" in message  # torch's own message
    assert "Tensor(4, 3) float32" in message
    assert "example_args must be one call of forward" in message
    assert isinstance(info.value.__cause__, RuntimeError)


def test_example_with_the_wrong_dtype_names_the_embedding_even_when_profiling() -> None:
    with pytest.raises(ExampleInputError, match=r"wte = wte\(\.\.\.\) in module 'wte' \(Embedding\)"):
        partition(models.make_gpt(), 2, (torch.randn(2, 8),), balance="time")


PARTITION_CASES = [
    (dict(num_stages=2.5), BalanceError, "num_stages=2.5"),
    (dict(num_stages=0), BalanceError, "num_stages=0"),
    (dict(balance=[1]), BalanceError, "balance=[1] has 1 entries but num_stages=2"),
    (dict(balance=[3, -1]), BalanceError, "balance[1]=-1"),
    (dict(balance="flops"), BalanceError, "balance='flops'"),
    (dict(split_points=3), BalanceError, "split_points=3"),
    (dict(split_points=["a", "b"]), BalanceError, "split_points has 2 names"),
    (dict(unit_costs=[math.inf]), BalanceError, "unit_costs[0]=inf"),
    (dict(unit_costs="cheap"), BalanceError, "unit_costs must be"),
    (dict(balance_tolerance=-1), BalanceError, "balance_tolerance=-1"),
    (dict(auto_leaf="no"), PartitionError, "auto_leaf='no'"),
    (dict(static_shapes=1), PartitionError, "static_shapes=1"),
    (dict(leaf_modules=[3.0]), UnknownNameError, "leaf_modules entry 3.0"),
    (dict(example_args={"x": 1}), PartitionError, "example_kwargs"),
    (dict(example_args=5), PartitionError, "example_args=5"),
    (dict(example_kwargs=[1]), PartitionError, "example_kwargs=[1]"),
    (dict(module="model"), PartitionError, "module=str"),
]


@pytest.mark.parametrize("kwargs, error, names", PARTITION_CASES,
                         ids=[c[2] for c in PARTITION_CASES])
def test_partition_refuses_bad_arguments_before_tracing(kwargs: dict, error: type,
                                                        names: str) -> None:
    # an untraceable model: the argument check must come first, not a TraceFailedError
    arguments = {"module": models.DataDependentModel(), "num_stages": 2,
                 "example_args": (torch.randn(2, 8),), **kwargs}
    with pytest.raises(error) as info:
        partition(**arguments)
    assert names in str(info.value)


def test_partition_takes_a_single_leaf_module_name() -> None:
    part = partition(models.make_mlp(), 2, models.mlp_inputs(), leaf_modules="layers.1")
    assert "layers_1" in part.unit_names


def test_profile_stages_names_the_stage_and_unit_that_failed() -> None:
    part = partition(models.make_mlp(), 3, models.mlp_inputs())
    with pytest.raises(ExampleInputError) as info:
        profile_stages(part.stages, (torch.randn(4, 3),), repeats=1, warmup=0)
    message = str(info.value)
    assert "stage 0 of 3" in message and "layers_0 = " in message and "mat1 and mat2" in message


def test_profile_stages_names_a_failing_loss_fn() -> None:
    part = partition(models.make_mlp(), 2, models.mlp_inputs())
    with pytest.raises(PartitionError, match=r"loss_fn raised ZeroDivisionError"):
        profile_stages(part.stages, models.mlp_inputs(), loss_fn=lambda out: 1 / 0, repeats=1,
                       warmup=0)
