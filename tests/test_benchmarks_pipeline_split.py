"""The ``pipeline_vs_torch`` split rebuild (no timing): torch's stages are exactly our stages.

The benchmark's ratio only means something if the torch anchor runs the same S stages as our
partitioner: the same parameter objects per stage, handing the same values over each cut. These
tests check that at S=2 and S=4 against the partition computed here, and that a cut the plain
block-level modules cannot follow (inside a block, or between a block's last linear layer and
its residual add) is refused instead of silently benchmarking a different split.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_pipeline import MICROBATCHES, ROWS, WORLD  # noqa: E402
from benchmarks.model import BenchLit, GPTShape  # noqa: E402
from benchmarks.pipeline_split import (  # noqa: E402
    SplitMismatchError,
    block_cuts,
    describe,
    local_stages,
    stage_modules,
    stage_split,
)
from lightning_gsched.partition import partition  # noqa: E402
from lightning_gsched.schedule.plan import plan  # noqa: E402

SHAPE = GPTShape()
MICRO_ROWS = 4


def _example() -> torch.Tensor:
    return torch.randint(0, SHAPE.vocab, (MICRO_ROWS, SHAPE.seq),
                         generator=torch.Generator().manual_seed(3))


def _block_parameters(model: BenchLit) -> list[str]:
    return [name for name, _ in model.core.blocks[0].named_parameters()]


@pytest.mark.parametrize("stages", [2, 4])
def test_rebuilt_stages_hold_our_parameters_and_hand_over_our_values(stages):
    split = stage_split(SHAPE, stages, MICRO_ROWS)
    model = BenchLit(SHAPE.as_dict())
    ours = partition(model, stages, (_example(),), {})
    theirs = stage_modules(model.core, split["cuts"])
    assert len(theirs) == stages == len(ours.stages)
    for k, (our_stage, torch_stage) in enumerate(zip(ours.stages, theirs, strict=True)):
        # the very same tensors, not equal copies: one optimizer step moves both sides alike
        assert {id(p) for p in our_stage.parameters()} == \
               {id(p) for p in torch_stage.parameters()}, f"stage {k}"
    x = _example()
    with torch.no_grad():
        carried, h = (x,), x
        for k, (our_stage, torch_stage) in enumerate(zip(ours.stages, theirs, strict=True)):
            out = our_stage(*carried) if k == 0 else our_stage(carried)
            h = torch_stage(h)
            ours_value = out if k == stages - 1 else out[0]
            if k < stages - 1:
                assert len(out) == 1
            # same ops on the same tensors in one process, in the same order: bit-identical
            assert torch.equal(ours_value, h), f"value after stage {k}"
            carried = out
        assert torch.equal(h, model.core(x))


def test_default_splits_are_the_documented_ones():
    # the benchmark's docstring and docs/benchmarks.md state these splits
    assert describe(stage_split(SHAPE, 2, MICRO_ROWS)["cuts"], SHAPE.layers) == \
        "wte+wpe+blocks[0:2] | blocks[2:4]+ln_f+head"
    assert describe(stage_split(SHAPE, 4, MICRO_ROWS)["cuts"], SHAPE.layers) == \
        "wte+wpe+blocks[0:1] | blocks[1:2] | blocks[2:3] | blocks[3:4]+ln_f+head"


@pytest.mark.parametrize("cut_before, message", [
    ("core.blocks.1.fc", "cuts inside block 1"),       # splits block 1's parameters
    ("add_4", "carries ['add_3', 'core_blocks_1_out']"),  # whole blocks, but two values cross
])
def test_a_cut_the_anchor_cannot_follow_is_refused(cut_before, message):
    model = BenchLit(SHAPE.as_dict())
    part = partition(model, 2, (_example(),), {}, split_points=[cut_before])
    with pytest.raises(SplitMismatchError, match=message.replace("[", r"\[")):
        block_cuts(part.stage_parameter_names, part.boundary_names, SHAPE.layers,
                   _block_parameters(model))


def test_local_stages_follow_the_loop_and_v_placements():
    assert [local_stages("loop", r, 2, 2) for r in range(2)] == [[0], [1]]
    assert [local_stages("v", r, 2, 4) for r in range(2)] == [[0, 3], [1, 2]]
    assert [local_stages("v", r, 4, 8) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    with pytest.raises(ValueError, match="S=2W"):
        local_stages("v", 0, 2, 2)


@pytest.mark.parametrize("name", sorted(ROWS))
def test_each_row_places_stages_where_our_library_does(name):
    # the anchor must hold the same stage modules on the same ranks as our run of the schedule
    row = ROWS[name]
    programs = plan(row.schedule, workers=WORLD, microbatches=MICROBATCHES).programs
    assert programs.num_stages == row.stages
    held = [sorted(s for s, owners in enumerate(programs.owners) if rank in owners)
            for rank in range(WORLD)]
    assert held == [local_stages(row.placement, r, WORLD, row.stages) for r in range(WORLD)]


def test_at_torchs_peaks_our_interleaved_order_is_torchs() -> None:
    """The premise of bench_engine's ``[interleaved, torch's peak]`` side: with each rank's cap
    at the most microbatch-stages torch's Interleaved1F1B holds there, our planner orders every
    rank's forwards and backwards exactly as torch's hand-written schedule (read from torch
    itself). At the row's shape our default cap (S + 1) gives that order too, so the side is
    not added; at S itself (the default before) rank 0's order differs."""
    from benchmarks.bench_engine import our_orders, torch_order_caps, torch_orders, torch_peaks
    from benchmarks.bench_pipeline import ROWS

    theirs = torch_orders("interleaved")
    assert our_orders("interleaved", cap=torch_peaks("interleaved")) == theirs
    assert our_orders("interleaved") == theirs
    stages = ROWS["interleaved"].stages
    at_s = our_orders("interleaved", cap=[stages] * len(theirs))
    assert at_s[0] != theirs[0] and at_s[1:] == theirs[1:]
    assert torch_order_caps("interleaved") is None
