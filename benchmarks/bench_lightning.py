"""``ddp_vs_lightning`` and ``single_process_overhead``: GeneralParallel against Lightning itself.

Both compare full Lightning steps (forward, backward, gradient reduction, optimizer, logging)
of the same model, data and Trainer options with only the strategy changed, alternating the
two sides in fresh processes (see :func:`benchmarks.common.alternate`).
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.common import Result, alternate, launch, median, spread, steady


def _side(strategy: dict[str, Any], world: int, steps: int, warmup: int, per_rank: int,
          losses: list[float]) -> Any:
    def measure() -> list[float]:
        r = launch("benchmarks.lit_runs:fit_timed", world, strategy=strategy, steps=steps,
                   per_rank=per_rank)
        if r["loss"] is not None:
            losses.append(r["loss"])
        return steady(r["times"], warmup)

    return measure


def _compare(name: str, ours: dict[str, Any], anchor: dict[str, Any], world: int, goal: str,
             quick: bool, per_rank: int, what: str) -> Result:
    steps, warmup, rounds = (14, 4, 2) if quick else (34, 4, 3)
    losses: dict[str, list[float]] = {"ours": [], "anchor": []}
    times = alternate({
        "anchor": _side(anchor, world, steps, warmup, per_rank, losses["anchor"]),
        "ours": _side(ours, world, steps, warmup, per_rank, losses["ours"]),
    }, rounds)
    return Result(
        name=name, ours_s=median(times["ours"]), anchor_s=median(times["anchor"]), goal=goal,
        notes=(f"{what}; {world} proc x {per_rank} rows; median of {len(times['ours'])} steps "
               f"per side over {rounds} alternated runs; IQR/median ours "
               f"{spread(times['ours']):.0%}, anchor {spread(times['anchor']):.0%}"),
        extra={"ours_samples": times["ours"], "anchor_samples": times["anchor"],
               "final_loss_ours": losses["ours"], "final_loss_anchor": losses["anchor"],
               "world": world, "per_rank_batch": per_rank},
    )


def ddp_vs_lightning(quick: bool) -> Result:
    return _compare("ddp_vs_lightning", {"kind": "gsched", "schedule": "ddp"},
                    {"kind": "lightning_ddp"}, 2, "<= 1.00", quick, 8,
                    "GeneralParallel('ddp') vs Lightning DDPStrategy")


def single_process_overhead(quick: bool) -> Result:
    return _compare("single_process_overhead", {"kind": "gsched", "schedule": "ddp"},
                    {"kind": "single"}, 1, "<= 1.05", quick, 16,
                    "GeneralParallel('ddp') on 1 device (S=1, B=1) vs a plain Trainer")


def run(quick: bool) -> list[Result]:
    return [ddp_vs_lightning(quick), single_process_overhead(quick)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for r in run(args.quick):
        print(f"{r.name:26s} ours {r.ours_s * 1e3:7.1f} ms  anchor {r.anchor_s * 1e3:7.1f} ms  "
              f"ratio {r.ratio:.3f}  {r.notes}")


if __name__ == "__main__":
    main()
