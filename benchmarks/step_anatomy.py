"""Where a pipeline step goes, ours against torch's, phase by phase on each rank.

Why: ``pipeline_engine_vs_torch`` gives one ratio per schedule; it does not say whether a gap is
in the computations (the same forward and backward run slower), in waiting inside the schedule,
or around it (what a step does before its first computation and after its last). This script
times those parts on both sides of that row, in the same alternated rounds and reused processes
(:mod:`benchmarks.rounds`), by wrapping from outside the code under test the same four kinds of
calls on each side with the same timer:

* the step: ours ``GeneralParallelFabric.step``, torch's ``schedule.step``;
* each computation: ours ``StageCompute.forward`` / ``backward`` / ``weight``, torch's
  ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk`` of its stages
  (ours' forward of the last stage includes the user's loss code, torch's its ``loss_fn``);
* the optimizer's ``step`` (SGD, the row's optimizer on both sides).

Per rank and side, the medians over every steady step of every round (ms):

* ``step``: the loop's step (schedule step + optimizer + ``zero_grad``), as the row times it;
* ``before``: from entering the schedule step to the start of its first computation (ours:
  the batch-size exchange, the row exchange, capturing the first stage's calls, the step's
  set-up; torch's: posting its first receives);
* ``after``: from the end of the last computation to leaving the schedule step (ours: the end
  of the program, the loss exchange, the gradients' hand-over);
* ``busy``: the sum of the computations; ``inside``: the rest of the time between the first
  computation's start and the last's end (waiting for messages, the transport's own work);
* ``F``, ``B``, ``W``: the median single computation of each kind.

    python -m benchmarks.step_anatomy [--rows gpipe 1f1b ...] [--rounds 3] [--steps 10]
                                      [--torch-peak]

Not a table row: a diagnosis of ``pipeline_engine_vs_torch`` (docs/benchmarks.md, "Where the
engine's gap is, phase by phase").
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Sequence

from benchmarks.bench_engine import _engine_side, torch_order_caps
from benchmarks.bench_pipeline import ROWS, WARMUP, WORLD, _anchor_side
from benchmarks.rounds import Side, measure

MODULE = "benchmarks.step_anatomy"
KINDS = {"forward": "F", "backward": "B", "weight": "W"}
PARTS = ("step", "before", "after", "busy", "inside", "optimizer", "F", "B", "W")


class Recorder:
    """``(kind, start, end)`` of every call of the wrapped methods, in call order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, kind: str) -> None:
        original = getattr(owner, name)
        events = self.events

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                events.append((kind, start, time.perf_counter()))

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()


def _recorded(fit: Callable[..., dict[str, Any]], wraps: Sequence[tuple[Any, str, str]],
              **kwargs: Any) -> dict[str, Any]:
    recorder = Recorder()
    for owner, name, kind in wraps:
        recorder.wrap(owner, name, kind)
    try:
        out = fit(**kwargs)
    finally:
        recorder.restore()
    out["events"] = recorder.events
    return out


def ours(rank: int, world: int, **kwargs: Any) -> dict[str, Any]:
    """``bench_engine.engine_timed`` with its step, computations and optimizer timed."""
    import torch

    from benchmarks.bench_engine import engine_timed
    from lightning_gsched.fabric.strategy import GeneralParallelFabric
    from lightning_gsched.runtime.compute import StageCompute

    wraps = [(GeneralParallelFabric, "step", "S"), (torch.optim.SGD, "step", "O"),
             *((StageCompute, name, kind) for name, kind in KINDS.items())]
    return _recorded(engine_timed, wraps, rank=rank, world=world, **kwargs)


def anchor(rank: int, world: int, **kwargs: Any) -> dict[str, Any]:
    """``bench_pipeline.torch_pipeline_timed`` with the same parts timed."""
    import torch
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from benchmarks.bench_pipeline import torch_pipeline_timed

    wraps = [(schedules.PipelineScheduleSingle, "step", "S"),
             (schedules.PipelineScheduleMulti, "step", "S"), (torch.optim.SGD, "step", "O"),
             (_PipelineStageBase, "forward_one_chunk", "F"),
             (_PipelineStageBase, "backward_one_chunk", "B"),
             (_PipelineStageBase, "backward_weight_one_chunk", "W")]
    return _recorded(torch_pipeline_timed, wraps, rank=rank, world=world, **kwargs)


def steps_of(events: list[tuple[str, float, float]]) -> list[list[tuple[str, float, float]]]:
    """The events cut into steps: each step ends with its optimizer step."""
    steps: list[list[tuple[str, float, float]]] = [[]]
    for event in events:
        steps[-1].append(event)
        if event[0] == "O":
            steps.append([])
    return [s for s in steps if any(kind == "O" for kind, _, _ in s)]


def parts_of(step: list[tuple[str, float, float]], loop_time: float) -> dict[str, list[float]]:
    """One step's parts (seconds; F, B, W: each computation's)."""
    schedule = next(e for e in reversed(step) if e[0] == "S")
    optimizer = next(e for e in reversed(step) if e[0] == "O")
    computes = [e for e in step if e[0] in "FBW" and schedule[1] <= e[1] <= schedule[2]]
    busy = sum(end - start for _, start, end in computes)
    parts = {"step": [loop_time], "optimizer": [optimizer[2] - optimizer[1]],
             "busy": [busy], "before": [computes[0][1] - schedule[1]],
             "after": [schedule[2] - max(end for _, _, end in computes)],
             "inside": [max(end for _, _, end in computes) - computes[0][1] - busy]}
    for kind in "FBW":
        parts[kind] = [end - start for k, start, end in computes if k == kind]
    return parts


def anatomy(outputs: list[list[dict[str, Any]]], warmup: int) -> list[dict[str, float | None]]:
    """Per rank, the median of every part over every round's steady steps (ms; None: no such
    computation on that side)."""
    ranks = []
    for rank in range(len(outputs[0])):
        pooled: dict[str, list[float]] = {part: [] for part in PARTS}
        for per_rank in outputs:
            out = per_rank[rank]
            for i, step in enumerate(steps_of(out["events"])):
                if i < warmup:
                    continue
                for part, values in parts_of(step, out["times"][i]).items():
                    pooled[part] += values
        ranks.append({part: (round(statistics.median(v) * 1e3, 2) if v else None)
                      for part, v in pooled.items()})
    return ranks


def run(rows: Sequence[str], rounds: int, steps: int, torch_peak: bool = False) -> None:
    """Each row's table; ``torch_peak``: ours at torch's per-rank peaks where they differ from
    our default caps (the same order as torch's: ``bench_engine.torch_order_caps``)."""
    for schedule in rows:
        cap = torch_order_caps(schedule) if torch_peak else None
        engine, torch_side = _engine_side(schedule, steps, cap=cap), _anchor_side(schedule, steps)
        runs = measure({"ours": Side(f"{MODULE}:ours", engine.kwargs),
                        "torch": Side(f"{MODULE}:anchor", torch_side.kwargs)},
                       WORLD, rounds, WARMUP)
        at = "" if cap is None else f" (ours at torch's peaks, cap={cap})"
        print(f"\n{schedule}{at}: medians over {rounds} rounds x {steps - WARMUP} steady steps, ms")
        print("rank side  " + " ".join(f"{p:>9}" for p in PARTS))
        tables = {name: anatomy(r.outputs, WARMUP) for name, r in runs.items()}
        for rank in range(WORLD):
            for name, table in tables.items():
                cells = [f"{'-' if v is None else v:>9}" for v in table[rank].values()]
                print(f"{rank:>4} {name:<5} " + " ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--torch-peak", action="store_true",
                        help="ours at torch's per-rank peaks where they differ from our caps")
    args = parser.parse_args()
    run(args.rows, args.rounds, args.steps, args.torch_peak)


if __name__ == "__main__":
    main()
