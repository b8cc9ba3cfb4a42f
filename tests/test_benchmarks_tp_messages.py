"""The ``tp_messages`` rows' premises (no timing, no processes).

The rows (``benchmarks/bench_tp_messages.py``) quote, beside the times, what each route moves:
checked here for any T, so the byte figures in the notes and docs/benchmarks.md rest on one rule.
The routes themselves check their delivery in every run (each receiving rank compares the first
message with the payload).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_tp_messages import FULL, QUICK, ROUTES, size_label, wire_bytes  # noqa: E402


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_both_routes_leave_the_message_on_every_receiving_rank_and_move_t_copies(t: int) -> None:
    x = 3 * 2**20
    per_rank, broadcast = (wire_bytes(route, x, t) for route in ROUTES)
    for moved in (per_rank, broadcast):
        assert moved["received"] == [0] * t + [x] * t
        assert sum(moved["sent"]) == sum(moved["received"]) == t * x
        assert moved["between_workers"] + moved["inside_worker"] == t * x
    assert per_rank["between_workers"] == t * x and per_rank["hops_in_sequence"] == 1
    assert broadcast["between_workers"] == x and broadcast["inside_worker"] == (t - 1) * x
    assert broadcast["sent"][0] == x and sum(broadcast["sent"][1:t]) == 0  # t = 0 sends alone
    with pytest.raises(ValueError, match="route"):
        wire_bytes("scatter", x, t)


def test_sizes_are_labelled_as_the_docs_name_them() -> None:
    assert [size_label(s) for s in FULL["sizes"]] == ["64 KiB", "1 MiB", "8 MiB", "32 MiB"]
    assert set(QUICK["sizes"]) <= set(FULL["sizes"])
