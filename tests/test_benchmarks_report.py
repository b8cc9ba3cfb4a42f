"""The benchmark report plumbing (no timing here: benchmarks are scripts, not tests).

What is checked is what a reader relies on: ratio = ours / anchor, failed rows still shown,
JSON carrying the ratio, and ``--doc`` replacing only the generated block of the results page,
idempotently, so hand-written analysis around it survives every regeneration.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import Result, median, spread  # noqa: E402
from benchmarks.run import BEGIN, END, repeat_table, table, write_doc  # noqa: E402


def rows() -> list[Result]:
    return [
        Result("ddp_vs_lightning", 0.110, 0.100, goal="<= 1.00", notes="a | b"),
        Result("fidelity", None, None, notes="FAILED: LaunchError: rank 1"),
        Result("planner_speed", 0.5, 1.0, goal="< 1 s"),
    ]


def test_ratio_is_ours_over_anchor_and_missing_sides_give_none():
    ddp, failed, planner = rows()
    assert abs(ddp.ratio - 1.1) < 1e-12 and planner.ratio == 0.5
    assert failed.ratio is None
    payload = json.loads(json.dumps([r.as_json() for r in rows()]))
    assert payload[0]["ratio"] == ddp.ratio and payload[1]["ratio"] is None


def test_tables_show_every_row_including_failures():
    text = table(rows())
    assert "1.100" in text and "FAILED: LaunchError" in text and "110.0 ms" in text
    markdown = table(rows(), markdown=True)
    lines = markdown.splitlines()
    assert len(lines) == 2 + len(rows())
    assert all(line.count("|") == 9 for line in lines)  # a "|" in notes must not add a column


def test_doc_block_is_replaced_in_place_and_idempotently(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text(f"# Title\n\nintro\n\n{BEGIN}\nold table\n{END}\n\n## Analysis\nkept\n")
    write_doc(page, rows(), {"markdown": {"Scaling": "| a |\n|---|"}}, quick=True, seconds=61)
    first = page.read_text()
    assert "old table" not in first
    assert first.startswith("# Title\n\nintro\n\n") and first.endswith("## Analysis\nkept\n")
    assert "ddp_vs_lightning" in first and "#### Scaling" in first and "CPU-only" in first
    write_doc(page, rows(), {"markdown": {}}, quick=True, seconds=61)
    second = page.read_text()
    assert second.count(BEGIN) == 1 and second.count(END) == 1 and "#### Scaling" not in second


def test_median_and_spread():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert spread([1.0, 1.0, 1.0, 1.0]) == 0.0
    assert spread([1.0, 2.0, 3.0, 4.0, 5.0]) > 0


def test_rows_measured_in_rounds_report_the_median_round_ratio_and_its_spread():
    row = Result("pipeline_vs_torch[1f1b]", 0.30, 0.20, round_ratios=[1.10, 0.90, 1.00, 1.30],
                 ours_cpu_s=0.6, anchor_cpu_s=0.5, round_cpu_ratios=[1.2, 1.1, 1.3])
    assert abs(row.ratio - 1.05) < 1e-12  # the rounds' median, not 0.30 / 0.20
    assert row.spread == (0.90, 1.30) and abs(row.cpu_ratio - 1.2) < 1e-12
    assert Result("x", 0.3, 0.2).spread is None and Result("x", 0.3, 0.2).cpu_ratio is None
    payload = json.loads(json.dumps(row.as_json()))
    assert payload["spread"] == [0.90, 1.30] and payload["ratio"] == row.ratio
    text = table([row])
    assert "1.050" in text and "0.900-1.300" in text and "1.200 (600/500 ms)" in text


def test_repeat_table_gives_each_rows_largest_deviation_from_its_median():
    runs = [[Result("a", 1.0, 1.0), Result("b", 1.0, 2.0)],
            [Result("a", 1.1, 1.0)],  # b failed to appear in this run
            [Result("a", 0.96, 1.0), Result("b", 1.0, 2.0)]]
    lines = {line.split()[0]: line.split() for line in repeat_table(runs).splitlines()[2:]}
    assert lines["a"][1:6] == ["1.000", "1.100", "0.960", "1.000", "10.0%"]
    assert lines["b"][1:6] == ["0.500", "-", "0.500", "0.500", "0.0%"]
    assert repeat_table(runs, markdown=True).count("\n") == 3


def test_efficiency_parts_add_up_to_the_measured_step_and_the_bubble_is_fill_and_drain():
    from benchmarks.efficiency import PARTS, breakdown
    from lightning_gsched.schedule.plan import plan

    # 1F1B on 2 stages, 4 microbatches, F = 1 s and B = 2 s per stage: the compute-only step is
    # (B + S - 1)(F + B) = 15 s; each rank works 4 x 3 = 12 s, so the bubble is (S - 1)(F + B)
    offline = plan("1f1b", workers=2, microbatches=4, forward_cost=[1.0, 1.0],
                   backward_cost=[2.0, 2.0])
    r = {"schedule": "1f1b", "W": 2, "S": 2, "B": 4, "R": offline.R,
         "forward_cost_s": [1.0, 1.0], "backward_cost_s": [2.0, 2.0], "weight_cost_s": None,
         "predicted_compute_only_s": offline.metrics.latency,
         "inrun_forward_cost_s": [1.0, 1.0], "inrun_backward_cost_s": [2.0, 2.0],
         "inrun_weight_cost_s": None, "single_process_s": 20.0, "predicted_s": 16.0,
         "measured_s": 17.5, "lightning_step_s": 18.0}
    parts = breakdown(r)
    assert abs(sum(parts[p] for p in PARTS) - 17.5) < 1e-9
    assert parts["ideal"] == 10.0 and abs(parts["microbatch_compute"] - 2.0) < 1e-9
    assert abs(parts["bubble"] - 3.0) < 1e-9 and abs(parts["communication"] - 1.0) < 1e-9
    assert abs(parts["runtime_overhead"] - 1.5) < 1e-9 and parts["lightning_loop"] == 0.5


def test_launch_pins_each_rank_to_its_own_core_unless_disabled(monkeypatch):
    import os

    from benchmarks.common import core_plan, launch_ranks

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        import pytest

        pytest.skip("pinning needs at least two cores")
    placed = launch_ranks("benchmarks.common:affinity", 2, timeout=120)
    assert placed == [[cores[0]], [cores[1]]]
    assert core_plan(len(cores) + 1) == [None] * (len(cores) + 1)  # more ranks than cores
    monkeypatch.setenv("GSCHED_BENCH_PIN", "0")
    assert core_plan(2) == [None, None]
    assert launch_ranks("benchmarks.common:affinity", 2, timeout=120) == [cores, cores]


def test_spearman_ranks_ties_by_their_mean_rank_and_orders_as_expected():
    import pytest

    from benchmarks.rank_stats import ranks, spearman

    assert ranks([3.0, 1.0, 2.0, 1.0]) == [4.0, 1.5, 3.0, 1.5]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # one swapped pair out of four: 1 - 6 * 2 / (4 * 15) = 0.8
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="constant"):
        spearman([1, 2, 3], [5, 5, 5])


def test_tune_benchmark_measures_the_top_fitting_then_random_others():
    from benchmarks.bench_tune import choose
    from lightning_gsched.schedule.tune import Candidate, Verdict

    def verdict(i: int, fits: bool, costed: bool = True) -> Verdict:
        c = Candidate("gpipe", 2, 2 + i, None, False, 1)
        return Verdict(c, float(i) if costed else None, 100, fits)

    verdicts = [verdict(i, fits=i % 2 == 0) for i in range(20)] + [verdict(99, False, False)]
    chosen = choose(verdicts, top=3, extra=4, seed=0)
    assert [v.candidate.micro - 2 for v in chosen[:3]] == [0, 2, 4]  # the fitting head, in order
    rest = chosen[3:]
    assert len(rest) == 4 and all(v.step_time is not None for v in rest)
    assert len({v.candidate.text() for v in chosen}) == 7  # no candidate twice


def test_fidelity_replays_each_profiled_step_and_takes_the_median_one():
    from benchmarks.bench_fidelity import median_step, replay_per_step, split_steps
    from lightning_gsched.schedule.plan import plan

    assert split_steps(8, 2) == {"profile": [2, 4, 6], "measured": [3, 5, 7]}
    p = plan("gpipe", workers=2, microbatches=2, forward_cost=[1.0, 1.0],
             backward_cost=[2.0, 2.0])

    def step(scale):  # one step's job times on each rank: rank r runs stage r
        return [{("F", r): [scale] * 2, ("B", r): [2 * scale] * 2} for r in range(2)]

    # three profiled steps, the second hit by a burst (every job 5x): per rank, per step
    steps = [step(1.0), step(5.0), step(1.1)]
    per_rank = [[s[r] for s in steps] for r in range(2)]
    replays = replay_per_step(p, per_rank, 2, False, {})
    assert [round(r["latency"], 6) for r in replays] == [
        round(p.metrics.latency * k, 6) for k in (1.0, 5.0, 1.1)]
    chosen = median_step(replays)
    assert chosen is replays[2] and chosen["costs"] == [[1.1, 1.1], [2.2, 2.2]]
