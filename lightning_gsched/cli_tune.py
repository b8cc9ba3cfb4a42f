"""``gsched tune``: profile a model and rank the library's configurations, with T ranks per worker.

Why a module of its own: the other ``gsched`` commands never load torch; this one profiles a
user's model, and with ``--tp T`` it must time the stages sharded over T ranks together (each
sharded layer's collectives need their peers), which one process cannot do. It then starts T
processes on this host (gloo, CPU), where rank 0 tunes as the command does without ``--tp``
and the others run the same profiles in step (``measure.tune_profile.follow_tuning``): what
``GeneralParallel("auto", tensor_parallel_size=T)`` does on its worker 0's ranks at the first
batch. Several values (``--tp 1 2 4``) tune each T in turn and name the fastest fitting pick
over all of them: the search over T.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from lightning_gsched.errors import GschedError, ScheduleConfigError
from lightning_gsched.schedule.data_parallel import tensor_parallel_workers
from lightning_gsched.schedule.describe import byte_text
from lightning_gsched.schedule.runtime_costs import DEFAULT_COSTS, RuntimeCosts
from lightning_gsched.schedule.tune import TuneResult

# how long a profiling process waits for its peers in one collective
PEER_TIMEOUT_S = 120.0


def _module_attribute(spec: str, what: str, kind: str) -> Any:
    """``FILE.py:NAME`` or ``MODULE:NAME`` -> that attribute (a file's folder goes on the path,
    as ``python FILE.py`` would put it)."""
    import importlib
    import importlib.util

    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ScheduleConfigError(f"{what} {spec!r} is not FILE.py:NAME or MODULE:NAME; e.g. "
                                  "examples/gpt.py:tune_target")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ScheduleConfigError(f"{what} {spec!r}: no file {where}")
        sys.path.insert(0, str(path.resolve().parent))
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    if not hasattr(module, name):
        raise ScheduleConfigError(f"{what} {spec!r}: {where} has no {kind} {name}")
    return getattr(module, name)


def load_target(spec: str) -> tuple[Any, tuple[Any, ...], Any]:
    """``FILE.py:FUNCTION`` or ``MODULE:FUNCTION`` -> (model, args, loss_fn or None)."""
    fn = _module_attribute(spec, "tune target", "function")
    if not callable(fn):
        raise ScheduleConfigError(f"tune target {spec!r} is not a function")
    out = fn()
    if not isinstance(out, tuple) or len(out) not in (2, 3) or not isinstance(out[1], tuple):
        raise ScheduleConfigError(
            f"tune target {spec!r} must return (model, args) or (model, args, loss_fn) with "
            f"args a tuple (one microbatch), got {type(out).__name__}")
    return out[0], out[1], out[2] if len(out) == 3 else None


def load_plan(spec: str | None, degree: int) -> Any:
    """``--tp-plan``: JSON (``'{"blocks.*.attn.q": "colwise", ...}'``, the styles by name as in
    a YAML config) or ``FILE.py:NAME`` / ``MODULE:NAME`` (a dict of styles, or a function
    ``parallelize(stage_module, tp_mesh)``), checked as ``tensor_parallel_plan`` is."""
    from lightning_gsched.partition.tensor_parallel import check_plan

    plan: Any = None
    if spec is not None:
        if spec.lstrip().startswith("{"):
            try:
                plan = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ScheduleConfigError(f"--tp-plan is not valid JSON ({exc}): {spec!r}"
                                          ) from None
        else:
            plan = _module_attribute(spec, "--tp-plan", "plan")
    return check_plan(degree, plan)


def tune_command(args: argparse.Namespace) -> int:
    """``gsched tune``: each T of ``--tp`` tuned (T > 1 in T processes), its table printed;
    with several, the fastest fitting pick over all of them."""
    sizes = list(dict.fromkeys(args.tensor_parallel_size))
    for T in sizes:  # every T divides W and has a plan before anything is profiled
        tensor_parallel_workers(args.workers, T)
        load_plan(args.tensor_parallel_plan if T > 1 else None, T)
    costs = DEFAULT_COSTS.with_changes(
        latency=args.latency, bandwidth=args.bandwidth, send_cpu=args.message_cpu,
        recv_cpu=args.message_cpu, job_cpu=args.job_overhead)
    results = []
    for T in sizes:
        result = _tune_one(args, costs) if T == 1 else _tune_sharded(args, costs, T)
        print(result.table(args.top))
        results.append(result)
    if len(results) > 1:
        print(_best_over(results))
    return 0 if any(r.best is not None for r in results) else 1  # 1: no pick, for scripts


def _best_over(results: list[TuneResult]) -> str:
    """The fastest fitting pick over every T tuned (the search over T)."""
    picks = [(r.best, r) for r in results if r.best is not None]
    if not picks:
        return "over every --tp value: nothing fits the budget"
    best, result = min(picks, key=lambda pick: pick[0].step_time or float("inf"))
    assert best.step_time is not None and best.peak is not None
    return (f"over every --tp value: fastest fitting is T={result.tensor_parallel_size}: "
            f"{best.candidate.shape_text()}, {best.step_time * 1e3:.1f} ms, "
            f"{byte_text(best.peak)} per rank")


def _tune_keywords(args: argparse.Namespace, costs: RuntimeCosts) -> dict[str, Any]:
    return dict(budget=args.budget, optimizer_factor=args.optimizer_factor, costs=costs,
                schedules=args.schedules,
                checkpoint=(False,) if args.no_checkpointing else (False, True),
                stages=args.stages, micro=args.microbatches, R=args.R,
                replicas=args.data_parallel_size, top=args.top,
                leaf_modules=tuple(args.leaf_modules))


def _tune_one(args: argparse.Namespace, costs: RuntimeCosts) -> TuneResult:
    from lightning_gsched.measure.tune_profile import tune_model

    model, example, loss_fn = load_target(args.target)
    return tune_model(model, example, args.workers, args.global_batch, loss_fn=loss_fn,
                      **_tune_keywords(args, costs))


def _tune_sharded(args: argparse.Namespace, costs: RuntimeCosts, T: int) -> TuneResult:
    """Tune the W / T workers with each stage profiled sharded over T local processes."""
    from torch.multiprocessing.spawn import start_processes

    with tempfile.TemporaryDirectory(prefix="gsched_tune_") as folder:
        out = Path(folder) / "result.pickle"
        with socket.socket() as s:  # a free port for the processes' rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            start_processes(_tune_rank, args=(T, port, args, costs, str(out)),  # type: ignore[no-untyped-call]
                            nprocs=T, start_method="spawn")
        except Exception as exc:  # noqa: BLE001 - a process's failure, reported below
            if not out.exists():
                raise ScheduleConfigError(
                    f"gsched tune --tp {T}: a profiling process failed: {exc}") from None
        outcome = pickle.loads(out.read_bytes())
    if not isinstance(outcome, TuneResult):
        raise ScheduleConfigError(f"gsched tune --tp {T}: {outcome or 'no result'}")
    return outcome


def _tune_rank(rank: int, T: int, port: int, args: argparse.Namespace, costs: RuntimeCosts,
               out: str) -> None:
    """One of the T processes: rank 0 tunes (its result, or its error, pickled to ``out``),
    the others follow its profiles."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_gsched.measure.tune_profile import (
        follow_tuning,
        sharded_while_measured,
        tune_model,
    )
    from lightning_gsched.partition.tensor_parallel import with_kept_whole

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # T processes share the host's cores, as a worker's T ranks share a node
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // T))
    dist.init_process_group("gloo", rank=rank, world_size=T,
                            timeout=timedelta(seconds=PEER_TIMEOUT_S))
    outcome: Any = None
    try:
        model, example, loss_fn = load_target(args.target)
        plan = load_plan(args.tensor_parallel_plan, T)
        mesh = init_device_mesh("cpu", (T,), mesh_dim_names=("tensor_parallel",))
        shard = sharded_while_measured(model, plan, mesh)
        keywords = _tune_keywords(args, costs)
        # as GeneralParallel: the plan's modules and their holders whole (kept_whole says why)
        keywords["leaf_modules"] = with_kept_whole(keywords["leaf_modules"], model, plan)
        workers = args.workers // T
        if rank == 0:
            result = tune_model(model, example, workers, args.global_batch, loss_fn=loss_fn,
                                shard=shard, **keywords)
            result.tensor_parallel_size = T
            outcome = result
        else:
            for name in ("budget", "costs", "top"):
                keywords.pop(name)
            follow_tuning(model, example, workers, args.global_batch, shard, loss_fn=loss_fn,
                          **keywords)
    except GschedError as exc:
        outcome = str(exc)
    except Exception as exc:  # noqa: BLE001 - told to the command, which names the process
        outcome = f"process {rank} of {T} failed while profiling: {type(exc).__name__}: {exc}"
    finally:
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(outcome))
        dist.destroy_process_group()
