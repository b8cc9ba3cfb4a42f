"""Which of a module's parameters this rank holds, updates, and counts once over all ranks.

* stage parameters: in one stage's flat buffer, held and updated by the stage's owners (all
  replicas), counted on the stage's first owner;
* tied parameters (read by several stages): in one tie unit per home stage, held, updated and
  counted as that stage's are (other ranks computing a reader stage fetch it);
* extra parameters: trainable parameters no stage reads but the step does (a loss module, a head
  applied after the model's call): they get gradients on the ranks that finish microbatches, so
  the hand-over sums them over all ranks; counted on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_gsched.runtime.layout import StageBuffers


@dataclass(frozen=True)
class Ownership:
    """The parameter split of one rank (see the module docstring)."""

    stages: dict[int, list[nn.Parameter]]  # owned stage -> its parameters that take gradients
    ties: dict[int, list[nn.Parameter]]  # owned tie (home stage) -> its params taking gradients
    extra: list[nn.Parameter]  # the module's trainable parameters no stage reads
    in_stages: list[nn.Parameter]  # every stage and tie buffer's parameters, owned here or not
    primary: list[nn.Parameter]  # counted (norm) and written (checkpoints) by this rank
    owned: list[nn.Parameter]  # updated by this rank: optimizer state is kept for these only
    # written to a sharded checkpoint by this rank: ``primary`` and the frozen parameters of
    # the same units (no gradient, so in no FlatGrads, but state all the same)
    written: list[nn.Parameter]

    @classmethod
    def of(cls, holder: StageBuffers, module: nn.Module) -> "Ownership":
        rank, owners = holder.rank, holder.programs.owners
        stages = {s: list(holder.flats[s].grads.params)
                  for s in sorted(holder.programs.owned_stages(rank))}
        ties = {h: list(holder.ties[h].grads.params) for h in holder.programs.owned_ties(rank)}
        in_stages = [p for flat in [*holder.flats, *holder.ties.values()] for p in flat.params]
        known = {id(p) for p in in_stages}
        extra = [p for p in module.parameters() if p.requires_grad and id(p) not in known]
        # the units this rank owns first (a tie's owners are its home stage's): it counts their
        # trainable parameters and writes all of theirs, rank 0 the extra ones too
        first = [holder.flats[s] for s in stages if owners[s][0] == rank] + [
            holder.ties[h] for h in ties if owners[h][0] == rank]
        beside = extra if rank == 0 else []
        primary = [p for unit in first for p in unit.grads.params] + beside
        written = [p for unit in first for p in unit.params] + beside
        owned = [p for params in [*stages.values(), *ties.values()] for p in params] + extra
        return cls(stages, ties, extra, in_stages, primary, owned, written)
