"""The join of per-microbatch step returns for one rank's hooks (engine/step_outputs.py).

Microbatch returns are built here from one "whole batch" return, as a step computing per-row
values would return them, and the join must give back each rank's rows of it, whatever the
microbatches mix; float means come back as the global batch's weighted mean.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_gsched.engine.rows import row_map
from lightning_gsched.engine.step_outputs import rank_step_outputs, training_extras


def _micro_returns(whole: torch.Tensor, cut) -> dict[int, dict]:
    """What each microbatch's step returns: its rows of ``whole`` (rows of the ranks'
    batches concatenated in rank order) and their mean."""
    starts = [0]
    for rows in cut.rows:
        starts.append(starts[-1] + rows)
    out = {}
    for b, pieces in enumerate(cut.micros):
        rows = torch.cat([whole[starts[p.source] + p.start:starts[p.source] + p.stop]
                          for p in pieces])
        out[b] = {"rows": rows, "mean": rows.mean(), "kind": "x", "first": int(rows[0, 0])}
    return out


@pytest.mark.parametrize("rows,parts", [([6, 6], 3), ([5, 3, 4], 4), ([3, 0], 3)])
def test_each_rank_gets_its_rows_and_the_global_mean(rows: list[int], parts: int) -> None:
    cut = row_map(rows, [list(range(len(rows)))], parts)
    whole = torch.arange(sum(rows) * 2, dtype=torch.float32).reshape(-1, 2) ** 1.5
    returns = _micro_returns(whole, cut)
    start = 0
    for rank, count in enumerate(rows):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = rank_step_outputs(returns, cut, rank, "step")
        torch.testing.assert_close(got["rows"], whole[start:start + count])
        torch.testing.assert_close(got["mean"], whole.mean())
        assert got["kind"] == "x"
        # an int that differs between microbatches cannot be attributed to rows
        assert got["first"] is None
        assert any("step['first']" in str(w.message) for w in caught)
        start += count


def test_mismatched_structures_give_none_with_a_warning() -> None:
    cut = row_map([2, 2], [[0, 1]], 2)
    returns = {0: {"a": torch.ones(2)}, 1: {"b": torch.ones(2)}}
    with pytest.warns(UserWarning, match="differently structured"):
        assert rank_step_outputs(returns, cut, 0, "step") is None


def test_training_extras_are_the_other_keys_detached() -> None:
    weight = torch.ones(2, requires_grad=True)
    assert training_extras(weight.sum()) is None
    assert training_extras({"loss": weight.sum()}) is None
    extras = training_extras({"loss": weight.sum(), "scaled": weight * 2})
    assert extras is not None and set(extras) == {"scaled"}
    assert not extras["scaled"].requires_grad


def test_large_returns_are_warned_of_once_per_hook(monkeypatch) -> None:
    from lightning_gsched.engine import step_outputs

    monkeypatch.setattr(step_outputs, "LARGE_OUTPUTS_BYTES", 1000)
    big = {0: {"logits": torch.zeros(4, 100)}}  # 1,600 bytes
    with pytest.warns(UserWarning, match=r"M.validation_step returned 0 MiB in one step .* "
                                         r"Return only what your hooks use"):
        step_outputs.warn_if_large(big, "M.validation_step")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step_outputs.warn_if_large(big, "M.validation_step")  # once per hook
        step_outputs.warn_if_large({0: torch.zeros(2)}, "M.test_step")  # small: no warning
