"""The seed's Table 1 claims, checked against the simulator where they hold exactly.

Closed forms here are derived independently from the schedule definitions (not copied from the
code's output); docs/schedules.md explains where the seed's big-O entries differ.
"""

from __future__ import annotations

import pytest

from lightning_gsched.schedule import DDP, LPP, GPipe, Phase, PlacementTable, plan


@pytest.mark.parametrize("W", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("B", [1, 2, 5, 8])
@pytest.mark.parametrize("f,b", [(1, 2), (1, 1), (2, 3)])
def test_gpipe_latency_is_b_plus_s_minus_1_times_f_plus_b(W, B, f, b):
    result = plan("gpipe", workers=W, stages=W, microbatches=B, forward_cost=f, backward_cost=b)
    assert result.metrics.latency == pytest.approx((B + W - 1) * (f + b))


@pytest.mark.parametrize("W,B", [(2, 4), (4, 4), (4, 16), (5, 10), (8, 8)])
def test_gpipe_bubble_fraction_with_equal_costs(W, B):
    result = plan("gpipe", workers=W, stages=W, microbatches=B, forward_cost=1, backward_cost=1)
    assert result.metrics.bubble_fraction == pytest.approx((W - 1) / (B + W - 1))


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
@pytest.mark.parametrize("W,S,k", [(1, 1, 1), (2, 2, 1), (4, 4, 1), (4, 8, 2), (3, 6, 3)])
def test_data_parallel_latency_is_s_times_f_plus_b_times_b_over_w(name, W, S, k):
    B = k * W
    result = plan(name, workers=W, stages=S, microbatches=B, forward_cost=1.5, backward_cost=2)
    assert result.metrics.latency == pytest.approx(S * 3.5 * B / W)
    assert result.metrics.bubble_fraction == pytest.approx(0.0)


@pytest.mark.parametrize("W,S,B", [(2, 3, 4), (4, 4, 8), (4, 1, 4)])
def test_ddp_moves_nothing_but_one_allreduce_per_stage(W, S, B):
    result = plan("ddp", workers=W, stages=S, microbatches=B)
    for m in result.metrics.per_worker:
        moved = (m.activation_recvs, m.activation_sends, m.input_grad_recvs, m.input_grad_sends,
                 m.weight_fetches, m.weight_serves, m.grad_sends, m.grad_recvs)
        assert moved == (0,) * 8
        assert m.allreduces == (S if W > 1 else 0)
        assert m.owned_stages == S and m.peak_resident_stages == S


@pytest.mark.parametrize("W,k", [(2, 1), (4, 1), (4, 2), (3, 2)])
def test_fsdp_weight_fetches_per_worker(W, k):
    """Forward fetches every non-owned stage once (S-1). Backward fetches them again, except the
    last stage: its forward and backward are consecutive on the worker, so one fetch serves both.
    The seed's table counts only the forward (S-1)."""
    S, B = W, k * W
    result = plan("fsdp", workers=W, stages=S, microbatches=B)
    for m in result.metrics.per_worker:
        owns_last = m.worker == (S - 1) % W
        expected = (S - 1) + (S - 1) - (0 if owns_last else 1)
        assert m.weight_fetches == expected
        assert m.grad_sends == S - 1  # one reduce per non-owned stage: backward runs are whole
        assert m.owned_stages == 1
        assert m.activation_recvs == 0 and m.input_grad_recvs == 0


@pytest.mark.parametrize("W,S,B", [(2, 2, 4), (4, 4, 8), (4, 8, 4), (3, 3, 6)])
def test_lpp_with_r1_places_every_job_like_ddp(W, S, B):
    lpp, ddp = PlacementTable(LPP(W, 1), W, S, B), PlacementTable(DDP(W), W, S, B)
    assert lpp.compute == ddp.compute and lpp.weights == ddp.weights
    a = plan("lpp", workers=W, stages=S, microbatches=B, R=1)
    d = plan("ddp", workers=W, stages=S, microbatches=B)
    assert a.timeline.slots == d.timeline.slots
    assert a.programs.ranks == d.programs.ranks


@pytest.mark.parametrize("W,B", [(2, 4), (4, 4), (4, 9), (8, 8)])
def test_lpp_with_r_equal_w_places_every_job_like_gpipe(W, B):
    lpp, gp = PlacementTable(LPP(W, W), W, W, B), PlacementTable(GPipe(W, W), W, W, B)
    assert lpp.compute == gp.compute and lpp.weights == gp.weights
    a = plan("lpp", workers=W, stages=W, microbatches=B, R=W)
    g = plan("gpipe", workers=W, stages=W, microbatches=B)
    assert a.metrics.latency == g.metrics.latency
    assert a.programs.ranks == g.programs.ranks


@pytest.mark.parametrize("name", ["lpp", "fslpp"])
@pytest.mark.parametrize("W,R,S,B", [(4, 2, 4, 8), (4, 2, 8, 8), (8, 4, 16, 8), (6, 3, 6, 6), (4, 1, 4, 4)])
def test_looped_bfs_latency(name, W, R, S, B):
    """Each worker computes B*S/W jobs of each phase; the loop of R workers adds R-1 fills."""
    result = plan(name, workers=W, R=R, stages=S, microbatches=B, forward_cost=1, backward_cost=2)
    assert B // (W // R) >= R  # enough microbatches per group to fill the loop
    assert result.metrics.latency == pytest.approx((B * S / W + R - 1) * 3)


@pytest.mark.parametrize("W,B", [(2, 4), (4, 8), (4, 3), (6, 12), (8, 16)])
@pytest.mark.parametrize("f,b", [(1, 2), (1, 1)])
def test_1f1b_has_gpipe_latency_and_classic_memory_profile(W, B, f, b):
    one = plan("1f1b", workers=W, stages=W, microbatches=B, forward_cost=f, backward_cost=b)
    gpipe = plan("gpipe", workers=W, stages=W, microbatches=B, forward_cost=f, backward_cost=b)
    assert one.metrics.latency == pytest.approx(gpipe.metrics.latency)
    for m in one.metrics.per_worker:
        assert m.peak_activations <= min(W - m.worker, B)
    assert [m.peak_activations for m in gpipe.metrics.per_worker] == [B] * W


def test_interleaved_reaches_megatron_latency_with_less_memory_than_gpipe():
    W, B = 4, 8
    inter = plan("interleaved", workers=W, microbatches=B)  # S = 2W stages of half the cost
    assert inter.stages == 2 * W
    # Megatron's interleaved bound with v = S/W chunks: v*B*(f+b) + (W-1)*(f+b)
    assert inter.metrics.latency == pytest.approx((inter.stages // W) * B * 3 + (W - 1) * 3)
    plain_order = plan("interleaved", workers=W, microbatches=B, order="1f1b", cap=None)
    assert inter.metrics.latency < plain_order.metrics.latency
    assert inter.metrics.max_of("peak_activations") < B * inter.stages // W


def test_fslpp_spreads_ownership_and_seed_map_concentrates_it():
    balanced = plan("fslpp", workers=4, R=2, stages=4, microbatches=8)
    seed = plan("fslpp-seed", workers=4, R=2, stages=4, microbatches=8)
    assert [m.owned_stages for m in balanced.metrics.per_worker] == [1, 1, 1, 1]
    assert sorted(m.owned_stages for m in seed.metrics.per_worker) == [0, 0, 2, 2]
    for W, R, S in [(8, 2, 8), (8, 4, 16), (6, 2, 12), (9, 3, 9)]:
        result = plan("fslpp", workers=W, R=R, stages=S, microbatches=2 * W)
        assert max(m.owned_stages for m in result.metrics.per_worker) <= -(-S // W)
        for s, owners in enumerate(result.table.owners):
            assert len(owners) == 1
            computing = {result.table.compute[s][b] for b in range(result.micro)}
            assert owners[0] in computing


def test_fslpp_fetches_only_within_the_stage_column_and_never_replicates():
    result = plan("fslpp", workers=4, R=2, stages=4, microbatches=8)
    # Each worker computes two stages (s mod 2 == its position) and owns one of them. Under bfs its
    # order is F(lo)*4 F(hi)*4 B(hi)*4 B(lo)*4: a non-owned *upper* stage is one run (one fetch),
    # a non-owned *lower* stage is two runs (fetched for forward and again for backward).
    for m in result.metrics.per_worker:
        owned = result.table.owned_stages(m.worker)
        computed = sorted({s.job.stage for s in result.timeline.by_worker[m.worker]})
        (foreign,) = [s for s in computed if s not in owned]
        assert m.allreduces == 0 and m.grad_sends == 1
        assert m.weight_fetches == (1 if foreign == computed[-1] else 2)
    lpp = plan("lpp", workers=4, R=2, stages=4, microbatches=8)
    assert result.metrics.latency == lpp.metrics.latency
    assert sum(m.owned_stages for m in lpp.metrics.per_worker) == 2 * 4  # G = 2 replicas
    assert sum(m.owned_stages for m in result.metrics.per_worker) == 4


def test_forward_and_backward_share_the_compute_worker_in_every_library_schedule():
    for name in ["ddp", "fsdp", "gpipe", "1f1b", "lpp", "interleaved", "fslpp", "fslpp-seed"]:
        result = plan(name, workers=4)
        where = {(s.job.stage, s.job.micro, s.job.phase): s.worker for s in result.timeline.slots}
        for (s, b, d), w in where.items():
            if d is Phase.F:
                assert where[(s, b, Phase.B)] == w


def test_a_looped_placement_refuses_a_bool_R() -> None:
    """``True`` is an int to ``isinstance``: a looped placement built by hand must still refuse
    it as R (``plan()`` refuses it earlier, with its own wording)."""
    from lightning_gsched.errors import ScheduleConfigError

    with pytest.raises(ScheduleConfigError, match="lpp: R must be a positive integer, got True"):
        LPP(4, True).check(4, 4)  # type: ignore[arg-type]
