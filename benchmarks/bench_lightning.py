"""``ddp_vs_lightning`` and ``single_process_overhead``: GeneralParallel against Lightning itself.

Both compare full Lightning steps (forward, backward, gradient reduction, optimizer, logging)
of the same model, data and Trainer options with only the strategy changed, alternating the
two sides in rounds (see :mod:`benchmarks.rounds`).
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import Result, bench_main
from benchmarks.rounds import Side, measure, ratio_result

WARMUP = 3
# steps per fit (warm-up included) and alternated rounds; quick is what `make bench` runs
QUICK = {"steps": 9, "rounds": 6}
FULL = {"steps": 14, "rounds": 10}


def _compare(name: str, ours: dict[str, Any], anchor: dict[str, Any], world: int, goal: str,
             quick: bool, per_rank: int, what: str) -> Result:
    cfg = QUICK if quick else FULL

    def side(strategy: dict[str, Any]) -> Side:
        return Side("benchmarks.lit_runs:fit_timed",
                    {"strategy": strategy, "steps": cfg["steps"], "per_rank": per_rank})

    runs = measure({"ours": side(ours), "anchor": side(anchor)}, world, cfg["rounds"], WARMUP)
    losses = {k: [out[0]["loss"] for out in runs[k].outputs] for k in runs}
    return ratio_result(
        name, runs["ours"], runs["anchor"], goal, f"{what}; {world} proc x {per_rank} rows",
        extra={"final_loss_ours": losses["ours"], "final_loss_anchor": losses["anchor"],
               "world": world, "per_rank_batch": per_rank, "steps_per_fit": cfg["steps"]},
    )


def ddp_vs_lightning(quick: bool) -> Result:
    return _compare("ddp_vs_lightning", {"kind": "gsched", "schedule": "ddp"},
                    {"kind": "lightning_ddp"}, 2, "<= 1.00", quick, 8,
                    "GeneralParallel('ddp') vs Lightning DDPStrategy")


def single_process_overhead(quick: bool) -> Result:
    return _compare("single_process_overhead", {"kind": "gsched", "schedule": "ddp"},
                    {"kind": "single"}, 1, "<= 1.03", quick, 16,
                    "GeneralParallel('ddp') on 1 device (S=1, B=1) vs a plain Trainer")


def run(quick: bool) -> list[Result]:
    return [ddp_vs_lightning(quick), single_process_overhead(quick)]


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, __doc__.splitlines()[0], run, None, "",
               skip_keys=("ours_round_ms", "anchor_round_ms"), short=True)


if __name__ == "__main__":
    main()
