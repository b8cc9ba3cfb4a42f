"""The process groups one executor talks over, and the job-wide fault notice.

Programs are FIFO per (src, dst) *per channel* (``p2p``, ``weights``, ``grads``). gloo keeps one
queue per (peer, tag): there one group carries every channel, a tag each. Backends without message
tags (NCCL) only order messages within one communicator: there one group per kind and direction,
because NCCL runs a communicator's point-to-point operations in issue order, so a receive posted
early from a peer must not hold back a later send *to* it. Replica all-reduces get one subgroup
per member set, running statistics one world group. ``dist.new_group`` is collective, so every
rank builds its ``Channels`` in the same order from the same programs (:func:`replica_groups`).
On a failure the executor reports it in the job's store (peers quote it as the root cause) and
destroys the groups, so that peers blocked on it fail at once.
"""

from __future__ import annotations

import gc
import itertools
import time
from contextlib import suppress
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from lightning_gsched.errors import RuntimeConfigError
from lightning_gsched.runtime import gloo_groups, peer_processes
from lightning_gsched.schedule.program import Op, Programs

KINDS = ("p2p", "weights", "grads")
# how long a rank that lost its connection to a peer waits for that peer's failure notice
LOST_PEER_GRACE_S = 2.0
# how long a rank whose wait timed out with nothing reported waits for the others to post
# where they wait (FaultNotice.positions): their timeouts end within their skew of its own
POSITIONS_GRACE_S = 5.0
_SERIAL = itertools.count()  # same sequence on every rank: Channels are built collectively


def default_store() -> Store | None:
    """The default process group's store, used for the fault notice (None if unavailable)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 - the notice is an optional courtesy
        return None


class FaultNotice:
    """The job's first failure under one key of the job's store, written once: peers of the
    runtime's channels and of the strategy's control group quote it as their root cause."""

    def __init__(self, store: Store | None, key: str) -> None:
        self.store = store
        self.key = key

    def report(self, message: str) -> None:
        with suppress(Exception):  # never mask the real failure
            if self.store is not None:
                self.store.compare_set(self.key, "", message)

    def first(self) -> str | None:
        """The failure a rank recorded, if any (never blocks)."""
        with suppress(Exception):
            if self.store is not None and self.store.check([self.key]):
                return self.store.get(self.key).decode(errors="replace")
        return None

    def publish(self, rank: int) -> None:
        """Record this process as ``rank``'s, so a peer that loses it can name it
        (:mod:`.peer_processes`)."""
        peer_processes.publish(self.store, rank)

    def gone_text(self, world_size: int) -> str:
        """Which ranks on this host have exited (:func:`.peer_processes.gone_text`), or ""."""
        return peer_processes.gone_text(self.store, world_size)

    def after_lost_connection(self, grace: float, world_size: int) -> tuple[str | None, str]:
        """(the job's first failure, which ranks on this host have exited) once a connection
        is lost. A peer that exited wrote its notice, if any, before it closed its
        connections, so then none is waited for; else :meth:`first_within` waits ``grace``
        and the process table is read again (a rank killed while this one waited)."""
        exited = self.gone_text(world_size)
        first = self.first() if exited else self.first_within(grace)
        if first is None and not exited:
            exited = self.gone_text(world_size)
        return first, exited

    def first_within(self, grace: float) -> str | None:
        """:meth:`first`, waiting up to ``grace`` s for one: a failing peer records its failure
        before it closes its connections, but the close can reach this rank first, whose own
        "lost the connection" would then hide the real cause."""
        deadline = time.monotonic() + grace
        while True:
            first = self.first()
            if first is not None or time.monotonic() >= deadline:
                return first
            time.sleep(0.02)


    def positions(self, rank: int, world_size: int, where: str,
                  grace: float = POSITIONS_GRACE_S) -> str:
        """After a wait that timed out with no failure reported: post where this rank waits,
        and say where every rank waits, as far as the others post within ``grace`` s.

        Why: ranks that wait in different places (one left a Fabric loop a step early and
        waits in ``finish()``'s gather, one's DataLoader ran out, one skipped a collective)
        each time out with nothing to report, and "a peer is stuck or died" names nobody.
        Every rank that times out posts its place, so each message can say which rank is
        where: the diagnosis. A rank that posts nothing is stuck, dead, or not waiting."""
        if self.store is None:
            return ""
        prefix = f"{self.key}/where/"
        with suppress(Exception):
            self.store.set(prefix + str(rank), where)
        found: dict[int, str] = {}
        deadline = time.monotonic() + grace
        while len(found) < world_size:
            for r in range(world_size):
                with suppress(Exception):
                    if r not in found and self.store.check([prefix + str(r)]):
                        found[r] = self.store.get(prefix + str(r)).decode(errors="replace")
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        exited = dict(peer_processes.gone(self.store, world_size))
        places: dict[str, list[int]] = {}
        for r in range(world_size):
            silent = (f"exited (pid {exited[r]})" if r in exited
                      else "posted nothing (stuck, died, or not waiting)")
            places.setdefault(found.get(r, silent), []).append(r)
        return "; ".join(f"{_ranks_text(ranks)} {place}" for place, ranks in places.items())


def _ranks_text(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0, 2, 5``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def destroy_groups(groups: list[Any], collect: bool = False) -> None:
    """Destroy process groups (one already gone is skipped) and empty ``groups``, so the caller
    holds no reference either; ``collect``: then run the garbage collector, which frees the
    backend's buffers at once (up to a second in a large process)."""
    for group in groups:
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - already gone
            pass
    groups.clear()
    if collect:
        gc.collect()


def replica_groups(programs: Programs) -> list[tuple[int, ...]]:
    """Distinct ``ALLREDUCE_G`` member sets, sorted: the creation order, the same on every rank.
    The planner's programs (``Programs.planned``) all-reduce exactly over replicated owners, read
    without lowering any program (which would lower all W on every rank); others are scanned."""
    groups = set(owner_groups(programs))
    if not programs.planned:
        for program in programs.ranks:
            groups.update(a.group for a in program if a.op is Op.ALLREDUCE_G and a.group)
    return sorted(groups)


def owner_groups(programs: Programs) -> list[tuple[int, ...]]:
    """The distinct owner sets of replicated stages (a tie is owned with its home), sorted."""
    return sorted({tuple(owners) for owners in programs.owners if len(owners) > 1})


class Channels:
    """Process groups per channel kind, replica subgroups (decided by ``programs``), and the fault
    notice (in ``store``, default: the default process group's; or ``notice``, a front end's,
    shared with its own collectives: one job-wide first failure). ``timeout`` (seconds) is also
    the groups' own, which bounds collectives.

    ``tensor_parallel_size=T``: each worker of the programs is T ranks, rank ``w * T + t`` (the
    tensor-parallel index innermost), each running worker ``w``'s program on its own shard. Peers
    are then the same ``t`` of another worker: every group is made once per ``t`` (collectively,
    by every rank) and a rank keeps its own; :attr:`rank` is the worker."""

    def __init__(self, programs: Programs, *, timeout: float = 300.0,
                 store: Store | None = None, tensor_parallel_size: int = 1,
                 notice: FaultNotice | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeConfigError(
                "torch.distributed is not initialized; call dist.init_process_group(...) on every "
                "rank before building the runtime.")
        T = tensor_parallel_size
        world = programs.world_size
        if dist.get_world_size() != world * T:
            each = f" of {T} ranks each" if T > 1 else ""
            raise RuntimeConfigError(
                f"the programs are for {world} workers{each} but the job has "
                f"{dist.get_world_size()} ranks; plan with workers={dist.get_world_size() // T}.")
        self.tensor_parallel = (T, dist.get_rank() % T)
        self.rank = dist.get_rank() // T
        self.global_rank = dist.get_rank()  # what fault messages call "rank"
        self.world_size = world
        self.timeout = float(timeout)
        self.serial = next(_SERIAL)
        self.store = store if store is not None else default_store()
        self.notice = notice if notice is not None else FaultNotice(
            self.store, f"lightning_gsched/fault/{self.serial}")
        self.notice.publish(self.global_rank)
        span = timedelta(seconds=self.timeout)

        def new_group(workers: list[int] | tuple[int, ...]) -> Any:
            made = [gloo_groups.new_group([w * T + t for w in workers], timeout=span)
                    for t in range(T)]
            return made[self.tensor_parallel[1]]

        everyone = list(range(world))
        # gloo matches messages by tag: one group carries every channel, a tag each (fewer
        # groups: fewer connections and less set-up; the groups share one gloo device and its
        # thread, see gloo_groups)
        self.tagged = gloo_groups.default_is_gloo()
        if self.tagged:
            self.shared = new_group(everyone)
            self.groups: dict[tuple[str, bool], Any] = {
                (kind, up): self.shared for kind in KINDS for up in (True, False)}
        else:
            self.groups = {(kind, up): new_group(everyone)
                           for kind in KINDS for up in (True, False)}
            self.shared = new_group(everyone)
        self.replicas: dict[tuple[int, ...], Any] = {
            members: self.shared if self.tagged and len(members) == world
            else new_group(members)
            for members in replica_groups(programs)}
        self.closed = False

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeConfigError(
                "these channels are closed (after a failure or close()); build a new executor "
                "(and new channels) on every rank to continue.")

    def _route(self, kind: str, src: int, dst: int) -> tuple[Any, int]:
        """The group and tag carrying ``kind`` messages from ``src`` to ``dst``."""
        self._check_open()
        up = src < dst
        return self.groups[(kind, up)], (2 * KINDS.index(kind) + up if self.tagged else 0)

    def _global(self, worker: int) -> int:
        """The rank of ``worker``'s tensor-parallel index that this rank talks to."""
        T, t = self.tensor_parallel
        return worker * T + t

    def isend(self, tensor: Any, peer: int, kind: str) -> Any:
        group, tag = self._route(kind, self.rank, peer)
        return dist.isend(tensor, self._global(peer), group=group, tag=tag)

    def irecv(self, tensor: Any, peer: int, kind: str) -> Any:
        group, tag = self._route(kind, peer, self.rank)
        return dist.irecv(tensor, self._global(peer), group=group, tag=tag)

    def _collective_group(self, members: tuple[int, ...] | None) -> Any:
        self._check_open()
        return self.shared if members is None else self.replicas[tuple(members)]

    def workers_group(self) -> Any:
        """The group of every worker, group rank = worker (with tensor parallelism, the ranks
        of this rank's index t): for the collectives outside a step (the full state, the
        hand-over). Call it at each use, never keep the group (an aborted group must lose its
        last reference to close its connections)."""
        return self._collective_group(None)

    def all_reduce(self, tensor: Any, members: tuple[int, ...] | None) -> Any:
        """Start an async SUM all-reduce over ``members`` (None: every rank)."""
        group = self._collective_group(members)
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def broadcast(self, tensor: Any, src: int, members: tuple[int, ...] | None) -> None:
        dist.broadcast(tensor, self._global(src), group=self._collective_group(members))

    def first_fault(self, grace: float = 0.0) -> str | None:
        """The failure a rank recorded, if any, waiting up to ``grace`` s for one."""
        return self.notice.first_within(grace)

    def after_lost_connection(self, grace: float) -> tuple[str | None, str]:
        """:meth:`FaultNotice.after_lost_connection` over every rank of the job."""
        return self.notice.after_lost_connection(grace, self.world_size * self.tensor_parallel[0])

    def positions(self, where: str) -> str:
        """Where every rank waits (:meth:`FaultNotice.positions`), this one at ``where``."""
        T = self.tensor_parallel[0]
        return self.notice.positions(self.global_rank, self.world_size * T, where)

    def close(self, collect: bool = False) -> None:
        """Release the process groups (local; call on every rank when done with the executor).
        ``collect`` (on an abort, once the caller dropped its pending work handles, which keep the
        connections alive): a full garbage collection frees work objects that reference cycles
        still hold, so the connections really close now."""
        if self.closed:
            return
        self.closed = True
        groups = list({id(g): g for g in (*self.groups.values(), self.shared,
                                          *self.replicas.values())}.values())
        self.groups, self.replicas, self.shared = {}, {}, None
        destroy_groups(groups, collect)
