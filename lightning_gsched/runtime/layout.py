"""Which parameters go into which flat buffer, sanity checks, and the step's result type.

Every rank decides alike: the parameters of stage ``s`` (in ``stage.parameters()`` order) form
its flat buffer, except those several stages read (tied weights): they form one unit per *home*
stage (the lowest reading them), a tie, placed by the plan (``Programs.ties``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping, Protocol, Sequence

import torch
from torch import nn

from lightning_gsched.errors import RuntimeConfigError
from lightning_gsched.runtime.counters import RuntimeCounters
from lightning_gsched.runtime.flat import FlatStage
from lightning_gsched.schedule.consumption import OpRules
from lightning_gsched.schedule.program import BACKWARD_OPS, Action, Op, Programs


@dataclass
class StepResult:
    """One ``step()`` on one rank: ``{b: loss}`` (unscaled, detached) for the microbatches whose
    last stage ran here, and what this rank did."""

    losses: dict[int, torch.Tensor]
    counters: RuntimeCounters


class StageBuffers(Protocol):
    """The executor's stage buffers and their owners, as ownership and the full state read them
    (a Protocol: they need not import the executor)."""

    rank: int
    programs: Programs
    flats: list[FlatStage]
    ties: dict[int, FlatStage]  # tie home stage -> its unit


def micro_of(a: Action) -> int:
    """The microbatch of a compute or an activation / input-gradient message."""
    assert a.micro is not None, f"'{a}' names no microbatch"
    return a.micro


def peer_of(a: Action) -> int:
    """The other rank of a message action."""
    assert a.peer is not None, f"'{a}' names no peer"
    return a.peer


def stage_micros(programs: Programs, rank: int) -> tuple[list[int], list[int]]:
    """(microbatches whose first stage runs on ``rank``, those whose last stage runs there): the
    ``inputs`` it passes to ``step()``/``forward()``, and where ``loss_fn``/``output_fn`` run."""
    last = programs.num_stages - 1
    ran = [(a.stage, micro_of(a)) for a in programs.ranks[rank] if a.op is Op.F]
    return sorted(b for s, b in ran if s == 0), sorted(b for s, b in ran if s == last)


@dataclass(frozen=True)
class ProgramView:
    """One rank's program of a :class:`Programs` and what a run of it needs to know."""

    programs: Programs
    program: list[Action]
    first_stage_micros: list[int]
    last_stage_micros: list[int]
    local_forward: frozenset[tuple[int, int]]  # (stage, micro) forwards run on this rank
    local_backward: frozenset[tuple[int, int]]
    rules: OpRules  # what each compute reads and what ends a stash, as the dry run proves it

    @classmethod
    def of(cls, programs: Programs, rank: int) -> "ProgramView":
        program = programs.ranks[rank]
        return cls(programs, program, *stage_micros(programs, rank),
                   frozenset((a.stage, micro_of(a)) for a in program if a.op is Op.F),
                   frozenset((a.stage, micro_of(a)) for a in program if a.op is Op.B),
                   OpRules.of(programs))


def check_forward_programs(train: Programs, programs: Programs, rank: int | None = None) -> None:
    """``programs`` can run as forward-only programs on an executor built for ``train``. Planned
    programs are checked by their ``forward_only`` flag and ``rank``'s own program, without
    lowering the other ranks' (every rank decides alike); others are scanned whole."""
    fix = ("plan them with plan(<same schedule>, workers=W, stages=S, R=R, ties=..., "
           "forward_only=True), i.e. the schedule, W, S, R and ties of the executor's programs "
           "(the number of microbatches may differ)")
    if not isinstance(programs, Programs):
        raise RuntimeConfigError(
            f"forward() needs the Programs of a forward-only plan (plan(...).programs), got "
            f"{type(programs).__name__}; {fix}.")
    if programs.planned:
        if not programs.forward_only:
            raise RuntimeConfigError(
                "forward() runs forward-only programs, but these programs are a training "
                f"plan's (backward, input-gradient or gradient-reduction actions); {fix}.")
        scanned = [] if rank is None else [rank]
    else:
        scanned = list(range(len(programs.ranks)))
    for where in scanned:
        bad = next((a for a in programs.ranks[where] if a.op in BACKWARD_OPS), None)
        if bad is not None:
            raise RuntimeConfigError(
                f"forward() runs forward-only programs, but rank {where}'s program contains "
                f"'{bad}' (backward, input-gradient or gradient-reduction actions); {fix}.")
    mismatches = []
    if programs.world_size != train.world_size:
        mismatches.append(f"{programs.world_size} workers instead of {train.world_size}")
    if programs.num_stages != train.num_stages:
        mismatches.append(f"{programs.num_stages} stages instead of {train.num_stages}")
    elif [tuple(o) for o in programs.owners] != [tuple(o) for o in train.owners]:
        mismatches.append(f"stage owners {[list(o) for o in programs.owners]} instead of "
                          f"{[list(o) for o in train.owners]}")
    if sorted(programs.edges) != sorted(train.edges):
        mismatches.append(f"stage edges {programs.edges} instead of {train.edges}")
    if dict(programs.ties) != dict(train.ties):
        mismatches.append(f"ties {dict(programs.ties)} instead of {dict(train.ties)}")
    if mismatches:
        raise RuntimeConfigError(
            "the forward-only programs do not fit this executor's programs: "
            + "; ".join(mismatches) + f"; {fix}.")


def check_programs(stages: Sequence[nn.Module], programs: Programs) -> None:
    if len(stages) != programs.num_stages:
        raise RuntimeConfigError(
            f"the programs are for {programs.num_stages} stages but {len(stages)} stage modules "
            f"were given; partition the model into {programs.num_stages} stages or plan with "
            f"stages={len(stages)}.")
    if sorted(programs.edges) != [(s, s + 1) for s in range(programs.num_stages - 1)]:
        raise RuntimeConfigError(
            f"the runtime executes a chain of stages (stage s feeds s+1, as partition() "
            f"produces), but the programs' stage graph has edges {programs.edges}; plan without "
            "edges=.")


@dataclass(frozen=True)
class TieGroup:
    """Tied parameters whose home (lowest stage reading them) is ``home``; sorted ``readers``."""

    home: int
    readers: tuple[int, ...]
    params: list[nn.Parameter]


def split_parameters(stages: Sequence[nn.Module]
                     ) -> tuple[list[list[nn.Parameter]], list[TieGroup]]:
    """(each stage's own parameters, the ties): the one rule for both the runtime's buffers and
    ``measure.measure_stage_bytes``'s sizes."""
    per_stage = [list(dict.fromkeys(stage.parameters())) for stage in stages]
    readers: dict[int, list[int]] = {}  # in stage order: the first is the home
    for s, params in enumerate(per_stage):
        for p in params:
            readers.setdefault(id(p), []).append(s)
    own = [[p for p in params if len(readers[id(p)]) == 1] for params in per_stage]
    groups: dict[int, list[nn.Parameter]] = {}
    for p in {id(p): p for params in per_stage for p in params if len(readers[id(p)]) > 1}.values():
        groups.setdefault(readers[id(p)][0], []).append(p)
    return own, [TieGroup(home, tuple(sorted({s for p in ps for s in readers[id(p)]})), ps)
                 for home, ps in sorted(groups.items())]


def tie_map(stages: Sequence[nn.Module]) -> dict[int, tuple[int, ...]]:
    """``{home: readers}`` of the stages' tied parameters, for ``plan(..., ties=)``."""
    return {g.home: g.readers for g in split_parameters(stages)[1]}


def check_ties(stages: Sequence[nn.Module], programs: Programs) -> None:
    """The programs place exactly the ties the stages have (else tied weights have no owner)."""
    found = tie_map(stages)
    if found != dict(programs.ties):
        raise RuntimeConfigError(
            f"the stages share parameters (tied weights) as {found} (home stage: reader "
            f"stages), but the programs were planned with ties {dict(programs.ties)}; plan with "
            f"ties={found} (e.g. plan(..., ties=partition(...).shared_parameters.values())) so "
            "that the plan places them.")


def weight_units(programs: Programs, flats: Sequence[FlatStage],
                 ties: Mapping[int, FlatStage]) -> list[tuple[tuple[int, ...], FlatStage]]:
    """Every stage buffer and tie unit with its owners (a tie's are its home stage's), in the
    same order on every rank (stages, then ties by home), for collectives over all units."""
    owners = programs.owners
    return ([(tuple(owners[s]), flat) for s, flat in enumerate(flats)]
            + [(tuple(owners[h]), unit) for h, unit in sorted(ties.items())])


def build_flat_stages(stages: Sequence[nn.Module], owned: Collection[int],
                      owned_ties: Collection[int] = (),
                      ) -> tuple[list[FlatStage], dict[int, FlatStage], torch.device]:
    """One :class:`FlatStage` per stage, one per tie (``{home: unit}``), and the device of the
    tensors with storage (a deferred model's other ranks' parameters are on ``meta``)."""
    own, ties = split_parameters(stages)
    tensors = [*(p for stage in stages for p in stage.parameters()),
               *(b for stage in stages for b in stage.buffers())]
    device = next((t.device for t in tensors if not t.is_meta), torch.device("cpu"))
    flats = [FlatStage(s, params, owned=s in owned, device=device) for s, params in enumerate(own)]
    units = {g.home: FlatStage(g.home, g.params, g.home in owned_ties, "tie", device) for g in ties}
    return flats, units, device
