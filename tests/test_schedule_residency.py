"""Weight residency read off the programs: parameter bytes held per worker, and the fetch window.

The planner's ``resident_bytes`` (what ``gsched plan --stage-bytes`` and the strategy's start-up
summary print) is checked against figures derived by hand from the documented fsdp programs and
against a reference walk written here (a set of resident stages per rank). The runtime side
(measured storage bytes equal to these figures) is tests/test_runtime_schedules.py.
"""

from __future__ import annotations

import json
import random

import pytest

from lightning_gsched.cli import main
from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule import LIBRARY, Op, plan
from lightning_gsched.schedule.describe import describe, plan_command
from lightning_gsched.schedule.memory import resident_bytes
from lightning_gsched.schedule.program import COMPUTE_OPS


def held_stages(programs, rank: int) -> list[set[int]]:
    """The set of resident stages after every action of ``rank``'s program (reference walk)."""
    resident = set(programs.owned_stages(rank))
    out = [set(resident)]
    for action in programs.ranks[rank]:
        if action.op is Op.FETCH_W:
            assert action.stage not in resident
            resident.add(action.stage)
        elif action.op is Op.FREE_W:
            resident.remove(action.stage)
        out.append(set(resident))
    return out


def most_fetched(programs, rank: int) -> int:
    owned = set(programs.owned_stages(rank))
    return max(len(held - owned) for held in held_stages(programs, rank))


def shapes():
    """(schedule, W, S, B) over the library: default S and B, and twice / three times them."""
    for name, spec in LIBRARY.items():
        for W in (1, 2, 3, 4):
            R = spec.default_R(W) if spec.default_R else 1
            for k, m in ((1, 1), (2, 1), (3, 2)):
                yield name, W, spec.stages(W, R) * k, spec.micro(W, R) * m


def valid_plans(**options):
    for name, W, S, B in shapes():
        try:
            yield plan(name, workers=W, stages=S, microbatches=B, **options)
        except ScheduleConfigError:
            continue  # a shape this schedule does not take (e.g. S not a multiple of 2W)


# --------------------------------------------------------------------------- bytes


def test_fsdp_w2_holds_owned_stages_plus_one_fetched_stage_by_hand():
    """Stage sizes 1, 2, 4, 8 (every sum names its stages). fsdp at W=2, S=4: rank 0 owns s0
    and s2 (5) and holds one fetched stage at a time, the largest being s3 (8); rank 1 owns s1
    and s3 (10), its largest fetched stage is s2 (4). At S=2 each rank holds the whole model
    (its own stage plus the other one, fetched for the forward on rank 0 and kept through the
    backward that directly follows it on the last stage)."""
    for B in (2, 4):
        p = plan("fsdp", workers=2, stages=4, microbatches=B)
        got = resident_bytes(p.programs, [1, 2, 4, 8])
        assert [(r.owned, r.peak) for r in got] == [(5, 13), (10, 14)]
    p = plan("fsdp", workers=2, stages=2, microbatches=2)
    assert [(r.owned, r.peak) for r in resident_bytes(p.programs, [1, 2])] == [(1, 3), (2, 3)]


def test_bytes_agree_with_the_reference_walk_for_every_library_schedule():
    rng = random.Random(0)
    checked = 0
    for window in (None, 1):
        for p in valid_plans(fetch_window=window):
            sizes = [rng.randrange(0, 1000) for _ in range(p.stages)]
            got = resident_bytes(p.programs, sizes)
            for rank in range(p.workers):
                held = held_stages(p.programs, rank)
                assert got[rank].owned == sum(sizes[s] for s in held[0])
                assert got[rank].peak == max(sum(sizes[s] for s in h) for h in held), (
                    p.schedule, p.workers, p.stages, p.micro, rank)
            # unit sizes: the byte peak is the plan's own count of resident stages
            ones = resident_bytes(p.programs, [1] * p.stages)
            assert [r.peak for r in ones] == [m.peak_resident_stages for m in p.metrics.per_worker]
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("sizes", [[1, 2, 3], [1, -1, 1, 1], [1, 2.0, 3, 4], [1, True, 1, 1]])
def test_stage_bytes_must_be_one_int_per_stage(sizes):
    p = plan("fsdp", workers=2, stages=4)
    with pytest.raises(ScheduleConfigError, match="stage_bytes must be one int >= 0 per stage"):
        resident_bytes(p.programs, sizes)


# --------------------------------------------------------------------------- fetch window


def test_without_a_window_at_most_two_fetched_stages_are_resident():
    """One-compute-early prefetch: the stage computing and the next one, never a third."""
    for p in valid_plans():
        assert all(most_fetched(p.programs, r) <= 2 for r in range(p.workers))


def test_window_of_two_or_more_changes_no_program():
    for window in (2, 5):
        for p in valid_plans(fetch_window=window):
            default = plan(p.schedule, workers=p.workers, stages=p.stages, microbatches=p.micro)
            assert p.programs.ranks == default.programs.ranks


@pytest.mark.parametrize("forward_only", [False, True])
def test_window_of_one_holds_one_fetched_stage_with_the_same_computes(forward_only):
    """Same compute order and the same actions (the plan is verified by the dry run); only where
    a fetch is posted moves, after the previous fetched stage's release (and the owner's send
    with it)."""
    lowered = 0
    for p in valid_plans(fetch_window=1, forward_only=forward_only):
        default = plan(p.schedule, workers=p.workers, stages=p.stages, microbatches=p.micro,
                       forward_only=forward_only)
        for rank in range(p.workers):
            assert most_fetched(p.programs, rank) <= 1
            ours, theirs = p.programs.ranks[rank], default.programs.ranks[rank]
            assert [a for a in ours if a.op in COMPUTE_OPS] == [a for a in theirs if a.op in COMPUTE_OPS]
            assert sorted(map(str, ours)) == sorted(map(str, theirs))  # same actions, moved
            # where the default held two fetched stages, one stage less at peak
            before = most_fetched(default.programs, rank)
            assert (p.metrics.per_worker[rank].peak_resident_stages
                    == default.metrics.per_worker[rank].peak_resident_stages - (before == 2))
            lowered += before == 2
    assert lowered > 0


def test_window_of_one_at_fsdp_w4_holds_owned_plus_one_stage():
    """fsdp, W=4, S=4: rank 0 owns s0 and computes s1, s2, s3 back to back. Prefetching one
    compute early holds the stage computing and the next: 3 stages. With a window of 1 the
    fetch of s2 waits for s1's release: 2 stages."""
    default = plan("fsdp", workers=4)
    one = plan("fsdp", workers=4, fetch_window=1)
    assert [m.peak_resident_stages for m in default.metrics.per_worker] == [3, 3, 3, 3]
    assert [m.peak_resident_stages for m in one.metrics.per_worker] == [2, 2, 2, 2]
    program = [str(a) for a in one.programs.ranks[0]]
    assert program.index("FREE_W s1") < program.index("FETCH_W s2 <-2") < program.index(
        "F s2 b0")
    assert one.metrics.latency == default.metrics.latency  # compute order unchanged


def test_window_of_one_leaves_fsdp_at_w2_as_it_is():
    """At W=2 fsdp alternates owned and fetched stages: never two fetched ones back to back."""
    for S in (2, 4, 8):
        assert (plan("fsdp", workers=2, stages=S, fetch_window=1).programs.ranks
                == plan("fsdp", workers=2, stages=S).programs.ranks)


# --------------------------------------------------------------------------- what users read


def test_cli_prints_bytes_per_worker_and_the_window(capsys):
    argv = ["plan", "fsdp", "-w", "2", "-s", "4", "--stage-bytes", "1,2,4,8"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[-4:] == ["resident", "owned", "bytes", "peak", "bytes"][-4:]
    assert lines[4].split()[-2:] == ["5", "13"] and lines[5].split()[-2:] == ["10", "14"]
    assert main([*argv, "--json", "--fetch-window", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fetch_window"] == 1
    assert [(w["owned_bytes"], w["peak_resident_bytes"]) for w in data["per_worker"]] == [
        (5, 13), (10, 14)]
    assert main(["plan", "fsdp", "-w", "2", "--stage-bytes", "1,2,3"]) == 2
    assert "--stage-bytes has 3 values but the plan has S=2 stages" in capsys.readouterr().err


def test_plan_command_carries_the_window(capsys):
    p = plan("fsdp", workers=4, fetch_window=1)
    command = plan_command(p)
    assert "--fetch-window 1" in command
    assert main(command.split()[1:]) == 0
    assert capsys.readouterr().out.splitlines()[0] == describe(p).splitlines()[0]
    assert describe(p).splitlines()[0].endswith("fetch-window=1")
