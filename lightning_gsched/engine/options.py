"""The arguments both front ends take, checked once, before any process starts.

Why a module of its own: ``GeneralParallel`` (Trainer) and ``GeneralParallelFabric`` accept the
same schedule, partition, timeout and launch arguments and register the same strategy names;
one place checks them (each wrong one raises a ``GschedError`` naming it, the value and a valid
one) and lists the names, so the two front ends cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Sequence

from lightning_gsched.engine.config import AUTO, ScheduleConfig
from lightning_gsched.errors import StrategyConfigError
from lightning_gsched.partition.arguments import check_options as check_partition_options
from lightning_gsched.partition.tensor_parallel import TensorParallelPlan, check_plan
from lightning_gsched.partition.verify import check_verify
from lightning_gsched.runtime import TRANSPORTS
from lightning_gsched.schedule import validate
from lightning_gsched.schedule.arguments import ScheduleArguments
from lightning_gsched.schedule.library import LIBRARY

START_METHODS = ("popen", "spawn", "fork", "forkserver")


@dataclass
class PartitionOptions:
    """How the model's forward is cut into stages (``partition()``'s options)."""

    balance: Any = "params"
    leaf_modules: tuple[type | str, ...] = ()
    split_points: Any = None
    static_shapes: bool | None = None
    verify: bool | str = "auto"  # compare the split with the model at setup (partition/verify.py)


# the partition's keywords, and the schedule config's own, besides ScheduleArguments' names
PARTITION_KEYWORDS = ("balance", "leaf_modules", "split_points", "static_shapes", "verify")


def pipeline_keywords(values: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords :func:`pipeline_options` takes, picked from a front end's ``locals()``.

    The front ends' constructors spell every argument out (LightningCLI and jsonargparse build
    the YAML schema from ``__init__``'s signature) under :class:`ScheduleArguments`' names;
    picking them by name passes them on without writing the list a third time.
    """
    names = (*ScheduleArguments.names(), "memory_budget", "profile_costs", "data_loading",
             *PARTITION_KEYWORDS)
    return {name: values[name] for name in names if name in values}


def pipeline_options(
    *, balance: Any = "params", leaf_modules: Sequence[str | type] = (),
    split_points: list[str] | None = None, static_shapes: bool | None = None,
    verify: Any = "auto", memory_budget: Any = None, profile_costs: Any = False,
    **schedule_arguments: Any,
) -> tuple[ScheduleConfig, PartitionOptions]:
    """The schedule and partition arguments, checked (the same checks as ``plan()`` and
    ``partition()``; what needs the device count fails at setup, on every rank).

    ``schedule_arguments``: :class:`ScheduleArguments`' keywords (``schedule``, ``stages``,
    ...); ``schedule="auto"`` with ``memory_budget``: see :meth:`ScheduleConfig.from_keywords`.
    """
    config = ScheduleConfig.from_keywords(memory_budget=memory_budget,
                                          profile_costs=profile_costs, **schedule_arguments)
    options = PartitionOptions(
        *check_partition_options(balance, leaf_modules, split_points, static_shapes,
                                 schedule_arguments.get("stages")),
        verify=check_verify(verify))
    return config, options


def check_launch_arguments(step_timeout: Any, process_group_backend: Any, timeout: Any,
                           start_method: Any) -> float:
    """The step timeout and the DDP-style launch arguments; returns the timeout as a float.

    Lightning's plugin arguments (accelerator, cluster_environment, ...) go to the DDP strategy
    the front end derives from, as they are; a wrong one fails there as it would with DDP.
    """
    validate.positive_number("step_timeout", step_timeout, "300", StrategyConfigError,
                             "seconds any one wait may take: a finite number > 0")
    if process_group_backend is not None and not isinstance(process_group_backend, str):
        raise validate.invalid("process_group_backend", process_group_backend,
                               "must be None (Lightning picks) or a torch.distributed backend "
                               "name", "'gloo'", StrategyConfigError)
    if timeout is not None and not isinstance(timeout, timedelta):
        raise validate.invalid("timeout", timeout, "must be a datetime.timedelta (the process "
                               "group timeout; step_timeout bounds each wait in a step)",
                               "timedelta(minutes=30)", StrategyConfigError)
    validate.one_of("start_method", start_method, START_METHODS, StrategyConfigError)
    return float(step_timeout)


def check_transport(transport: Any) -> str:
    """``transport``: how activations travel between stages (see docs/runtime.md, Transport)."""
    return str(validate.one_of("transport", transport, TRANSPORTS, StrategyConfigError))


def library_names(front_end: str) -> list[tuple[str, str, str]]:
    """``(registered name, description, schedule)`` for every library schedule, e.g.
    ``("gsched_1f1b", "GeneralParallel('1f1b'): ...", "1f1b")``; and ``gsched_auto``."""
    return [(f"gsched_{name}", f"{front_end}('{name}'): {spec.trade_off}", name)
            for name, spec in LIBRARY.items()] + [
        (f"gsched_{AUTO}", f"{front_end}('{AUTO}'): the tuner profiles the model at the first "
         "batch and picks the fastest schedule, S, B, R and checkpointing", AUTO)]


def sampler_kwargs(world_size: int, rank: int, config: ScheduleConfig) -> dict[str, int]:
    """The distributed sampler's share for ``rank``: with tensor parallelism the T ranks of a
    worker (rank ``w * T + t``) load the same rows, as Lightning's ModelParallelStrategy gives
    a tensor-parallel group one share; with ``data_loading="per_replica"`` every rank of a
    data-parallel replica loads the replica's (G shares); otherwise, and when ``"auto"``
    searches T (the pick must not change the global batch:
    :attr:`ScheduleConfig.rows_per_rank`), every rank its own."""
    workers = config.workers(world_size, rank)
    return {"num_replicas": workers.positions, "rank": workers.position}


def tensor_parallel_options(config: ScheduleConfig, plan: Any) -> TensorParallelPlan | None:
    """``tensor_parallel_plan`` against the config's ``tensor_parallel_size`` (checked by
    :func:`~lightning_gsched.partition.tensor_parallel.check_plan`, before any process
    starts)."""
    if config.rows_per_rank:  # a search: the plan serves every T above 1 it tries
        return check_plan(2, plan)
    return check_plan(config.tensor_parallel_size, plan)
