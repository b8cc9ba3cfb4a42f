"""Jobs and their dependencies: the seed's ``pred``/``succ`` over (stage, microbatch, phase),
derived from a :class:`StageGraph` (a DAG of stages fits the same scheduler). With a split backward
(zero-bubble schedules) ``B s b`` computes only the input gradient, which the previous stage waits
for, and ``W s b`` (the weight gradient) follows it with no successor, to fill any later bubble."""

from __future__ import annotations

from enum import Enum
from typing import Iterable, Iterator, NamedTuple, Sequence

from lightning_gsched.errors import ScheduleConfigError


class Phase(str, Enum):
    """``str``: text forms and JSON output stay short."""

    F = "F"
    B = "B"
    W = "W"  # weight-gradient half of a split backward (zero-bubble schedules)

    def __str__(self) -> str:
        return self.value


class Job(NamedTuple):
    stage: int
    micro: int
    phase: Phase

    def __str__(self) -> str:
        return f"{self.phase.value} s{self.stage} b{self.micro}"


class StageGraph:
    """Which stages feed which: ``edges`` (producer, consumer) with producer < consumer (stages
    in topological order, as the partitioner numbers them); default the chain 0 -> ... -> S-1.
    Sinks compute the loss, so their backward starts from their own forward. ``forward_only``
    (validation, test, predict): only F jobs, a sink's forward ends the microbatch."""

    def __init__(self, num_stages: int, edges: Iterable[tuple[int, int]] | None = None,
                 forward_only: bool = False, split_backward: bool = False) -> None:
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ScheduleConfigError(f"num_stages must be a positive integer, got {num_stages!r}")
        self.num_stages = num_stages
        self.forward_only = bool(forward_only)
        self.split_backward = bool(split_backward) and not self.forward_only
        self.phases: tuple[Phase, ...] = phases_of(self.forward_only, self.split_backward)
        chain = edges is None
        edges = [(s, s + 1) for s in range(num_stages - 1)] if edges is None else edges
        self._inputs: list[list[int]] = [[] for _ in range(num_stages)]
        self._outputs: list[list[int]] = [[] for _ in range(num_stages)]
        for u, v in edges:
            if not (0 <= u < v < num_stages):
                raise ScheduleConfigError(
                    f"stage edge ({u}, {v}) is invalid: edges must satisfy 0 <= producer < "
                    f"consumer < {num_stages} (number stages in topological order)")
            self._inputs[v].append(u)
            self._outputs[u].append(v)
        self.is_chain = chain or all(self._outputs[s] == [s + 1] for s in range(num_stages - 1)) \
            and sum(map(len, self._outputs)) == num_stages - 1

    def inputs(self, stage: int) -> Sequence[int]:
        return self._inputs[stage]

    def outputs(self, stage: int) -> Sequence[int]:
        return self._outputs[stage]

    def pred(self, job: Job) -> list[Job]:
        """Jobs that must finish before ``job`` may start."""
        s, b, d = job
        if d is Phase.F:
            return [Job(p, b, Phase.F) for p in self._inputs[s]]
        if d is Phase.B and not self.forward_only:
            consumers = self._outputs[s]
            return [Job(c, b, Phase.B) for c in consumers] if consumers else [Job(s, b, Phase.F)]
        if d is Phase.W and self.split_backward:
            return [Job(s, b, Phase.B)]
        raise ScheduleConfigError(self._no_phase(d))

    def succ(self, job: Job) -> list[Job]:
        """Inverse of :meth:`pred`."""
        s, b, d = job
        if d is Phase.F:
            if not self._outputs[s]:
                return [] if self.forward_only else [Job(s, b, Phase.B)]
            return [Job(c, b, Phase.F) for c in self._outputs[s]]
        if d is Phase.B and not self.forward_only:
            inputs = [Job(p, b, Phase.B) for p in self._inputs[s]]
            return [*inputs, Job(s, b, Phase.W)] if self.split_backward else inputs
        if d is Phase.W and self.split_backward:
            return []
        raise ScheduleConfigError(self._no_phase(d))

    def _no_phase(self, d: Phase) -> str:
        return (f"a forward-only graph has no {d.value} jobs" if self.forward_only
                else f"phase {d} exists only in a graph with split_backward=True")

    def all_jobs(self, num_micro: int) -> Iterator[Job]:
        return all_jobs(self.num_stages, num_micro, self.forward_only, self.split_backward)


def weight_grad_phase(split_backward: bool) -> Phase:
    """The job that ends a backward: it accumulates the stage's weight gradients and releases
    the stash of its (stage, microbatch). W when the backward is split, else B."""
    return Phase.W if split_backward else Phase.B


def phases_of(forward_only: bool = False, split_backward: bool = False) -> tuple[Phase, ...]:
    """The phases of every (stage, microbatch): F; F, B; or F, B, W."""
    return (Phase.F,) if forward_only else (Phase.F, Phase.B, Phase.W)[:3 if split_backward else 2]


def all_jobs(num_stages: int, num_micro: int, forward_only: bool = False,
             split_backward: bool = False) -> Iterator[Job]:
    """Every job, stage-major."""
    phases = phases_of(forward_only, split_backward)
    return (Job(s, b, d) for s in range(num_stages) for b in range(num_micro) for d in phases)
