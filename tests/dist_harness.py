"""Run check functions on W CPU processes that share one gloo job, started once per module.

Why: starting processes and a process group costs seconds on a 2-core machine, while one check
(a step of a tiny model) costs milliseconds. A :class:`DistWorld` spawns W workers once; each
:meth:`DistWorld.run` sends one check to every rank, the ranks run it collectively, and the parent
gets every rank's return value, or an ``AssertionError`` carrying every failing rank's traceback.

A check is a module-level function ``fn(ctx, *args, **kwargs)`` (pickled by reference, so it
must live in an importable module such as the test file itself); ``ctx`` is a
:class:`WorkerContext`.
Exceptions raised by a check are returned as :class:`RankError` values when ``expect_errors=True``
(fault tests), so a test can assert on each rank's message.

    world = DistWorld(4)        # or the ``worlds`` fixture (conftest.py)
    results = world.run(my_check, "gpipe")
    world.close()

The test session keeps one world per size alive across modules (:class:`WorldPool`; each
module sees it through a :class:`Worlds` view): a world's start, and the first check's imports
of torch and Lightning in every rank, cost 5-12 s, and the suite asked for 47 of them when each
module started its own (2026-11-28). Idle workers wait on their queue and use no CPU. Between
modules each rank's environment variables are put back as they were when the rank started
(:func:`restore_environment`), so what one module's checks export (``LOCAL_RANK``, Lightning's
seed variables) does not reach the next; a module whose checks leave other process-wide state
behind cleans it with :meth:`Worlds.before_close`.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable

DEFAULT_TIMEOUT = 120.0
# a shared world's hand-over to the next module (restore_environment): a few milliseconds when
# the world is sound; a default group an earlier module broke fails it and a new world starts
HANDOVER_TIMEOUT = 30.0


@dataclass
class WorkerContext:
    """What a check gets: its rank, the world size and the job's store."""

    rank: int
    world_size: int
    store: Any


@dataclass
class RankError:
    """An exception a check raised on one rank (type name, message, traceback text)."""

    rank: int
    type_name: str
    message: str
    traceback: str
    seconds: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def strict_warnings() -> None:
    """A deprecation that the library's own code triggers is an error, in every process a test
    runs (pyproject.toml sets the same filters for pytest's own process): the library must not
    call what torch or Lightning are about to remove."""
    for category in (DeprecationWarning, FutureWarning):
        warnings.filterwarnings("error", category=category, module="lightning_gsched")


_STARTING_ENVIRONMENT: dict[str, str] = {}


def restore_environment(ctx: WorkerContext) -> None:
    """Put this rank's environment variables, and the system temporary folder the checkpoint
    fault tests redirect, back as they were when it started (a check run between two modules
    on a shared world, see :class:`Worlds`)."""
    os.environ.clear()
    os.environ.update(_STARTING_ENVIRONMENT)
    tempfile.tempdir = None  # gettempdir() chooses again, from the restored TMPDIR
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))  # and the default group still works (Worlds.get)


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _STARTING_ENVIRONMENT.update(os.environ)
    strict_warnings()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, world_size, rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=world_size,
        store=store,
        timeout=datetime.timedelta(seconds=60),
    )
    ctx = WorkerContext(rank, world_size, store)
    results.put(("ready", rank, None))
    while True:
        job = tasks.get()
        if job is None:
            break
        job_id, fn, args, kwargs = job
        start = time.monotonic()
        try:
            value = fn(ctx, *args, **kwargs)
            results.put((job_id, rank, value))
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            results.put(
                (
                    job_id,
                    rank,
                    RankError(
                        rank,
                        type(exc).__name__,
                        str(exc),
                        traceback.format_exc(),
                        time.monotonic() - start,
                    ),
                )
            )
    try:
        dist.destroy_process_group()
    finally:
        os._exit(0)  # skip interpreter teardown (gloo threads); the parent already has results


class DistWorld:
    """W spawned worker processes in one gloo job (see the module docstring)."""

    def __init__(self, world_size: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.world_size = world_size
        self.timeout = timeout
        context = mp.get_context("spawn")
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(world_size)]
        port = _free_port()
        self._procs = [
            context.Process(
                target=_worker,
                args=(r, world_size, port, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self._next_id = 0
        self._dead: str | None = None
        self._collect("ready", timeout=max(timeout, 120.0))

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        expect_errors: bool = False,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; the per-rank results, rank order."""
        if self._dead:
            raise RuntimeError(f"this DistWorld is unusable: {self._dead}")
        job_id = self._next_id
        self._next_id += 1
        for tasks in self._tasks:
            tasks.put((job_id, fn, args, kwargs))
        values = self._collect(job_id, timeout or self.timeout)
        errors = [v for v in values if isinstance(v, RankError)]
        if errors and not expect_errors:
            detail = "\n".join(
                f"--- rank {e.rank}: {e.type_name}: {e.message}\n{e.traceback}" for e in errors
            )
            raise AssertionError(f"{fn.__name__} failed on {len(errors)} rank(s):\n{detail}")
        return values

    def _collect(self, job_id: Any, timeout: float) -> list[Any]:
        values: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(values) < self.world_size:
            left = deadline - time.monotonic()
            try:
                got_id, rank, value = self._results.get(timeout=min(max(left, 0.01), 1.0))
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(self._procs) if not p.is_alive() and r not in values
                ]
                if left > 0 and not dead:
                    continue
                missing = sorted(set(range(self.world_size)) - set(values))
                why = (
                    f"ranks {dead} died (exit codes {[self._procs[r].exitcode for r in dead]})"
                    if dead
                    else f"no answer within {timeout:g} s"
                )
                self._dead = f"ranks {missing} did not answer job {job_id}: {why}"
                self.close(kill=True)
                raise AssertionError(self._dead) from None
            if got_id == job_id:
                values[rank] = value
        return [values[r] for r in range(self.world_size)]

    def usable(self) -> bool:
        """No check has found it broken and every rank is still running (a fault test's
        rank may end after answering)."""
        return not self._dead and all(proc.is_alive() for proc in self._procs)

    def close(self, kill: bool = False) -> None:
        if not kill and not self._dead:
            for tasks in self._tasks:
                tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=0 if kill else 10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


class WorldPool:
    """One :class:`DistWorld` per size for the whole test session (see the module docstring);
    a world found unusable is replaced by a new one."""

    def __init__(self) -> None:
        self._worlds: dict[int, DistWorld] = {}

    def get(self, world_size: int, timeout: float) -> DistWorld:
        world = self._worlds.get(world_size)
        if world is None or not world.usable():
            if world is not None:
                world.close(kill=True)
            world = self._worlds[world_size] = DistWorld(world_size, timeout)
        world.timeout = timeout
        return world

    def discard(self, world_size: int) -> None:
        """End the world of that size (its ranks are killed); ``get`` starts a new one."""
        world = self._worlds.pop(world_size, None)
        if world is not None:
            world.close(kill=True)

    def close(self) -> None:
        for world in self._worlds.values():
            world.close(kill=not world.usable())
        self._worlds.clear()


class Worlds:
    """One test module's view of the session's :class:`WorldPool`: ``get(W)`` hands out the
    pool's world of W ranks with this module's per-check timeout; the first time this module
    gets a world, each rank's environment is restored (:func:`restore_environment`, which also
    checks the default group with one all-reduce: a world an earlier module left broken is
    replaced, so its failure is not reported by an innocent module), and when the module ends,
    its :meth:`before_close` functions run on every world it used."""

    def __init__(self, pool: WorldPool, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout = timeout
        self._pool = pool
        self._used: dict[int, DistWorld] = {}
        self._before_close: list[Callable[[WorkerContext], Any]] = []

    def before_close(self, fn: Callable[[WorkerContext], Any]) -> None:
        """Run ``fn`` on every rank of each world this module used, when the module ends: for
        state the module caches in its workers, such as process groups, which should be
        destroyed in order rather than left to the next module."""
        self._before_close.append(fn)

    def get(self, world_size: int) -> DistWorld:
        world = self._pool.get(world_size, self.timeout)
        if self._used.get(world_size) is not world:
            try:
                world.run(restore_environment, timeout=HANDOVER_TIMEOUT)
            except AssertionError:  # an earlier module left its default group broken
                self._pool.discard(world_size)
                world = self._pool.get(world_size, self.timeout)
                world.run(restore_environment, timeout=HANDOVER_TIMEOUT)
            self._used[world_size] = world
        return world

    def discard(self, world_size: int) -> None:
        """End the world of that size for good: for a check that leaves its ranks out of step
        (e.g. a process group made on some ranks only, which the next ``new_group`` of every
        rank would wait on). The next ``get`` starts a new one."""
        self._used.pop(world_size, None)
        self._pool.discard(world_size)

    def close(self) -> None:
        """End this module's use of its worlds (they stay in the pool for the next module)."""
        for world in self._used.values():
            if world.usable():
                for fn in self._before_close:
                    world.run(fn)
        self._used.clear()
