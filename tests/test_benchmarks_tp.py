"""The ``tp_vs_lightning_model_parallel`` row's premises (no timing, no processes).

The row (``benchmarks/bench_tp.py``) claims to compare both strategies on the benchmark GPT
with one plan. These check what that rests on: the shardable GPT computes what the fused one
computes (the split is only a re-labelling of the same weights), both sides' plans name the same
layers, every one of them a ``Linear`` whose sharded size T divides, our strategy accepts the
plan, and the peak figures are read per rank as the notes say.
"""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_tp import STYLES, T, ours_strategy, peak_figures, plan  # noqa: E402
from benchmarks.model import BenchLit, Block, GPTShape, ShardableBlock, build_core  # noqa: E402


def test_shardable_block_is_the_fused_block_with_qkv_split() -> None:
    shape = GPTShape(dim=32, heads=4, seq=8)
    torch.manual_seed(0)
    fused, split = Block(shape.dim, shape.heads), ShardableBlock(shape.dim, shape.heads)
    state = {k: v for k, v in fused.state_dict().items() if not k.startswith("qkv.")}
    for name, weight in zip("qkv", fused.qkv.weight.chunk(3), strict=True):
        state[f"{name}.weight"] = weight
    for name, bias in zip("qkv", fused.qkv.bias.chunk(3), strict=True):
        state[f"{name}.bias"] = bias
    split.load_state_dict(state)
    x = torch.randn(2, shape.seq, shape.dim)
    torch.testing.assert_close(split(x), fused(x))


def test_default_core_is_unchanged_by_the_option() -> None:
    """Every other row builds ``shardable=False``: the same modules and parameter count."""
    core, shardable = build_core(GPTShape()), build_core(GPTShape(), shardable=True)
    assert all(isinstance(b, Block) for b in core.blocks)
    assert sum(p.numel() for p in core.parameters()) == sum(
        p.numel() for p in shardable.parameters())


def test_both_plans_name_the_same_linears_that_t_divides() -> None:
    ours, theirs = ours_strategy()["tensor_parallel_plan"], plan()
    assert ours == {f"core.{k}": v for k, v in theirs.items()}
    modules = dict(BenchLit(shardable=True).named_modules())
    for pattern, style in ours.items():
        hits = [m for n, m in modules.items() if fnmatch.fnmatchcase(n, pattern)]
        assert len(hits) == GPTShape().layers, pattern  # one per block
        for layer in hits:
            assert isinstance(layer, nn.Linear)
            size = layer.out_features if style == "colwise" else layer.in_features
            assert size % T == 0, (pattern, size)
    assert set(STYLES.values()) == {"colwise", "rowwise"}


def test_ours_strategy_is_accepted() -> None:
    from benchmarks.lit_runs import make_strategy

    strategy = make_strategy(ours_strategy(), 2)
    assert strategy.tensor_parallel_plan is not None


def test_peak_figures_take_each_ranks_median_over_rounds_then_the_worst_rank() -> None:
    mib = 2**20
    ours = [[3 * mib, 5 * mib], [9 * mib, 5 * mib], [3 * mib, 6 * mib]]  # [round][rank]
    anchor = [[4 * mib, 4 * mib], [4 * mib, 1 * mib], [4 * mib, 4 * mib]]
    figures = peak_figures(ours, anchor)
    assert figures == {"peak_bytes_ours_anchor": [[3 * mib, 4 * mib], [5 * mib, 4 * mib]],
                       "peak_ratio": 1.25, "peak_goal_met": False}
    assert peak_figures([[mib]], [[mib]])["peak_goal_met"]


def test_memory_tp_rows_are_the_w2_pipeline_on_two_ranks_per_worker() -> None:
    """``memory[<schedule>+tp2]`` (``bench_memory.tp_rows``): this row's plan, 2P microbatches
    per step, T=2, and a plan valid at W=4 (the launch would otherwise fail at the first batch)."""
    from benchmarks.bench_memory import PP, TP, TP_FULL, TP_QUICK, tp_rows
    from lightning_gsched import GeneralParallel
    from lightning_gsched.schedule.plan import plan as schedule_plan

    rows = tp_rows(TP_FULL)
    assert list(rows) == ["1f1b+tp2", "zbv+tp2"] and set(TP_QUICK) <= set(TP_FULL)
    for keywords in rows.values():
        assert keywords["tensor_parallel_plan"] == ours_strategy()["tensor_parallel_plan"]
        assert keywords["tensor_parallel_size"] == TP == T and keywords["microbatches"] == 2 * PP
        schedule_plan(keywords["schedule"], workers=PP * TP,
                      microbatches=keywords["microbatches"], tensor_parallel_size=TP)
        assert GeneralParallel(**keywords).tensor_parallel_plan is not None


def test_sequence_plan_names_the_norms_linears_and_end_blocks_of_the_core() -> None:
    """``bench_tp.sequence_plan`` (the ``memory[...+sp]`` rows, ``check_3d --sequence``): every
    pattern names modules of the benchmark GPT under the LightningModule, the column-wise layers
    gather the sequence and the row-wise ones scatter it, and the last block is the one whose
    output is joined."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    from benchmarks.bench_tp import sequence_plan
    from lightning_gsched.partition.sequence_input import SequenceInput
    from lightning_gsched.partition.tensor_parallel import style_of

    layers = GPTShape().layers
    styles = {k: style_of(v, k) for k, v in sequence_plan("core.", layers).items()}
    modules = dict(BenchLit(shardable=True).named_modules())
    for pattern, style in styles.items():
        hits = [n for n in modules if fnmatch.fnmatchcase(n, pattern)]
        assert hits, pattern
        if isinstance(style, SequenceParallel):
            assert all(isinstance(modules[n], nn.LayerNorm) for n in hits)
        if isinstance(style, ColwiseParallel):
            assert STYLES[pattern.rsplit(".", 1)[1]] == "colwise"
            assert style.input_layouts == (Shard(1),)
        if isinstance(style, RowwiseParallel):
            assert STYLES[pattern.rsplit(".", 1)[1]] == "rowwise"
            assert style.output_layouts == (Shard(1),)
    assert isinstance(styles["core.blocks.0"], SequenceInput)
    assert isinstance(styles[f"core.blocks.{layers - 1}"], PrepareModuleOutput)
    assert f"core.blocks.{layers}" not in modules


def test_memory_sp_rows_are_the_tp_rows_with_the_sequence_plan() -> None:
    import json

    from benchmarks.bench_memory import TP_FULL, sp_rows, tp_rows
    from benchmarks.bench_tp import sequence_plan
    from lightning_gsched import GeneralParallel

    tp, sp = tp_rows(TP_FULL), sp_rows(TP_FULL)
    assert list(sp) == [f"{label}+sp" for label in tp]
    for label, keywords in tp.items():
        row = sp[f"{label}+sp"]
        assert row == {**keywords, "tensor_parallel_plan": sequence_plan("core."),
                       "leaf_modules": ["ShardableBlock"]}
        assert json.loads(json.dumps(row)) == row  # the launch passes rows as JSON
        assert GeneralParallel(**row).tensor_parallel_plan is not None
