"""Ranks as the plan's workers (a worker is T consecutive ranks), and whose batch each rank loaded.

Why a module of its own: the engine's collectives span every rank, while the pipeline it runs
(the programs, the batch's rows, the start-up rows, the losses) is the workers'. Rank
``w * T + t`` runs worker ``w``'s program on its shards (``t``: its tensor-parallel index); the
rows it reads come from the same ``t`` of the worker that loaded them; of a worker's T ranks,
which compute the same losses, logged values and outputs, only ``t = 0`` reports them. With
``T = 1`` every rank is its own worker and all of this is the identity.

Whose batch is whose: a worker's T ranks load one share of the data (``rows_per_rank=False``,
Lightning's ModelParallelStrategy's convention: the row arithmetic's positions are the workers),
or, when ``"auto"`` searches T, every rank loads its own share and a worker's batch is its T
ranks' batches in ``t`` order (``rows_per_rank=True``: the positions are the ranks, and a
microbatch goes to each of its reading worker's T ranks), so that the global batch does not
depend on the T picked. With ``data_loading="per_replica"`` (``replicas`` set) every rank of a
data-parallel replica loads the replica's whole batch (torchtitan's and torch pipelining's
layout): the positions are the replicas, every rank holds the rows it reads, and rows move only
when a rank reads another replica's (the build's probe).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, TypeVar

from lightning_gsched.errors import StrategyConfigError
from lightning_gsched.schedule.replicas import ReplicaLayout

_T = TypeVar("_T")


@dataclass(frozen=True)
class Workers:
    """``ranks`` processes as workers of ``tensor_parallel_size`` consecutive ranks; ``rank``
    is this process's."""

    ranks: int
    rank: int
    tensor_parallel_size: int = 1
    rows_per_rank: bool = False  # see the module doc
    # data_loading="per_replica": where the replicas sit among the W / T workers (module doc)
    replicas: ReplicaLayout | None = None

    @property
    def count(self) -> int:
        """The plan's workers: W / T."""
        return self.ranks // self.tensor_parallel_size

    @property
    def worker(self) -> int:
        """This rank's worker: whose program it runs."""
        return self.rank // self.tensor_parallel_size

    @property
    def reports(self) -> bool:
        """Whether this rank reports its worker's losses, logs and outputs (``t = 0``)."""
        return self.rank % self.tensor_parallel_size == 0

    @property
    def positions(self) -> int:
        """How many batches the row arithmetic joins (:mod:`.rows`): one per worker, with
        ``rows_per_rank`` one per rank, with ``replicas`` one per replica."""
        if self.replicas is not None:
            return self.replicas.replicas
        return self.ranks if self.rows_per_rank else self.count

    def position_of(self, rank: int) -> int:
        """The position whose batch ``rank`` loaded."""
        if self.replicas is not None:
            return self.replicas.replica(rank // self.tensor_parallel_size)
        return rank if self.rows_per_rank else rank // self.tensor_parallel_size

    @property
    def position(self) -> int:
        """This rank's position among them: whose rows it loaded."""
        return self.position_of(self.rank)

    def members(self, workers: Sequence[int]) -> list[int]:
        """The positions of ``workers``' batches, in the order their rows are joined (a
        replica's workers: one position with ``replicas``)."""
        T = self.tensor_parallel_size
        if self.replicas is not None:
            return sorted({self.position_of(w * T) for w in workers})
        if not self.rows_per_rank:
            return list(workers)
        return [w * T + t for w in workers for t in range(T)]

    def by_position(self, per_worker: Sequence[Sequence[int]]) -> list[list[int]]:
        """Per-worker microbatch lists as one list per position: a worker's own, each of a
        worker's ranks its worker's with ``rows_per_rank``, with ``replicas`` the union over
        the replica's workers (each of its ranks holds every row of the replica)."""
        T = self.tensor_parallel_size
        if self.replicas is not None:
            union: list[set[int]] = [set() for _ in range(self.positions)]
            for w, micros in enumerate(per_worker):
                union[self.position_of(w * T)].update(micros)
            return [sorted(micros) for micros in union]
        if not self.rows_per_rank:
            return [list(micros) for micros in per_worker]
        return [list(per_worker[r // T]) for r in range(self.ranks)]

    def peers(self) -> list[int]:
        """The global rank of each position: whom rows go to and come from (per worker, its
        rank with this rank's tensor-parallel index; per replica, its rank at this rank's
        pipeline position and tensor-parallel index)."""
        if self.rows_per_rank:
            return list(range(self.ranks))
        T = self.tensor_parallel_size
        if self.replicas is not None:
            p = self.replicas.position(self.worker)
            return [self.replicas.rank(p, g) * T + self.rank % T
                    for g in range(self.replicas.replicas)]
        return [w * T + self.rank % T for w in range(self.count)]

    def one_each(self, per_rank: Sequence[_T]) -> list[_T]:
        """Per worker, its ``t = 0`` rank's entry of a list gathered over every rank."""
        return list(per_rank[::self.tensor_parallel_size])

    @property
    def shares_batches(self) -> bool:
        """Whether some ranks must have loaded one batch: a worker's T > 1 ranks (unless
        ``rows_per_rank``), a replica's ranks (``replicas``)."""
        if self.replicas is not None:
            return self.ranks > self.positions
        return self.tensor_parallel_size > 1 and not self.rows_per_rank

    def batch_rows(self, rows: Sequence[int], layouts: Sequence[int],
                   contents: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
        """Every position's rows and batch layout from every rank's: with ``rows_per_rank``
        each rank's own; else the ranks of a position (a worker's T ranks, or a replica's
        ranks) must have loaded the same batch (the front ends' samplers give them one share):
        the same rows, layouts and ``contents`` (each rank's ``content_fingerprint``; None:
        not compared), else a StrategyConfigError naming them. Why the values too: ranks
        given rows of the same sizes but other values (a sampler or dataset sharded by the
        global rank) would train each shard on other data, silently wrong."""
        if self.rows_per_rank:
            return list(rows), list(layouts)
        groups: list[list[int]] = [[] for _ in range(self.positions)]
        for r in range(self.ranks):
            groups[self.position_of(r)].append(r)
        for position, ranks in enumerate(groups):
            sizes = {(rows[r], layouts[r]) for r in ranks}
            values = {contents[r] for r in ranks} if contents is not None else set()
            if len(sizes) > 1 or len(values) > 1:
                what = (f"({[rows[r] for r in ranks]} rows)" if len(sizes) > 1 else
                        "(as many rows, other values)")
                raise StrategyConfigError(
                    f"the {self._position_name(position, ranks)} loaded different batches "
                    f"{what}: they compute on the same rows. Use the strategy's distributed "
                    "sampler (its distributed_sampler_kwargs give them one share: "
                    f"{self._share_text()}) or load the same rows on each of them")
        first = [ranks[0] for ranks in groups]
        return [rows[r] for r in first], [layouts[r] for r in first]

    def _position_name(self, position: int, ranks: Sequence[int]) -> str:
        if self.replicas is not None:
            return (f"ranks {list(ranks)} of data-parallel replica {position} "
                    "(data_loading='per_replica')")
        return (f"{self.tensor_parallel_size} tensor-parallel ranks {list(ranks)} of pipeline "
                f"worker {position}")

    def _share_text(self) -> str:
        if self.replicas is not None:
            return "num_replicas = G, rank = the rank's replica"
        return "num_replicas = W / T, rank = global rank // T"
