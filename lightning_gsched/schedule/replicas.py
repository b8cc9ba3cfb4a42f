"""Where the G replicas of a P-worker schedule sit among the W = P x G ranks: the one renaming
(position ``p``, replica ``g``) -> rank that the planner, the lowering and the engine agree on.
Pipeline-major (the default), ``rank = p * G + g`` as torchtitan's ``["pp", "dp"]`` mesh: a stage's
G ranks are contiguous, so its gradient all-reduce or weight fetches stay inside a node and only the
pipeline's messages cross nodes. Else ``rank = g * P + p``, a replica contiguous, as the looped
family (lpp, fslpp, ddp, fsdp) numbers its groups (``LPP.h(s, b) = R * (b mod G) + s mod R``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLayout:
    pipeline: int  # P: workers of one replica
    replicas: int  # G
    pipeline_major: bool = True

    @property
    def workers(self) -> int:
        return self.pipeline * self.replicas

    def rank(self, position: int, replica: int) -> int:  # position: a P-worker schedule's worker
        major = self.pipeline_major
        return position * self.replicas + replica if major else replica * self.pipeline + position

    def position(self, rank: int) -> int:  # the rank's worker in the P-worker schedule
        return rank // self.replicas if self.pipeline_major else rank % self.pipeline

    def replica(self, rank: int) -> int:
        return rank % self.replicas if self.pipeline_major else rank // self.pipeline

    def members(self, replica: int) -> list[int]:  # the replica's ranks, by position
        return [self.rank(p, replica) for p in range(self.pipeline)]

    def column(self, position: int) -> list[int]:  # the position's ranks, by replica
        return [self.rank(position, g) for g in range(self.replicas)]
