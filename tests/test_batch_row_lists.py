"""A batch's list of one plain value per row (sample ids) is cut with the rows, or refused.

``default_collate`` gives a list of strings for a string field: a value per row that is not a
tensor. It was taken for a plain value that must be equal on every rank, so the ranks' batches
had "different layouts" (under the default loading), and under ``per_replica`` every
microbatch got the whole list beside its own rows (found by probing). Now each microbatch gets
its rows of it, and a step that would move such rows between ranks refuses it, naming it.
One process: the cut (engine/batches.py) without a row that travels.
"""

from __future__ import annotations

import pytest
import torch

from lightning_gsched.engine.batches import exchange_rows, layout_digest
from lightning_gsched.engine.rows import row_map
from lightning_gsched.errors import BatchSplitError


def _batch(first: int, rows: int) -> dict:
    return {"x": torch.arange(first, first + rows, dtype=torch.float32).reshape(rows, 1),
            "ids": [f"row{i}" for i in range(first, first + rows)], "flag": True}


def test_each_microbatch_gets_its_rows_of_the_list() -> None:
    batch = _batch(0, 6)
    cut = row_map([6], [[0]], 3)  # one position loads the whole batch (per_replica)
    micros = exchange_rows(batch, cut, 0, [[0, 1, 2]])
    for b, micro in micros.items():
        assert micro["ids"] == [f"row{i}" for i in range(2 * b, 2 * b + 2)]
        assert micro["x"].reshape(-1).tolist() == [2.0 * b, 2.0 * b + 1]
        assert micro["flag"] is True


def test_lists_of_other_rows_keep_the_layout_and_a_move_is_refused_naming_it() -> None:
    # the ranks' lists differ in their values, not in their layout per row
    assert layout_digest(_batch(0, 3)) == layout_digest(_batch(3, 3))
    assert layout_digest({**_batch(0, 3), "flag": False}) != layout_digest(_batch(3, 3))
    cut = row_map([3, 3], [[0, 1]], 2)  # two ranks of one replica, a microbatch of each
    wanted = [[0, 1], [0, 1]]  # every rank reads both microbatches: rows must move
    with pytest.raises(BatchSplitError, match=r"batch\['ids'\] is a list of one value per row "
                                              r".*data_loading='per_replica'"):
        exchange_rows(_batch(0, 3), cut, 0, wanted)
