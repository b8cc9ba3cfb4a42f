"""The bytes model against the process: a deferred fit's resident-set growth per rank.

The prediction (``strategy.memory_report.predicted[rank].peak``, docs/memory.md) counts the
tensors the rank's program holds. Here it is checked against what the OS says the rank held,
independently of the runtime's own accounting: each rank resets its resident-set high-water
mark before the model exists and reads it after ``fit`` (``benchmarks/bench_process_memory.py``,
the same function the ``memory_process[...]`` benchmark rows run, on fresh processes so no
earlier test's freed heap hides or adds pages).

Bounds, per rank, and why they hold on any x86 Linux machine (not because they passed once):

* growth <= 1.25 x predicted + 64 MiB (issue 23's goal): the process also holds autograd's
  transient gradients (one parameter-sized tensor per backward job), the heap's fragmentation
  within a step (the runtime returns free heap pages to the OS at every step start,
  runtime/host_heap.py) and ~40-60 MiB of modules imported at the first batch and gloo's
  buffers. Before the previous step's gradients were dropped and the heap trimmed, the same
  runs grew by 1.4-1.8x the prediction, so the bound catches both regressions.
* growth >= 0.85 x predicted: every byte the prediction counts is a tensor the rank writes
  (weights it initialises, gradients, Adam's zero-filled moments), so it must be resident at
  the peak; only heap memory that was already free before the model existed (a few MiB after
  the imports) can hold part of it without growing the resident set.

Parameters are 16 x Linear(2048, 2048) (256 MiB fp32) with Adam at W=2 (about 512 MiB
predicted per rank): the bound's slack is fixed, and on a much smaller model the first step's
fixed costs (the build's freed scratch still in the heap when the first schedule runs, about
100 MiB) would dominate the comparison instead of the bytes model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                       reason="needs Linux's /proc/self/clear_refs to reset the RSS peak"),
]

MIB = 2**20
CONFIG = {"layers": 16, "width": 2048, "steps": 3}


@pytest.mark.parametrize("schedule", ["1f1b", "fsdp"])
def test_process_peak_follows_the_prediction(schedule: str) -> None:
    from benchmarks.common import launch

    result = launch("benchmarks.bench_process_memory:rss_run", 2, timeout=300.0,
                    schedule=schedule, **CONFIG)
    for r in result["ranks"]:
        growth, predicted = r["growth"], r["predicted"]
        where = (f"{schedule} rank {r['rank']}: RSS grew {growth / MIB:.0f} MiB, predicted "
                 f"peak {predicted / MIB:.0f} MiB ({r['predicted_at_peak']})")
        assert growth <= 1.25 * predicted + 64 * MIB, where
        assert growth >= 0.85 * predicted, where
        # deferred: the rank gave storage to its own stages only, never the whole model
        assert r["params"] < CONFIG["layers"] * (CONFIG["width"] + 1) * CONFIG["width"] * 4, where
