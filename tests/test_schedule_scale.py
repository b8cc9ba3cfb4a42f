"""The planner at large W: compact text that expands back to exactly what it stands for, a plan
too large refused at once with its size and the fix, and the indexes that keep a plan free of
O(W x S) / O(W^2) loops equal to the plain scans they replace. No timing here (benchmarks)."""

from __future__ import annotations

import dataclasses
import pickle
import re

import pytest

from lightning_gsched.cli import main
from lightning_gsched.errors import PlanTooLargeError, ScheduleConfigError
from lightning_gsched.schedule import plan
from lightning_gsched.schedule.describe import (
    EVERY_WORKER_HINT,
    MAX_ROWS,
    SHOWN_FIRST,
    SHOWN_LAST,
    describe,
    worker_rows,
)
from lightning_gsched.schedule.fold import (
    fold_rows,
    owners_text,
    ranks_text,
    sequence_text,
)
from lightning_gsched.schedule.library import LIBRARY, resolve_shape
from lightning_gsched.schedule.limits import MAX_JOBS, check_size
from lightning_gsched.schedule.metrics import measure
from lightning_gsched.schedule.program import Action, Op, RankGroup
from lightning_gsched.schedule.render import MAX_WORKERS, ascii_timeline

# ------------------------------------------------------------------ compact text, expanded


def expand_ranks(text: str) -> list[int]:
    """Inverse of :func:`ranks_text`."""
    out: list[int] = []
    for part in filter(None, text.strip("[]").split(",")):
        match = re.fullmatch(r"(\d+)(?:-(\d+)(?:/(\d+))?)?", part)
        assert match, part
        first, last, step = match.groups()
        out += range(int(first), int(last or first) + 1, int(step or 1))
    return out


def expand_sequence(text: str) -> list[int]:
    """Inverse of :func:`sequence_text` (ints only)."""
    out: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\.\.(\d+)(?:/(\d+))?)?", part)
        assert match, part
        first, last, step = match.groups()
        a, b, k = int(first), int(last or first), int(step or 1)
        out += range(a, b + 1, k) if b >= a else range(a, b - 1, -k)
    return out


def expand_owners(text: str) -> list[list[int]]:
    """Inverse of :func:`owners_text` (when nothing was cut)."""
    owners: list[list[int]] = []
    for item in text.split("; "):
        match = re.fullmatch(r"s(\d+)(?:-(\d+))?: (\[[^\]]*\])([+-]\d+)?", item)
        assert match, item
        first, last, ranks, shift = match.groups()
        base = expand_ranks(ranks)
        for i in range(int(last or first) - int(first) + 1):
            owners.append([r + i * int(shift or 0) for r in base])
    return owners


@pytest.mark.parametrize("ranks", [
    [], [3], [0, 1], [0, 1, 2], list(range(1024)), list(range(0, 1023, 2)), [1, 5, 9, 10, 11, 12],
    [0, 3, 4, 7, 8, 11], [0, 2, 4, 5, 6, 7, 100],
])
def test_ranks_text_expands_back(ranks):
    assert expand_ranks(ranks_text(ranks)) == ranks


@pytest.mark.parametrize("values", [
    list(range(20, 0, -1)), [4, 4, 4, 8, 12, 16], [1, 2], [7], list(range(0, 40, 4)) + [3, 9],
])
def test_sequence_text_expands_back(values):
    assert expand_sequence(sequence_text(values)) == values


@pytest.mark.parametrize("name,W", [("fsdp", 8), ("fslpp", 16), ("lpp", 12), ("fslpp-seed", 8),
                                    ("zbv", 4), ("ddp", 6), ("interleaved", 4)])
def test_owners_text_expands_back_to_the_plans_owners(name, W):
    S, B, R = resolve_shape(name, W, None, None, None)
    owners = [list(o) for o in LIBRARY[name].make_placement(W, S, R or 1).rows(S, B)[0]
              for o in [sorted(set(o))]]
    assert expand_owners(owners_text(owners, 10**6)) == owners


def test_owners_text_is_bounded_and_counts_what_it_leaves_out():
    owners = [[(s * s) % 997, (s * s) % 997 + 1000] for s in range(1000)]  # few runs
    groups = owners_text(owners, 10**9).count(": ")
    text = owners_text(owners, 160)
    assert len(text) <= 160 and text.endswith("more stage groups)")
    shown = text.count(": ")
    assert int(re.search(r"\((\d+) more", text)[1]) == groups - shown


def test_fold_rows_keeps_every_worker_once():
    rows = [[w, "a" if w % 2 else "b", w == 7] for w in range(10)]
    folded = fold_rows(rows)
    assert [r[0] for r in folded] == ["0-8/2", "1-5/2,9", "7"]
    workers = sorted(w for r in folded for w in expand_ranks(str(r[0])))
    assert workers == list(range(10))


# ------------------------------------------------------------------ readable output


def test_describe_is_unchanged_at_small_W():
    text = describe(plan("fsdp", workers=3))
    assert "stage owners [[0], [1], [2]]" in text
    assert [line.split()[0] for line in text.splitlines()[4:]] == ["0", "1", "2"]


def test_describe_folds_workers_and_owners_at_large_W():
    text = describe(plan("lpp", workers=40))
    assert "stage owners s0-1: [0-38/2]+1; s2-3: [0-38/2]+1" in text
    assert [line.split()[0] for line in text.splitlines()[4:]] == ["0-38/2", "1-39/2"]
    assert all(len(line) < 200 for line in text.splitlines())


def test_describe_caps_and_rows_stay_short_for_a_long_pipeline():
    text = describe(plan("1f1b", workers=80, microbatches=80))
    assert "cap=80..1" in text.splitlines()[0]
    # 1f1b's workers all differ (peak act): the first and last ones, the gap, the note
    assert len(text.splitlines()) == 4 + SHOWN_FIRST + 1 + SHOWN_LAST + 1
    assert text.endswith(f"... workers {SHOWN_FIRST}-{79 - SHOWN_LAST} not shown; "
                         f"{EVERY_WORKER_HINT}")
    assert all(len(line) < 200 for line in text.splitlines())


@pytest.mark.parametrize("name,ties,lazy", [("fsdp", False, True), ("fslpp", False, True),
                                            ("fslpp", True, False), ("1f1b", False, False)])
def test_describe_beyond_max_rows_computes_only_the_rows_it_shows(name, ties, lazy):
    """Beyond MAX_ROWS workers the table shows the first and last workers' rows, each equal to
    that worker's row from every program fully lowered and measured, and lowers only their
    programs (lazy plans: fsdp, fslpp); the workers between are named, not computed."""
    W = MAX_ROWS + 16
    S = plan(name, W).stages
    extra = {"ties": {0: (0, S - 1)}} if ties else {}
    tie_bytes = {0: 7} if ties else None
    stage_bytes = [1000 + s for s in range(S)]
    result = plan(name, W, **extra)
    text = describe(result, stage_bytes, tie_bytes)
    shown = [*range(SHOWN_FIRST), *range(W - SHOWN_LAST, W)]
    assert (result.programs.ranks.lowered == len(shown)) == lazy
    if lazy:  # lowered per rank on demand: only the shown ranks' programs were
        assert result.programs.ranks.lowered == result.metrics.per_worker.lowered == len(shown)
    full = plan(name, W, **extra)
    list(full.programs.ranks)  # every program at once: the full lowering and dry run
    reference = dataclasses.replace(full, metrics=measure(full.programs, full.timeline))
    expected = worker_rows(reference, range(W), stage_bytes, tie_bytes)
    hidden = f"{SHOWN_FIRST}-{W - SHOWN_LAST - 1}"
    lines = text.splitlines()
    assert lines[-1] == f"... workers {hidden} not shown; {EVERY_WORKER_HINT}"
    listed = []
    for line in lines[4:-1]:
        label, *cells = line.split()
        if label == "...":
            assert cells[0] == hidden and set(cells[1:]) == {"..."}
            continue
        for worker in expand_ranks(label):
            assert cells == [str(c) for c in expected[worker][1:]], worker
            listed.append(worker)
    assert sorted(listed) == shown


def test_cli_plan_text_names_the_workers_it_does_not_show(capsys):
    assert main(["plan", "fsdp", "-w", "256"]) == 0
    out = capsys.readouterr().out
    assert f"... workers {SHOWN_FIRST}-{255 - SHOWN_LAST} not shown; {EVERY_WORKER_HINT}" in out


def test_timeline_draws_the_first_workers_and_says_so():
    result = plan("lpp", workers=80)
    text = ascii_timeline(result.timeline)
    assert f"w{MAX_WORKERS - 1} " in text and f"w{MAX_WORKERS} " not in text
    assert f"workers {MAX_WORKERS}-79 not drawn" in text
    wide = ascii_timeline(plan("1f1b", workers=400, microbatches=1).timeline)
    assert wide.startswith("(timeline not drawn") and "\n" not in wide


# ------------------------------------------------------------------ too large: refused


def test_a_plan_too_large_is_refused_with_its_size_and_the_fix():
    with pytest.raises(PlanTooLargeError, match=r"20,000,000,000 jobs.*fewer stages or "
                                                r"microbatches"):
        plan("fsdp", workers=100_000)
    assert issubclass(PlanTooLargeError, ScheduleConfigError)
    check_size("x", 1, MAX_JOBS // 2, 1, 2)  # exactly the limit: fine
    with pytest.raises(PlanTooLargeError):
        check_size("x", 1, MAX_JOBS // 2 + 1, 1, 2)


def test_cli_answers_a_plan_too_large_in_one_line(capsys):
    assert main(["plan", "zbv", "-w", "100000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gsched: error: zbv with W=100000") and err.count("\n") == 1


# ------------------------------------------------------------------ indexes = plain scans


@pytest.mark.parametrize("name", ["fsdp", "lpp", "fslpp-seed", "ddp"])
def test_owned_stage_indexes_equal_the_plain_scans(name):
    result = plan(name, workers=6 if name != "fslpp-seed" else 4, verify=False)
    programs, table = result.programs, result.table
    for rank in range(result.workers):
        plain = [s for s, owners in enumerate(programs.owners) if rank in owners]
        assert programs.owned_stages(rank) == plain == table.owned_stages(rank)
        assert table.computed_stages(rank) == {s for s in range(table.stages)
                                               if rank in table.compute[s]}


def test_rank_group_is_the_tuple_it_holds():
    group = RankGroup(range(0, 10, 2))
    assert group == (0, 2, 4, 6, 8) and hash(group) == hash((0, 2, 4, 6, 8))
    assert 4 in group and 5 not in group and "x" not in group
    assert {group: 1}[(0, 2, 4, 6, 8)] == 1
    action = Action(Op.ALLREDUCE_G, 0, None, None, group)
    assert Action.parse(str(action)) == action
    copy = pickle.loads(pickle.dumps(group))
    assert copy == group and 2 in copy


def test_lowered_all_reduces_share_one_group_object():
    programs = plan("ddp", workers=5).programs
    groups = [a.group for program in programs.ranks for a in program if a.op is Op.ALLREDUCE_G]
    assert len(groups) == 5 and all(g is groups[0] for g in groups)
    assert isinstance(groups[0], RankGroup)
