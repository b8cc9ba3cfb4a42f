"""The ``pipeline_vs_torch`` split: our partitioner's S stages, rebuilt as plain modules for torch.

Why rebuild instead of handing torch our ``StageModule``\\ s: the anchor must be what a torch user
writes (plain ``nn.Module`` stages around ``GPTCore``'s own submodules), so that the row measures
our runtime against torch's, not our stage modules inside torch's runtime. Why ask our
partitioner at all: both sides must run the *same* split, and ours is whatever
:func:`lightning_gsched.partition.partition` chooses at S stages with the default ``"params"``
balance (deterministic, so the parent process computes the cut every rank of our runs makes).

The rebuild is exact only when every cut falls between two blocks of ``GPTCore.blocks`` (or
between the embeddings and the first block, or the last block and ``ln_f``). :func:`stage_split`
checks that from the partition itself and raises :class:`SplitMismatchError` otherwise:

* every block's parameters lie in one stage (a cut inside a block splits its parameters);
* stage k's parameter names are exactly those of its blocks, plus ``wte``/``wpe`` on stage 0 and
  ``ln_f``/``head`` on the last stage;
* one value crosses each boundary (a cut between a block's last linear layer and its residual
  ``add`` keeps the parameter sets of whole blocks but hands over two tensors).
"""

from __future__ import annotations

from typing import Any, Sequence

EMBEDDINGS = ("core.wte.weight", "core.wpe.weight")
HEAD = ("core.ln_f.weight", "core.ln_f.bias", "core.head.weight")


class SplitMismatchError(RuntimeError):
    """Our partitioner cut the benchmark GPT where plain block-level modules cannot follow."""


def block_cuts(stage_parameter_names: Sequence[Sequence[str]],
               boundary_names: Sequence[Sequence[str]], layers: int,
               block_parameters: Sequence[str]) -> list[int]:
    """The first block of every stage after the first (``len == S - 1``), checked (see module doc).

    ``block_parameters``: one block's parameter names relative to the block (``ln1.weight``...).
    """
    stages = len(stage_parameter_names)
    stage_of: dict[str, int] = {}
    for k, names in enumerate(stage_parameter_names):
        for name in names:
            stage_of[name] = k
    where = []
    for i in range(layers):
        held = {stage_of.get(f"core.blocks.{i}.{name}") for name in block_parameters}
        if len(held) != 1 or None in held:
            raise SplitMismatchError(
                f"our partitioner cuts inside block {i} of the benchmark GPT (its parameters lie "
                f"in stages {sorted(k for k in held if k is not None)}), so the torch anchor, "
                "built from whole blocks, cannot run the same split; choose a stage count whose "
                "balanced cuts fall between blocks"
            )
        where.append(held.pop())
    cuts = [sum(1 for k in where if k < stage) for stage in range(1, stages)]
    bounds = [0, *cuts, layers]
    for k, names in enumerate(stage_parameter_names):
        want = {f"core.blocks.{i}.{name}" for i in range(bounds[k], bounds[k + 1])
                for name in block_parameters}
        want |= set(EMBEDDINGS) if k == 0 else set()
        want |= set(HEAD) if k == stages - 1 else set()
        if set(names) != want:
            raise SplitMismatchError(
                f"stage {k} of our partition holds {sorted(set(names) ^ want)} where whole blocks "
                f"[{bounds[k]}:{bounds[k + 1]}] (plus embeddings on the first stage, ln_f and "
                "head on the last) would not, or the reverse; the torch anchor cannot rebuild it"
            )
    for k, values in enumerate(boundary_names):
        if len(values) != 1:
            raise SplitMismatchError(
                f"the boundary after stage {k} carries {list(values)}, not one block output: "
                "the cut falls inside a block, which the torch anchor cannot rebuild"
            )
    return cuts


def stage_split(shape: Any, stages: int, micro_rows: int) -> dict[str, Any]:
    """Where our partitioner cuts ``BenchLit(shape)`` into ``stages`` stages, as block indices.

    Partitions on one microbatch of ``micro_rows`` rows, as our runs do at their first batch.
    Returns ``cuts`` (:func:`block_cuts`), ``stage_params`` (elements per stage) and
    ``boundary`` (the traced names of the values handed over).
    """
    import torch

    from benchmarks.model import BenchLit
    from lightning_gsched.partition import partition

    model = BenchLit(shape.as_dict())
    example = torch.zeros(micro_rows, shape.seq, dtype=torch.long)
    part = partition(model, stages, (example,), {})
    per_block = [name for name, _ in model.core.blocks[0].named_parameters()]
    cuts = block_cuts(part.stage_parameter_names, part.boundary_names, shape.layers, per_block)
    return {"cuts": cuts, "stage_params": part.stage_param_counts,
            "boundary": [list(names) for names in part.boundary_names]}


def describe(cuts: Sequence[int], layers: int) -> str:
    """The split as text, e.g. ``wte+wpe+blocks[0:2] | blocks[2:4]+ln_f+head``."""
    bounds = [0, *cuts, layers]
    parts = []
    for k in range(len(bounds) - 1):
        text = f"blocks[{bounds[k]}:{bounds[k + 1]}]"
        if k == 0:
            text = "wte+wpe+" + text
        if k == len(bounds) - 2:
            text += "+ln_f+head"
        parts.append(text)
    return " | ".join(parts)


def stage_modules(core: Any, cuts: Sequence[int]) -> list[Any]:
    """``GPTCore`` as ``len(cuts) + 1`` plain modules over its own submodules (no copies).

    Stage 0 embeds the tokens and runs ``blocks[:cuts[0]]``; stage k runs
    ``blocks[cuts[k-1]:cuts[k]]``; the last stage also applies ``ln_f`` and ``head``. Chained, they
    compute ``core.forward``.
    """
    import torch.nn as nn

    blocks = list(core.blocks)
    bounds = [0, *cuts, len(blocks)]

    class Stage(nn.Module):
        def __init__(self, k: int) -> None:
            super().__init__()
            self.first, self.last = k == 0, k == len(bounds) - 2
            if self.first:
                self.wte, self.wpe = core.wte, core.wpe
                self.register_buffer("positions", core.positions, persistent=False)
            self.blocks = nn.Sequential(*blocks[bounds[k]:bounds[k + 1]])
            if self.last:
                self.ln_f, self.head = core.ln_f, core.head

        def forward(self, x: Any) -> Any:
            if self.first:
                x = self.wte(x) + self.wpe(self.positions)
            x = self.blocks(x)
            return self.head(self.ln_f(x)) if self.last else x

    return [Stage(k) for k in range(len(bounds) - 1)]


def local_stages(placement: str, rank: int, world: int, stages: int) -> list[int]:
    """The stage indices rank ``rank`` holds: ``"loop"`` (s on rank s mod W) or ``"v"`` (r, 2W-1-r).

    These are the placements of our ``gpipe``/``1f1b``/``zb-h1`` (S = W) and ``zbv`` (S = 2W)
    and of torch's default and ``style="v"`` stage-to-rank mappings.
    """
    if placement == "loop":
        return list(range(rank, stages, world))
    if placement == "v":
        if stages != 2 * world:
            raise ValueError(f"a V placement holds 2 stages per rank: S=2W, got S={stages}, "
                             f"W={world}")
        return [rank, stages - 1 - rank]
    raise ValueError(f"unknown placement {placement!r}; 'loop' or 'v'")
