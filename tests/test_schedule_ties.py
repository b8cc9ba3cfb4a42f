"""Tied weights in the plan: lowering, dry run, counts, bytes, step time, text and CLI.

The rule under test (docs/schedules.md, "Tied weights"): a tie is owned with its home stage (the
lowest stage reading it); a worker that computes a reader stage without owning the tie fetches
it once per step (from the worker it fetches the home stage from, else the first owner), holds
it until its last reader job and, when training, sends its gradient back once; several owners
all-reduce it once; a worker that computes no reader holds nothing of it. Expected counts are
derived here from the placement table (which worker computes which stage, who owns what), not
read off the programs; the named examples of the issue are also checked with their numbers.
"""

from __future__ import annotations

import json

import pytest

from lightning_gsched.cli import main
from lightning_gsched.errors import ProgramError, ScheduleConfigError
from lightning_gsched.schedule import LIBRARY, Op, plan
from lightning_gsched.schedule.describe import describe, plan_command
from lightning_gsched.schedule.dryrun import dry_run
from lightning_gsched.schedule.memory import predict_memory, resident_bytes
from lightning_gsched.schedule.predict import predict_step_time
from lightning_gsched.schedule.program import COMPUTE_OPS, Action, Programs
from sizes import uniform_sizes

TIE_FIELDS = ("tie_fetches", "tie_serves", "tie_grad_sends", "tie_grad_recvs", "tie_allreduces")


def expected_tie_counts(p) -> list[dict[str, int]]:
    """Per worker, the tie counters the rule implies, from the placement table alone."""
    table, training = p.table, not p.forward_only
    counts = [dict.fromkeys(TIE_FIELDS, 0) for _ in range(p.workers)]
    for home, readers in p.ties.items():
        owners = table.owners[home]
        computing = {table.compute[s][b] for s in readers for b in range(p.micro)}
        for w in sorted(computing - set(owners)):
            source = table.fetch_source.get((home, w), owners[0])
            counts[w]["tie_fetches"] += 1
            counts[source]["tie_serves"] += 1
            if training:
                counts[w]["tie_grad_sends"] += 1
                counts[source]["tie_grad_recvs"] += 1
        if training and len(owners) > 1:
            for o in owners:
                counts[o]["tie_allreduces"] += 1
    return counts


def tie_counts(p) -> list[dict[str, int]]:
    return [{f: getattr(m, f) for f in TIE_FIELDS} for m in p.metrics.per_worker]


# --------------------------------------------------------------------------- the named examples


def test_gpipe_four_stages_tied_ends():
    """gpipe W=S=4, stages 0 and 3 tied: rank 3 fetches once and reduces once, rank 0 serves
    once and receives once, ranks 1 and 2 do nothing."""
    p = plan("gpipe", workers=4, stages=4, ties={0: (3,)})
    assert p.ties == {0: (0, 3)}
    zero = dict.fromkeys(TIE_FIELDS, 0)
    assert tie_counts(p) == [
        {**zero, "tie_serves": 1, "tie_grad_recvs": 1}, zero, zero,
        {**zero, "tie_fetches": 1, "tie_grad_sends": 1},
    ]
    rank3 = [str(a) for a in p.programs.ranks[3] if a.tie]
    assert rank3 == ["FETCH_W t0 <-0", "REDUCE_G t0 ->0", "FREE_W t0"]
    program = p.programs.ranks[3]
    first_compute = next(i for i, a in enumerate(program) if a.op in COMPUTE_OPS)
    last_compute = max(i for i, a in enumerate(program) if a.op in COMPUTE_OPS)
    assert program.index(Action.parse("FETCH_W t0 <-0")) < first_compute  # held all step
    assert program.index(Action.parse("FREE_W t0")) > last_compute


def test_zbv_puts_both_ends_on_rank_zero():
    """zbv (V shape): stage 0 and S-1 both run on rank 0, so a tie of the two moves nothing."""
    for W in (2, 4):
        p = plan("zbv", workers=W, ties=[(0, 2 * W - 1)])
        table = p.table
        assert {table.compute[s][b] for s in (0, p.stages - 1) for b in range(p.micro)} == {0}
        assert all(v == 0 for row in tie_counts(p) for v in row.values())


def test_ddp_only_all_reduces_the_tie():
    """ddp: every rank owns every stage, so the tie is owned by all and all-reduced once."""
    p = plan("ddp", workers=2, stages=2, ties=[(0, 1)])
    assert tie_counts(p) == [{**dict.fromkeys(TIE_FIELDS, 0), "tie_allreduces": 1}] * 2
    for program in p.programs.ranks:
        assert [str(a) for a in program if a.op is Op.ALLREDUCE_G and a.tie] == [
            "ALLREDUCE_G t0 [0,1]"]


@pytest.mark.parametrize("schedule", ["fsdp", "fslpp"])
def test_sharded_schedules_fetch_where_they_compute(schedule):
    """fsdp/fslpp: one owner per stage; every other worker computing a reader fetches."""
    p = plan(schedule, workers=2, ties=[(0, p_last := plan(schedule, workers=2).stages - 1)])
    assert p.ties == {0: (0, p_last)}
    assert tie_counts(p) == expected_tie_counts(p)
    assert sum(c["tie_fetches"] for c in tie_counts(p)) >= 1


def test_forward_only_programs_fetch_serve_and_free_only():
    for schedule in ("gpipe", "fsdp", "ddp"):
        p = plan(schedule, workers=2, stages=2, forward_only=True, ties=[(0, 1)])
        ops = {a.op for program in p.programs.ranks for a in program if a.tie}
        assert ops <= {Op.FETCH_W, Op.SEND_W, Op.FREE_W}  # no gradient of a tie moves
        assert tie_counts(p) == expected_tie_counts(p)


def test_action_text_round_trips():
    for text in ("FETCH_W t0 <-0", "SEND_W t0 ->3", "FREE_W t2", "REDUCE_G t0 ->0",
                 "RECV_G t0 <-3", "ALLREDUCE_G t0 [0,1]"):
        assert str(Action.parse(text)) == text
        assert Action.parse(text).tie and not Action.parse(text.replace(" t", " s")).tie
    with pytest.raises(ValueError, match="act on a tie"):
        Action.parse("F t0 b1")  # a compute is a stage's


# --------------------------------------------------------------------------- every schedule


def _library_cases() -> list:
    cases = []
    for schedule in LIBRARY:
        for W, S in ((2, None), (2, 8), (4, None)):
            cases.append(pytest.param(schedule, W, S, id=f"{schedule}-W{W}-S{S}"))
    return cases


@pytest.mark.parametrize("schedule, W, S", _library_cases())
def test_every_library_schedule_places_ties(schedule, W, S):
    """Ties {0: (S-1,)} and a second tie with another home: the dry run passes (plan verifies),
    the counts follow the rule, training and forward-only alike, and the stage actions are
    those of the plan without ties."""
    plain = plan(schedule, workers=W, stages=S)  # every case is a valid shape: a failure fails
    last = plain.stages - 1
    if last < 1:
        pytest.skip("one stage: nothing to tie")
    ties = {0: (last,)} if last < 3 else {0: (last,), 1: (2,)}
    for forward_only in (False, True):
        base = plan(schedule, workers=W, stages=S, forward_only=forward_only)
        p = plan(schedule, workers=W, stages=S, forward_only=forward_only, ties=ties)
        assert tie_counts(p) == expected_tie_counts(p), (forward_only, p.programs.text())
        for with_ties, without in zip(p.programs.ranks, base.programs.ranks, strict=True):
            assert [a for a in with_ties if not a.tie] == without


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("ties, message", [
    ([(0, 4)], r"stage 4 of group \[0, 4\] is not a stage index in \[0, 4\)"),
    ({0: (-1,)}, "stage -1"),
    ([(2,)], "fewer than two stages"),
    ([(1, 1)], "fewer than two stages"),
    ("0,3", "give a mapping"),
    ([3], "every group must be a sequence"),
    ({0: 3}, "iterable of reader stages"),
    ([(0, 1.5)], "stage 1.5"),
])
def test_bad_ties_are_refused(ties, message):
    with pytest.raises(ScheduleConfigError, match=message):
        plan("gpipe", workers=2, stages=4, ties=ties)


def test_tie_forms_agree_and_merge_by_home():
    """A mapping and groups give the same ties; groups with one home are one tie."""
    a = plan("gpipe", workers=2, stages=4, ties={0: (3,), 1: (2,)})
    b = plan("gpipe", workers=2, stages=4, ties=[(3, 0), (1, 2)])
    assert a.ties == b.ties == {0: (0, 3), 1: (1, 2)}
    assert a.programs.ranks == b.programs.ranks
    c = plan("gpipe", workers=2, stages=4, ties=[(0, 3), (0, 2)])
    assert c.ties == {0: (0, 2, 3)}


# --------------------------------------------------------------------------- dry run


def _without(programs: Programs, *removed: tuple[int, str]) -> Programs:
    """``programs`` with each ``(rank, action text)`` of ``removed`` taken out."""
    ranks = [list(r) for r in programs.ranks]
    for rank, text in removed:
        ranks[rank].remove(Action.parse(text))
    return Programs(ranks, programs.num_stages, programs.num_micro, programs.owners,
                    programs.edges, programs.forward_only, programs.split_backward,
                    dict(programs.ties))


def test_dry_run_refuses_broken_tie_programs():
    p = plan("gpipe", workers=4, stages=4, ties=[(0, 3)])
    dry_run(p.programs)
    with pytest.raises(ProgramError, match="never receives it|never sends it"):
        dry_run(_without(p.programs, (0, "SEND_W t0 ->3")))
    # no fetch: rank 3 computes stage 3 without the tie (matching fails first on the channel)
    with pytest.raises(ProgramError, match="has no weights of tie 0"):
        dry_run(_without(p.programs, (3, "FETCH_W t0 <-0"), (0, "SEND_W t0 ->3")))
    with pytest.raises(ProgramError, match="frees tie 0 while its gradient was not sent"):
        dry_run(_without(p.programs, (3, "REDUCE_G t0 ->0"), (0, "RECV_G t0 <-3")))
    with pytest.raises(ProgramError, match=r"ends with fetched ties \[0\] never freed"):
        dry_run(_without(p.programs, (3, "FREE_W t0")))


# --------------------------------------------------------------------------- bytes


def test_memory_counts_tie_bytes_where_held():
    """gpipe W=S=4, tie {0, 3} of T bytes (stages P): the owner (rank 0) holds the tie's weights,
    gradient and optimizer state all step; rank 3 holds its weights from FETCH_W t0 to FREE_W t0 and
    its gradient from its first backward to REDUCE_G t0, no optimizer state; ranks 1 and 2 none."""
    P, T, factor = 1000, 300, 2
    p = plan("gpipe", workers=4, stages=4, ties=[(0, 3)])
    sizes = uniform_sizes(4, P, 0, 0, optimizer_factor=factor, ties=p.ties, tie_params=T)
    memory = predict_memory(p.programs, sizes)
    peaks = [(m.category_peaks.weights, m.category_peaks.gradients, m.category_peaks.optimizer)
             for m in memory]
    assert peaks == [(P + T, P + T, factor * (P + T)), (P, P, factor * P), (P, P, factor * P),
                     (P + T, P + T, factor * P)]
    held = resident_bytes(p.programs, [P] * 4, {0: T})
    assert [(r.owned, r.peak) for r in held] == [(P + T, P + T), (P, P), (P, P), (P, P + T)]
    # forward-only: the fetch holds weights only
    f = plan("gpipe", workers=4, stages=4, ties=[(0, 3)], forward_only=True)
    fwd = predict_memory(f.programs, uniform_sizes(4, P, 0, 0, ties=f.ties, tie_params=T))
    assert [m.category_peaks.weights for m in fwd] == [P + T, P, P, P + T]
    assert all(m.category_peaks.gradients == 0 for m in fwd)


def test_zbv_tie_costs_no_extra_bytes_off_its_owner():
    p = plan("zbv", workers=2, ties=[(0, 3)])
    memory = predict_memory(p.programs, uniform_sizes(4, 100, 0, 0, ties=p.ties, tie_params=40))
    assert [m.category_peaks.weights for m in memory] == [2 * 100 + 40, 2 * 100]


def test_sizes_and_programs_must_agree_on_ties():
    p = plan("gpipe", workers=2, stages=2)
    with pytest.raises(ScheduleConfigError, match=r"plan with ties=sizes.tie_map"):
        predict_memory(p.programs, uniform_sizes(2, 1, 1, 1, ties={0: (0, 1)}, tie_params=5))
    t = plan("gpipe", workers=2, stages=2, ties=[(0, 1)])
    with pytest.raises(ScheduleConfigError, match="sizes describe ties {}"):
        predict_memory(t.programs, uniform_sizes(2, 1, 1, 1))


# --------------------------------------------------------------------------- step time


def test_runtime_costs_charge_tie_bytes_where_the_tie_moves():
    """With a bandwidth and measured sizes, a tie's bytes cost time exactly where the plan moves
    them: gpipe's rank 3 fetches and reduces a 1e6-byte tie over a 1e6 B/s link (1 s each
    way), zbv moves nothing, and ddp's owners all-reduce it (2 (n-1)/n x bytes / bandwidth)."""
    from lightning_gsched.schedule.runtime_costs import RuntimeCosts

    link = RuntimeCosts(bandwidth=1e6, allreduce_bandwidth=1e6)
    p = plan("gpipe", workers=4, stages=4, ties=[(0, 3)])
    light = uniform_sizes(4, 0, 0, 0, ties=p.ties, tie_params=0)
    heavy = uniform_sizes(4, 0, 0, 0, ties=p.ties, tie_params=10**6)
    base = predict_step_time(p, costs=link, sizes=light)
    tied = predict_step_time(p, costs=link, sizes=heavy)
    assert base.latency == pytest.approx(p.metrics.latency)
    # the tie's gradient leaves rank 3 after its last backward and takes 1 s to reach rank 0
    assert tied.worker_end[3] == pytest.approx(p.timeline.by_worker[3][-1].end + 1.0)
    assert tied.worker_end[1:3] == base.worker_end[1:3]
    # a 100-byte tie over a 1 B/s link: rank 3 computes its 2B jobs of 3 units each after it
    slow = predict_step_time(p, costs=RuntimeCosts(bandwidth=1.0),
                             sizes=uniform_sizes(4, 0, 0, 0, ties=p.ties, tie_params=100))
    assert slow.latency >= 100.0 + 3.0 * p.micro
    v = plan("zbv", workers=2, ties=[(0, 3)])
    v_heavy = uniform_sizes(v.stages, 0, 0, 0, ties=v.ties, tie_params=10**6)
    assert predict_step_time(v, costs=link, sizes=v_heavy).latency == pytest.approx(
        v.metrics.latency)
    d = plan("ddp", workers=2, stages=2, ties=[(0, 1)])
    d_heavy = uniform_sizes(2, 0, 0, 0, ties=d.ties, tie_params=10**6)
    assert predict_step_time(d, costs=link, sizes=d_heavy).latency == pytest.approx(
        d.metrics.latency + 2 * (2 - 1) / 2 * 10**6 / 1e6)


# --------------------------------------------------------------------------- text and CLI


def test_describe_and_cli_show_tie_traffic(capsys):
    p = plan("gpipe", workers=4, stages=4, ties=[(0, 3)])
    text = describe(p, [10] * 4, {0: 5})
    assert "ties=0,3" in text.splitlines()[0]
    assert "tie fetch/serve" in text and "tie reduce out/in" in text
    assert plan_command(p).endswith("--tie 0,3")
    assert main(["plan", "gpipe", "-w", "4", "--tie", "0,3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ties"] == {"0": [0, 3]}
    assert [w["tie_fetches"] for w in data["per_worker"]] == [0, 0, 0, 1]
    assert main(["plan", "gpipe", "-w", "4", "--tie", "0,9"]) == 2
    assert "stage 9 of group [0, 9]" in capsys.readouterr().err
    assert "tie" not in describe(plan("gpipe", workers=4, stages=4))
