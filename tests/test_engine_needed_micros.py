"""The engine's row exchange reads which microbatches each rank needs from the placement
table (``engine.step_rows.needed_micros``), not from every rank's program: the same answer as the
programs give (``runtime.stage_micros``), for every library schedule, training and
forward-only, checked here against the programs themselves."""

from __future__ import annotations

import pytest

from lightning_gsched.engine.step_rows import needed_micros
from lightning_gsched.runtime import stage_micros
from lightning_gsched.schedule.library import LIBRARY
from lightning_gsched.schedule.plan import plan


@pytest.mark.parametrize("schedule", sorted(LIBRARY))
@pytest.mark.parametrize("forward_only", [False, True])
def test_table_gives_what_the_programs_give(schedule: str, forward_only: bool) -> None:
    W = 4
    S = 8 if schedule in ("zbv", "v-half", "v-min", "interleaved", "lpp") else 4
    p = plan(schedule, W, stages=S, microbatches=8, forward_only=forward_only)
    from_programs = []
    for r in range(W):
        first, last = stage_micros(p.programs, r)
        from_programs.append(sorted(set(first) | set(last)))
    assert needed_micros(p.table.compute, W) == from_programs


@pytest.mark.parametrize("schedule", sorted(LIBRARY))
def test_per_replica_loading_reads_only_its_replicas_rows(schedule: str) -> None:
    """``data_loading="per_replica"``: for every library schedule at W=4 (as 2 x 2 where the
    schedule composes with data parallelism), the microbatches each rank reads are all cut
    from its own replica's batch, which each of its ranks loaded whole: a step moves no rows
    (no transfer from the row arithmetic, engine/rows.py). Under ``"per_rank"`` the same plan
    moves rows (the contrast shows the check can fail), except ddp's and fsdp's, where each
    rank reads only the rows it loaded either way."""
    from lightning_gsched.engine.config import ScheduleConfig
    from lightning_gsched.engine.rows import row_map, transfers

    W = 4
    G = 1 if schedule in ("ddp", "fsdp") else 2
    keywords = dict(schedule=schedule, microbatches=4, data_parallel_size=G)
    per_replica = ScheduleConfig.from_keywords(data_loading="per_replica", **keywords)
    per_rank = ScheduleConfig.from_keywords(**keywords)
    p = per_replica.training_plan(W)
    moved = []
    for config in (per_replica, per_rank):
        workers = [config.workers(W, r) for r in range(W)]
        layout = config.replicas(W)
        positions = workers[0].positions
        cut = row_map([8] * positions, [workers[0].members(layout.members(g))
                                        for g in range(layout.replicas)], p.micro)
        wanted = workers[0].by_position(needed_micros(p.table.compute, W))
        moved.append(transfers(cut, wanted))
        # a rank's position is whose batch it loaded: every rank of replica g loads g's
        assert [w.position for w in workers] == (
            [layout.replica(r) for r in range(W)] if config is per_replica else list(range(W)))
    assert moved[0] == [], schedule
    assert (moved[1] == []) == (schedule in ("ddp", "fsdp")), schedule


def test_per_replica_peers_and_refusals() -> None:
    """With tensor parallelism (W=8 as P=2 x G=2 x T=2, rank (p * G + g) * T + t) a position
    is a replica, its peer the rank at this rank's pipeline position and t in that replica;
    ``"auto"`` and an unknown value are refused, naming the fix."""
    from lightning_gsched.engine.config import ScheduleConfig
    from lightning_gsched.errors import ScheduleConfigError, StrategyConfigError

    config = ScheduleConfig.from_keywords(schedule="1f1b", data_parallel_size=2,
                                          tensor_parallel_size=2, data_loading="per_replica")
    workers = config.workers(8, 5)  # worker 2 = p 1, g 0; t 1
    assert (workers.positions, workers.position) == (2, 0)
    assert workers.peers() == [5, 7]  # (1 * 2 + g) * 2 + 1
    assert workers.members([0, 2]) == [0] and workers.members([1, 3]) == [1]
    assert workers.by_position([[0], [1], [2, 0], [3]]) == [[0, 2], [1, 3]]
    # replica 0 is ranks 0, 1, 4, 5 (workers 0 and 2), replica 1 ranks 2, 3, 6, 7
    assert workers.batch_rows([4] * 8, [7] * 8, [1, 1, 2, 2, 1, 1, 2, 2]) == ([4, 4], [7, 7])
    with pytest.raises(StrategyConfigError, match=r"ranks \[2, 3, 6, 7\] of data-parallel replica 1"):
        workers.batch_rows([4] * 8, [7] * 8, [1, 1, 2, 2, 1, 1, 2, 3])
    with pytest.raises(ScheduleConfigError, match=r"fix the replicas \(data_parallel_size="):
        ScheduleConfig.from_keywords(schedule="auto", data_loading="per_replica")
    with pytest.raises(ScheduleConfigError, match="one tensor_parallel_size"):
        ScheduleConfig.from_keywords(schedule="auto", data_loading="per_replica",
                                     data_parallel_size=2, tensor_parallel_size=[1, 2])
    # "auto" with G and T fixed: the replicas are known before the pick (the sampler's shares)
    auto = ScheduleConfig.from_keywords(schedule="auto", data_loading="per_replica",
                                        data_parallel_size=2, tensor_parallel_size=2)
    assert not auto.decided
    assert [auto.workers(8, r).position for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    with pytest.raises(ScheduleConfigError, match="data_loading"):
        ScheduleConfig.from_keywords(schedule="1f1b", data_loading="per_node")
