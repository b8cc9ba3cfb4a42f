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
from benchmarks.run import BEGIN, END, table, write_doc  # noqa: E402


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
    assert all(line.count("|") == 7 for line in lines)  # a "|" in notes must not add a column


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
