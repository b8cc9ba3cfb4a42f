"""Where the partitioner cuts: the DP itself, the balance modes and the cut preferences."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import models
from lightning_gsched.partition import BalanceError, partition
from lightning_gsched.partition.linear import bottleneck, cheapest_split

# ----------------------------------------------------------------------------- the DP


def brute_bottleneck(costs: list[int], num_segments: int) -> int:
    n = len(costs)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), num_segments - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return int(best)


def split_score(costs: list[int], cuts: tuple[int, ...], penalties: list[tuple[int, int]]) -> tuple:
    prefix = [sum(costs[:c]) for c in range(len(costs) + 1)]
    total, segments = prefix[-1], len(cuts) + 1
    summed = tuple(sum(penalties[c][i] for c in cuts) for i in range(2))
    return summed + (sum(abs(prefix[c] - (k + 1) * total / segments) for k, c in enumerate(cuts)),)


@st.composite
def split_problems(draw: st.DrawFn) -> tuple[list[int], int, list[tuple[int, int]], float]:
    costs = draw(st.lists(st.sampled_from([0, 1, 2, 3, 7, 50]), min_size=1, max_size=8))
    num_segments = draw(st.integers(1, len(costs)))
    penalties = [(0, 0)] + [
        (draw(st.integers(0, 2)), draw(st.integers(0, 9))) for _ in range(len(costs) - 1)
    ]
    return costs, num_segments, penalties, draw(st.sampled_from([0.0, 0.1, 0.5]))


@settings(max_examples=150, deadline=None)
@given(split_problems())
def test_dp_matches_brute_force(problem: tuple[list[int], int, list[tuple[int, int]], float]) -> None:
    costs, num_segments, penalties, tolerance = problem
    best = bottleneck(costs, num_segments)
    assert best == brute_bottleneck(costs, num_segments)
    bound = best * (1 + tolerance)
    cuts = tuple(cheapest_split(costs, num_segments, bound, penalties))
    bounds = [0, *cuts, len(costs)]
    assert list(cuts) == sorted(set(cuts)) and len(cuts) == num_segments - 1
    assert max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)) <= bound + 1e-9
    feasible = [
        split_score(costs, c, penalties)
        for c in itertools.combinations(range(1, len(costs)), num_segments - 1)
        if max(sum(costs[a:b]) for a, b in itertools.pairwise([0, *c, len(costs)])) <= bound + 1e-9
    ]
    got = split_score(costs, cuts, penalties)
    want = min(feasible)
    assert got[:2] == want[:2] and got[2] == pytest.approx(want[2])


def test_dp_handles_float_costs_and_rejects_negative_ones() -> None:
    assert bottleneck([0.5, 1.25, 3.0, 0.125], 2) == pytest.approx(3.125)
    with pytest.raises(ValueError):
        bottleneck([1, -1], 1)


# ----------------------------------------------------------------------------- balance modes


def test_params_balance_puts_heavy_layers_alone() -> None:
    """Layers s H s s H s where H has ~60x the parameters of s: each H gets its own stage."""
    module = models.make_uneven(pattern="sHssHs")
    part = partition(module, 5, models.uneven_inputs(), leaf_modules=(models.Expand,))
    assert part.stage_units == [
        ["layers_0"], ["layers_1"], ["layers_2", "layers_3"], ["layers_4"], ["layers_5"]
    ]
    heavy = sum(p.numel() for p in module.layers[1].parameters())
    assert part.stage_costs[1] == part.stage_costs[3] == heavy == max(part.stage_costs)
    assert part.stage_param_counts == [int(c) for c in part.stage_costs]


def test_time_balance_profiles_units_and_separates_heavy_layers() -> None:
    module = models.make_uneven(pattern="sHssHs", hidden=1024)
    args = models.uneven_inputs()
    part = partition(module, 4, args, leaf_modules=(models.Expand,), balance="time")
    assert part.cost_unit == "ns" and len(part.unit_costs) == 6
    assert all(c > 0 for c in part.unit_costs)
    stage_of = {name: k for k, names in enumerate(part.stage_units) for name in names}
    assert stage_of["layers_1"] != stage_of["layers_4"]
    assert max(part.stage_costs) <= part.best_bottleneck * 1.1 + 1
    assert all(p.grad is None for p in module.parameters())  # profiling never writes .grad
    # other ranks reuse rank 0's measured costs and get the same split
    again = partition(models.make_uneven(pattern="sHssHs", hidden=1024), 4, args,
                      leaf_modules=(models.Expand,), balance="time", unit_costs=part.unit_costs)
    assert again.stage_units == part.stage_units and again.unit_costs == part.unit_costs


def test_params_split_is_deterministic() -> None:
    (idx,) = models.gpt_inputs()
    first = partition(models.make_gpt(layers=3), 4, (idx,))
    second = partition(models.make_gpt(layers=3), 4, (idx,))
    assert first.cuts == second.cuts and first.unit_costs == second.unit_costs


def test_explicit_unit_counts_per_stage() -> None:
    part = partition(models.make_mlp(), 3, models.mlp_inputs(), balance=[1, 2, 4])
    assert [len(u) for u in part.stage_units] == [1, 2, 4]
    assert part.split_method == "sizes"
    with pytest.raises(BalanceError, match="sums to 6 but the model has 7 units"):
        partition(models.make_mlp(), 3, models.mlp_inputs(), balance=[1, 2, 3])
    with pytest.raises(BalanceError, match="has 2 entries but num_stages=3"):
        partition(models.make_mlp(), 3, models.mlp_inputs(), balance=[3, 4])


def test_split_points_by_module_name_and_unit_name() -> None:
    module = models.make_gpt(layers=3)
    (idx,) = models.gpt_inputs()
    part = partition(module, 3, (idx,), split_points=["blocks.2", "blocks.1"])  # any order
    assert part.stage_units[1][0] == "blocks_1_ln1" and part.stage_units[2][0] == "blocks_2_ln1"
    assert part.split_method == "split_points"
    assert torch.equal(part(idx), models.make_gpt(layers=3)(idx))
    by_unit = partition(models.make_gpt(layers=3), 2, (idx,), split_points=["ln_f"])
    assert by_unit.stage_units[1] == ["ln_f", "linear"]
    by_node = partition(models.make_gpt(layers=3), 2, (idx,), split_points=["linear"])
    assert by_node.stage_units[1] == ["linear"]


def test_cuts_prefer_block_boundaries_within_tolerance() -> None:
    """4-block GPT in 2 stages: the best split is inside a block, but cutting between blocks 1
    and 2 costs only ~1% more, so the default tolerance takes the block boundary."""
    (idx,) = models.gpt_inputs()
    part = partition(models.make_gpt(layers=4), 2, (idx,))
    assert part.stage_units[1][0] == "blocks_2_ln1"
    assert part.boundary_names == [["getitem_2", "add_4"]]  # the causal mask and the residual
    assert max(part.stage_costs) <= part.best_bottleneck * 1.1


def test_gpt_split_keeps_embedding_first_and_tied_head_last() -> None:
    (idx,) = models.gpt_inputs()
    part = partition(models.make_gpt(layers=3), 3, (idx,))
    assert part.stage_units[0][:8] == [
        "size", "getitem", "getitem_1", "getattr_1", "arange", "wte", "wpe", "add"
    ]
    assert part.stage_units[1][0] == "blocks_1_ln1" and part.stage_units[2][0] == "blocks_2_ln1"
    assert part.stage_units[2][-2:] == ["ln_f", "linear"]
    assert part.shared_parameters == {"wte.weight": [0, 2]}


def test_zero_tolerance_gives_the_exact_optimum() -> None:
    (x,) = models.cnn_inputs()
    for num_stages in (2, 3, 4, 5):
        part = partition(models.make_cnn(), num_stages, (x,), balance_tolerance=0.0)
        assert max(part.stage_costs) == part.best_bottleneck
        assert part.best_bottleneck == brute_bottleneck([int(c) for c in part.unit_costs], num_stages)


def test_parameter_free_model_is_split_by_unit_count() -> None:
    class Free(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(6):
                x = torch.tanh(x) * 2
            return x

    x = torch.randn(3, 4)
    part = partition(Free(), 3, (x,))
    assert [len(u) for u in part.stage_units] == [4, 4, 4]
    assert torch.equal(part(x), Free()(x))


def test_unit_costs_override_and_validation() -> None:
    args = models.mlp_inputs()
    part = partition(models.make_mlp(), 2, args, unit_costs=[0, 0, 0, 0, 0, 0, 10])
    assert part.stage_units[1] == ["layers_3"] and part.cost_unit == "given"
    with pytest.raises(BalanceError, match="7 non-negative numbers"):
        partition(models.make_mlp(), 2, args, unit_costs=[1, 2])
