"""Ranks as the plan's workers: with tensor parallelism a worker is T consecutive ranks.

Why a module of its own: the engine's collectives span every rank, while the pipeline it runs
(the programs, the batch's rows, the start-up rows, the losses) is the workers'. Rank
``w * T + t`` runs worker ``w``'s program on its shards (``t``: its tensor-parallel index); the
rows it reads come from the same ``t`` of the worker that loaded them; of a worker's T ranks,
which compute the same losses, logged values and outputs, only ``t = 0`` reports them. With
``T = 1`` every rank is its own worker and all of this is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, TypeVar

from lightning_gsched.errors import StrategyConfigError

_T = TypeVar("_T")


@dataclass(frozen=True)
class Workers:
    """``ranks`` processes as workers of ``tensor_parallel_size`` consecutive ranks; ``rank``
    is this process's."""

    ranks: int
    rank: int
    tensor_parallel_size: int = 1

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

    def peers(self) -> list[int]:
        """Each worker's rank with this rank's tensor-parallel index: whom rows go to and
        come from."""
        T = self.tensor_parallel_size
        return [w * T + self.rank % T for w in range(self.count)]

    def one_each(self, per_rank: Sequence[_T]) -> list[_T]:
        """Per worker, its ``t = 0`` rank's entry of a list gathered over every rank."""
        return list(per_rank[::self.tensor_parallel_size])

    def batch_rows(self, rows: Sequence[int], layouts: Sequence[int]
                   ) -> tuple[list[int], list[int]]:
        """Every worker's rows and batch layout from every rank's: a worker's T ranks must
        have loaded the same batch (the front ends' samplers give them one share), else a
        StrategyConfigError naming them."""
        T = self.tensor_parallel_size
        for w in range(self.count):
            ranks = range(w * T, w * T + T)
            if len({(rows[r], layouts[r]) for r in ranks}) > 1:
                raise StrategyConfigError(
                    f"the {T} tensor-parallel ranks {list(ranks)} of pipeline worker {w} loaded "
                    f"different batches ({[rows[r] for r in ranks]} rows): a worker's ranks "
                    "compute on the same rows. Use the strategy's distributed sampler (its "
                    "distributed_sampler_kwargs give them one share) or load the same rows on "
                    "each of them")
        return self.one_each(rows), self.one_each(layouts)
