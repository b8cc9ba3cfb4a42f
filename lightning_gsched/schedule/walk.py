"""One walker over every rank's program, for replays whose actions take time (:mod:`.predict`).

The walker owns the order of execution and the waiting: a :class:`Handler` says, per op kind,
what an action does and, if it cannot run yet, which key it waits on (None: done); whoever makes
a key true calls :meth:`Walker.wake`. The result does not depend on the interleaving.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Callable, Hashable, Protocol

from lightning_gsched.schedule.program import OPS, Action, Programs


class Handler(Protocol):
    """What a walk does for each kind of action."""

    def compute(self, rank: int, action: Action) -> Hashable | None: ...
    def send(self, rank: int, action: Action) -> Hashable | None: ...
    def recv(self, rank: int, action: Action) -> Hashable | None: ...
    def free(self, rank: int, action: Action) -> Hashable | None: ...
    def collective(self, rank: int, action: Action) -> Hashable | None: ...


class Walker:
    """Runs every rank's program with a handler; ranks wait on keys until woken."""

    def __init__(self, programs: Programs) -> None:
        programs.ranks.make_all()  # walks every rank: the full lowering at once
        self.programs = programs
        self.pc = [0] * programs.world_size
        self._waiters: dict[Hashable, list[int]] = defaultdict(list)
        self._runnable: deque[int] = deque(range(programs.world_size))
        self._queued = set(range(programs.world_size))

    def wake(self, key: Hashable) -> None:
        """``key`` became true: ranks waiting on it may go on."""
        for rank in self._waiters.pop(key, ()):
            if rank not in self._queued:
                self._queued.add(rank)
                self._runnable.append(rank)

    def run(self, handler: Handler, on_end: Callable[[int], None] | None = None) -> list[int]:
        """Walk until no rank can move; return the unfinished ranks (``on_end``: at each finish)."""
        table = {op: getattr(handler, spec.kind) for op, spec in OPS.items()}  # resolved once
        ranks, pc, runnable = self.programs.ranks, self.pc, self._runnable
        waiters, queued = self._waiters, self._queued
        while runnable:
            rank = runnable.popleft()
            queued.discard(rank)
            program, i = ranks[rank], pc[rank]
            end = len(program)
            while i < end:
                action = program[i]
                key = table[action[0]](rank, action)
                if key is not None:
                    waiters[key].append(rank)
                    break
                i += 1
                pc[rank] = i  # handlers read the position (errors name the action)
            if i == end and on_end is not None:
                on_end(rank)
        return [r for r in range(len(ranks)) if pc[r] < len(ranks[r])]
