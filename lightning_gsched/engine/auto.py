"""``schedule="auto"``: the tuner picks the schedule at the first batch, on rank 0, for every rank.

Why at the first batch: the tuner (``measure.tune_profile.tune_model``) profiles the model cut
into each stage count it considers, on one real microbatch, and the engine has the model's call
on a real microbatch only when it builds the pipeline (the probe of the user's step). This module
runs the tuner there and turns the pick into an ordinary :class:`ScheduleConfig` (schedule, G
and the data-parallel mode, S, B, R, cap, checkpointing, and the measured per-stage seconds as
its costs, so that the programs the run executes are the ones the tuner evaluated); from then on
the engine continues exactly as if the user had written those arguments.

Why rank 0 decides alone: profiled seconds differ between ranks and between runs, so ranks tuning
on their own could pick different plans and then wait for messages that never come. Rank 0
tunes and one broadcast hands every rank the same pick, or the same error: an impossible budget
fails every rank with the tuner's ``ScheduleConfigError`` (it names the smallest peak any
candidate reaches), never a hang.

The loss the tuner times and sizes on the last stage: in a training step, the user's own step
finished with the last stage's output (as the pipeline does it, its ``self.log`` calls dropped);
when the first batch is an evaluation batch (Lightning's sanity check), the sum of the output.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from lightning_gsched.engine.config import AutoRequest, ScheduleConfig
from lightning_gsched.engine.control import Collective
from lightning_gsched.engine.intercept import StepCaller, step_loss
from lightning_gsched.engine.memory_report import optimizer_bytes_factor
from lightning_gsched.engine.mesh import first_worker_mesh
from lightning_gsched.engine.options import PartitionOptions
from lightning_gsched.engine.profiled_costs import profiling
from lightning_gsched.engine.rank_zero import RankZeroFailure, decided_by_rank_zero
from lightning_gsched.errors import (
    CalibrationError,
    GschedError,
    ScheduleConfigError,
    StrategyConfigError,
)
from lightning_gsched.measure.build_passes import BuildPasses
from lightning_gsched.measure.tune_profile import (
    ShardStages,
    follow_tuning,
    sharded_while_measured,
    tune_model,
)
from lightning_gsched.partition.compiled import compiled_modules
from lightning_gsched.partition.tensor_parallel import TensorParallelPlan
from lightning_gsched.runtime import calibrate
from lightning_gsched.schedule.describe import byte_text
from lightning_gsched.schedule.library import LIBRARY
from lightning_gsched.schedule.runtime_costs import DEFAULT_COSTS, RuntimeCosts
from lightning_gsched.schedule.tune import (
    TuneResult,
    Verdict,
    candidate_arguments,
    most_microbatches,
)

TABLE_ROWS = 10  # rows of the ranked table in the startup text


def probe_parts(config: ScheduleConfig, global_rows: int, workers: int) -> int:
    """How many microbatches the tuner's probe cuts the global batch into (rank order): the
    engine profiles the first of them, every rank receiving its rows.

    The profiled microbatch is the smallest any candidate runs (the global batch cut into the
    most microbatches, B per replica x G replicas, the search tries: ``most_microbatches``).
    Scaling a profile up to larger microbatches is linear, so what does not grow with the rows
    (index and mask tensors, per-call overheads) is over-counted, never under-counted: a pick's
    predicted bytes bound those of the executed plan (the startup prediction) from above.
    """
    request = _request(config)
    return most_microbatches(workers, global_rows, request.microbatches,
                             request.data_parallel_size)


def step_loss_fn(caller: StepCaller, micro_batch: Any) -> Callable[[Any], torch.Tensor]:
    """The user's loss as a function of the model's output: their step on ``micro_batch`` with
    the model's call returning that output (the pipeline's own finish), logging dropped."""
    quiet = dataclasses.replace(caller, logs=[])

    def loss(output: Any) -> torch.Tensor:
        quiet.logs.clear()
        return step_loss(quiet.finish(micro_batch, output, 0), caller.name)

    return loss


@dataclass(frozen=True)
class TensorParallelTuning:
    """``tensor_parallel_size`` T > 1 under ``"auto"``: for each T of ``sizes`` (one given,
    or those searched) the tuner plans the W / T workers and profiles each stage count's
    stages sharded by the user's ``plan`` over worker 0's T ranks (their seconds include the
    layers' collectives, their bytes are a rank's). ``timeout``: the most those ranks wait for
    each other in a collective (the strategy's ``step_timeout``)."""

    sizes: tuple[int, ...]
    plan: TensorParallelPlan
    device_type: str
    timeout: float


def choose_schedule(module: nn.Module, config: ScheduleConfig, options: PartitionOptions,
                    args: tuple[Any, ...], kwargs: dict[str, Any], *,
                    loss_fn: Callable[[Any], torch.Tensor] | None,
                    global_rows: int, optimizers: Sequence[Any], world_size: int, rank: int,
                    forward_context: Callable[[], AbstractContextManager[Any]] | None = None,
                    group: Any = None, passes: BuildPasses | None = None,
                    tensor_parallel: TensorParallelTuning | None = None,
                    collective: Collective | None = None,
                    calibration_group: Any = None) -> None:
    """Decide ``config`` (an undecided "auto") on rank 0 and give every rank the pick
    (collective): afterwards ``config.training_plan(W)`` is the pick's plan on every rank.

    ``args``/``kwargs``: the model's call on one microbatch (the probe's); ``global_rows``: the
    rows of the global batch the plan will cut into microbatches. ``passes``: where rank 0
    keeps the tuner's measuring passes for the build's memory report. ``tensor_parallel``:
    the stages are profiled sharded, by ranks 0 .. T - 1 together (rank 0 tunes, the others
    run the same profiles: :func:`~lightning_gsched.measure.tune_profile.follow_tuning`); with
    several T (a search) each is tuned in turn and the fastest fitting pick over all of them
    wins, a T that cannot be planned or sharded being skipped with its reason.
    ``collective``: the engine's (:mod:`.control`), around the calibration and each pick's
    broadcast. ``calibration_group``: where the runtime's costs are measured (host tensors: the
    engine's gloo group, whose waits end after ``step_timeout``; None: the default group).
    """
    sizes = tensor_parallel.sizes if tensor_parallel is not None else (1,)
    if max(sizes) > 1 and options.balance == "time":  # every rank alike, before any collective
        raise StrategyConfigError(
            "schedule='auto' with tensor_parallel_size > 1 profiles each cut on worker 0's "
            "ranks together, which must cut the model alike; balance='time' cuts by each "
            "rank's own timings. Use balance='params' (the default) or a list of units")
    # every rank measures the runtime's costs (collective) on the engine's group: its waits
    # end after step_timeout, and a lost or stuck peer is named as in any other collective
    refused = None
    run = collective or (lambda what, call: call())
    try:
        costs = (run("the runtime's cost calibration (schedule='auto')",
                     lambda: calibrate(calibration_group)) if world_size > 1
                 else DEFAULT_COSTS)
    except CalibrationError as exc:  # raised on every rank alike (figures averaged over ranks)
        # a busy machine must not stop the run: rank the candidates with the default costs
        costs, refused = DEFAULT_COSTS, str(exc)
    factor = optimizer_bytes_factor(optimizers)
    searched = len(sizes) > 1

    def failure(failed: RankZeroFailure) -> GschedError:
        if failed.kind is not None:
            return failed.kind(f"schedule='auto': {failed.text}")
        return StrategyConfigError(f"schedule='auto': rank 0 failed while profiling the model "
                                   f"for the tuner: {failed.text}")

    outcomes: dict[int, Pick | str] = {}  # per T: the pick, or why T was skipped (a search)
    for T in sizes:
        with _profiling_mesh(tensor_parallel, T, world_size) as tp_mesh:
            shard = None
            if tensor_parallel is not None and tp_mesh is not None:
                shard = sharded_while_measured(module, tensor_parallel.plan, tp_mesh)
            follow = None
            if shard is not None:  # worker 0's other ranks: the same sharded profiles

                def follow(shard: ShardStages = shard, T: int = T) -> None:
                    _follow(module, config, options, args, kwargs, loss_fn, global_rows,
                            factor, world_size // T, forward_context, shard)

            def decide(shard: ShardStages | None = shard, T: int = T) -> Pick | str:
                try:
                    return _decide(module, config, options, args, kwargs, loss_fn,
                                   global_rows, factor, world_size // T, forward_context,
                                   costs, passes if not searched else None, shard, T)
                except GschedError as exc:  # in a search, one T that cannot run is skipped
                    if not searched:
                        raise
                    return f"{type(exc).__name__}: {exc}"

            outcomes[T] = decided_by_rank_zero(
                f"the tuner's pick at tensor_parallel_size={T}", decide, rank=rank,
                world_size=world_size, group=group,
                collective=run, failure=failure, elsewhere=follow)
    config.choose(*best_over_sizes(outcomes))
    if refused is not None:
        config.choice_text += (f"\n  the runtime's costs could not be measured ({refused}); the "
                               "tuner ranked with the default costs (DEFAULT_COSTS)")


# what rank 0 tuned at one T: the pick as a checked config, the text that explains it, and
# every verdict
Pick = tuple[ScheduleConfig, str, TuneResult]


def best_over_sizes(outcomes: Mapping[int, Pick | str]) -> Pick:
    """The fastest fitting pick over every T tried (its text then says what each T gave),
    or a ScheduleConfigError giving each T's reason when none could be planned. One T: its
    pick as it is."""
    picks = {T: o for T, o in outcomes.items() if not isinstance(o, str)}
    if not picks:
        reasons = "; ".join(f"T={T}: {why}" for T, why in outcomes.items())
        raise ScheduleConfigError(f"schedule='auto' could plan no tensor_parallel_size it "
                                  f"searched ({reasons})")
    if len(outcomes) == 1:
        return next(iter(picks.values()))

    def predicted(pick: Pick) -> float:
        best = pick[2].best
        return best.step_time if best is not None and best.step_time is not None else math.inf

    T = min(picks, key=lambda size: predicted(picks[size]))
    chosen, text, result = picks[T]

    def line(size: int, outcome: Pick | str) -> str:
        if isinstance(outcome, str):
            return f"  T={size}: skipped ({outcome})"
        return f"  T={size}: {outcome[0].schedule}, predicted {predicted(outcome) * 1e3:.1f} ms"

    lines = [line(size, outcome) for size, outcome in outcomes.items()]
    head = (f"schedule='auto' searched tensor_parallel_size over {list(outcomes)} (the fastest "
            f"fitting pick of each T; every rank loads its own rows whatever T runs):")
    return chosen, "\n".join([head, *lines, f"  picked T={T}", text]), result


@contextmanager
def _profiling_mesh(tensor_parallel: TensorParallelTuning | None, size: int, world_size: int
                    ) -> Iterator[Any]:
    """Worker 0's mesh of ``size`` tensor-parallel ranks while the tuner profiles (None: T = 1,
    or a rank outside worker 0); collective, released afterwards."""
    if tensor_parallel is None or size == 1:
        yield None
        return
    with first_worker_mesh(tensor_parallel.device_type, world_size, size,
                           tensor_parallel.timeout) as mesh:
        yield mesh


def _search(config: ScheduleConfig, options: PartitionOptions,
            module: nn.Module) -> dict[str, Any]:
    """What the user fixed of the search, and the partition options: the keywords
    :func:`tune_model` and :func:`follow_tuning` share. A model with torch.compile'd modules
    is searched over the schedules without a split backward (partition/compiled.py)."""
    request = _request(config)
    schedules = ([name for name, spec in LIBRARY.items() if not spec.split_backward]
                 if compiled_modules(module) else None)
    return dict(schedules=schedules, checkpoint=(True,) if request.checkpoint else (False, True),
                stages=request.stages or _stages_fixed_by(options),
                micro=request.microbatches, R=request.R, replicas=request.data_parallel_size,
                balance=options.balance, leaf_modules=options.leaf_modules,
                split_points=options.split_points, static_shapes=options.static_shapes)


def _follow(module: nn.Module, config: ScheduleConfig, options: PartitionOptions,
            args: tuple[Any, ...], kwargs: dict[str, Any],
            loss_fn: Callable[[Any], torch.Tensor] | None, global_rows: int, factor: float,
            workers: int, forward_context: Callable[[], AbstractContextManager[Any]] | None,
            shard: ShardStages) -> None:
    """Worker 0's ranks but rank 0: rank 0's profiles, in step with it."""
    with profiling(module, forward_context):
        follow_tuning(module, args, workers, global_rows, shard, kwargs=kwargs,
                      loss_fn=loss_fn, optimizer_factor=factor, **_search(config, options, module))


def _decide(module: nn.Module, config: ScheduleConfig, options: PartitionOptions,
            args: tuple[Any, ...], kwargs: dict[str, Any],
            loss_fn: Callable[[Any], torch.Tensor] | None, global_rows: int,
            factor: float, workers: int,
            forward_context: Callable[[], AbstractContextManager[Any]] | None,
            costs: RuntimeCosts = DEFAULT_COSTS, passes: BuildPasses | None = None,
            shard: ShardStages | None = None, tensor_parallel_size: int = 1,
            ) -> tuple[ScheduleConfig, str, TuneResult]:
    """Rank 0's part: tune; the pick as a checked config, the text that explains it, and
    every verdict. ``workers``: the schedule's (W / T); ``shard``: see :func:`tune_model`."""
    request = _request(config)
    start = time.perf_counter()
    with profiling(module, forward_context):
        result = tune_model(
            module, args, workers, global_rows, kwargs=kwargs, loss_fn=loss_fn,
            budget=request.memory_budget, optimizer_factor=factor, costs=costs,
            top=TABLE_ROWS, passes=passes, shard=shard, **_search(config, options, module))
    seconds = time.perf_counter() - start
    result.tensor_parallel_size = tensor_parallel_size
    best = result.best
    if best is None:
        dropped = "; ".join(f"{v.candidate.text()}: {v.reason}" for v in result.verdicts[:3])
        raise ScheduleConfigError(
            f"no candidate could be planned for W={workers} and a global batch of "
            f"{global_rows} rows ({dropped or 'no candidates'}). Loosen stages=/microbatches=/"
            "R=/data_parallel_size="
        )
    chosen = pick_as_config(best, result, tensor_parallel_size)
    return chosen, _text(result, best, chosen, seconds, loss_fn is not None, costs), result


def _stages_fixed_by(options: PartitionOptions) -> int | None:
    """S implied by the partition options: ``split_points`` (S - 1 names) or unit counts."""
    if options.split_points is not None:
        return len(options.split_points) + 1
    if isinstance(options.balance, (list, tuple)):
        return len(options.balance)
    return None


def pick_as_config(best: Verdict, result: TuneResult, tensor_parallel_size: int = 1
                   ) -> ScheduleConfig:
    """The pick as arguments: what the user would have written (G and the mode included),
    plus the measured costs; the very arguments the tuner planned it with
    (``candidate_arguments``) on the W / T workers, but the tied weights, which the engine
    records from the partition it builds (``ScheduleConfig.set_ties``)."""
    c = best.candidate
    arguments = candidate_arguments(c, result.profiles[c.stages]).replace(
        ties=None, tensor_parallel_size=tensor_parallel_size)
    return ScheduleConfig(arguments=arguments)


def _request(config: ScheduleConfig) -> AutoRequest:
    assert config.auto is not None, "only schedule='auto' is tuned"
    return config.auto


def _text(result: TuneResult, best: Verdict, chosen: ScheduleConfig, seconds: float,
          user_loss: bool, costs: RuntimeCosts = DEFAULT_COSTS) -> str:
    """What rank 0 prints at startup: how it was decided, the ranked table, the pick."""
    counts = ", ".join(str(s) for s in sorted(result.profiles))
    profile = next(iter(result.profiles.values()))
    pick = chosen.arguments
    assert pick is not None
    R = f", R={pick.R}" if pick.R is not None else ""
    if pick.data_parallel_size > 1:
        R += (f", data_parallel_size={pick.data_parallel_size}, "
              f"data_parallel={pick.data_parallel!r}")
    ckpt = ", checkpoint_activations=True" if pick.checkpoint_activations else ""
    ckpt = (f", cap={best.candidate.cap}" if best.candidate.cap is not None else "") + ckpt
    assert best.step_time is not None and best.peak is not None
    T = pick.tensor_parallel_size
    who = "rank 0" if T == 1 else f"ranks 0-{T - 1} (worker 0, stages sharded {T} ways)"
    if T > 1:
        R += f", tensor_parallel_size={T}"
    return "\n".join([
        f"schedule='auto': {who} profiled the model at S = {counts} on one microbatch "
        f"of {profile.rows} row{'' if profile.rows == 1 else 's'} in {seconds:.1f} s (loss: "
        f"{'your step' if user_loss else 'the sum of the output'})",
        f"runtime costs ({'measured on this job' if costs is not DEFAULT_COSTS else 'defaults'}"
        f"): {costs.text()}",
        result.table(TABLE_ROWS),
        f"runs as schedule={pick.schedule!r}, stages={pick.stages}, "
        f"microbatches={pick.microbatches}{R}{ckpt}, with the measured seconds per stage as "
        f"costs: predicted step {best.step_time * 1e3:.1f} ms, peak {byte_text(best.peak)} per "
        "rank",
    ])
