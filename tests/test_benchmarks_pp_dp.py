"""The ``pp_dp_*`` rows' contract with our planner (no timing, no processes).

The torch anchor of ``benchmarks/bench_pp_dp.py`` places stages and rows by
``benchmarks/pp_dp_layout.py``; these tests check those rules against what our plan computes on
each rank and how our engine cuts the global batch, so the anchor cannot drift from ours.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_memory import pp_dp_rows  # noqa: E402
from benchmarks.bench_pp_dp import (  # noqa: E402
    DP,
    MICRO_ROWS,
    MICROBATCHES,
    PER_RANK,
    PP,
    ROWS,
    WORLD,
    ours_strategy,
    peak_cells,
)
from benchmarks.pp_dp_layout import (  # noqa: E402
    mesh_coords,
    position_stages,
    replica_micros,
    replica_rows,
)
from lightning_gsched.engine.rows import row_map  # noqa: E402
from lightning_gsched.schedule.plan import plan  # noqa: E402
from lightning_gsched.schedule.program import Op  # noqa: E402


def _computes(row_key: str) -> dict[int, tuple[set[int], set[int]]]:
    """rank -> (stages, microbatches) its program computes, for a row's own plan (default S)."""
    row = ROWS[row_key]
    p = plan(row.schedule, workers=WORLD, microbatches=MICROBATCHES, data_parallel_size=DP,
             data_parallel=row.data_parallel)
    assert p.stages == row.stages, "the row's S must be our default at P=2 x G=2"
    computes = (Op.F, Op.B, Op.W)
    return {r: ({a.stage for a in prog if a.op in computes},
                {a.micro for a in prog if a.op in computes})
            for r, prog in enumerate(p.programs.ranks)}


@pytest.mark.parametrize("row_key", list(ROWS))
def test_anchor_places_stages_and_microbatches_as_our_plan(row_key):
    row = ROWS[row_key]
    for rank, (stages, micros) in _computes(row_key).items():
        position, replica = mesh_coords(rank, DP)
        assert stages == set(position_stages(row.stages, PP)[position])
        assert micros == set(replica_micros(replica, DP, MICROBATCHES))


def test_replica_rows_are_our_microbatches_in_order():
    """The rows the anchor feeds each replica, cut by torch into equal chunks, are our
    microbatches (engine/rows.py's row map of the same ranks and batches), in order."""
    rows = PER_RANK * WORLD
    replicas = [[p * DP + g for p in range(PP)] for g in range(DP)]
    ours = row_map([PER_RANK] * WORLD, replicas, MICROBATCHES * DP)
    assert all(n == MICRO_ROWS for n in ours.micro_rows())
    for replica in range(DP):
        want = [piece.source * PER_RANK + i
                for b in replica_micros(replica, DP, MICROBATCHES)
                for piece in ours.micros[b] for i in range(piece.start, piece.stop)]
        assert replica_rows(replica, DP, MICROBATCHES, rows, PP) == want
    every = sorted(i for g in range(DP) for i in replica_rows(g, DP, MICROBATCHES, rows, PP))
    assert every == list(range(rows))


def test_layout_refuses_uneven_cuts():
    with pytest.raises(ValueError, match="positions"):
        position_stages(3, 2)
    with pytest.raises(ValueError, match="equal microbatches"):
        replica_rows(0, 2, 3, 10, 2)


def test_ours_strategy_names_the_row():
    keywords = ours_strategy(ROWS["shard"])
    assert keywords == {"kind": "gsched", "schedule": "1f1b", "microbatches": MICROBATCHES,
                        "stages": 4, "data_parallel_size": DP, "data_parallel": "shard"}


def test_peak_cells_compare_every_rank():
    mib = 2**20
    text, met, pairs = peak_cells([{"total": mib}, {"total": 3 * mib}],
                                  [{"total": 2 * mib}, {"total": 2 * mib}])
    assert not met and pairs == [[mib, 2 * mib], [3 * mib, 2 * mib]]
    assert text == "r0 1.00/2.00, r1 3.00/2.00"


def test_memory_rows_cover_both_modes_with_per_replica_microbatches():
    rows = pp_dp_rows(["1f1b"])
    assert list(rows) == ["1f1b 2x2 replicate", "1f1b 2x2 shard"]
    for label, keywords in rows.items():
        assert keywords["data_parallel"] == label.rsplit(" ", 1)[1]
        assert keywords["microbatches"] == 2 * PP and keywords["data_parallel_size"] == DP
        # each plan is valid at W=4 (the launch would otherwise fail at the first batch)
        plan(keywords["schedule"], workers=PP * DP, microbatches=keywords["microbatches"],
             data_parallel_size=DP, data_parallel=keywords["data_parallel"])


def test_markdown_shows_every_rank_of_both_row_families():
    from benchmarks.bench_pp_dp import markdown
    from benchmarks.common import Result

    mib = 2**20
    speed = Result("pp_dp_shard_vs_fsdp2_pp", 1.0, 1.0, round_ratios=[0.9, 1.1],
                   round_cpu_ratios=[1.0, 1.0], ours_cpu_s=1.0, anchor_cpu_s=1.0,
                   extra={"loss_ours": 5.5, "loss_anchor": 5.5,
                          "peak_bytes_ours_anchor": [[mib, 2 * mib]]})
    memory = Result("memory[1f1b 2x2 shard]", 1.1 * mib, mib, unit="bytes",
                    extra={"predicted": [{"total": mib}, {"total": 2 * mib}],
                           "measured_events": [{"total": mib}, {"total": 3 * mib}]})
    text = markdown([speed, memory, Result("memory[1f1b]", 1.0, 1.0)])
    assert "| pp_dp_shard_vs_fsdp2_pp | 1.000 (0.900-1.100) | 1.000 | 5.5000 / 5.5000 | " \
           "r0 1.00/2.00 |" in text
    assert "| memory[1f1b 2x2 shard] | r0 1.000, r1 1.500 | r0 1.00/1.00, r1 3.00/2.00 |" in text
    assert "memory[1f1b] " not in text
    assert markdown([Result("memory[1f1b]", 1.0, 1.0)]) is None
