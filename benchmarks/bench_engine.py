"""``pipeline_engine_vs_torch``: our pipeline engine in a plain loop against torch's, same split.

Why beside ``pipeline_vs_torch``: that row runs ours through Lightning's Trainer (hooks,
logging, the loss exchange) against torch's bare loop, so its gap mixes the engine with the
Trainer around it. Here ours is the same engine in a plain loop: Lightning Fabric with
``GeneralParallelFabric(<schedule>, microbatches=8)`` (:func:`engine_timed`), a step being
``strategy.step(model, batch, loss_fn)`` (the pipelined forward and backward, gradients handed
to the parameters) + ``optimizer.step`` + ``zero_grad``, exactly what the anchor's step is
around ``schedule.step``. The anchor, the rows (gpipe, 1f1b, zb-h1, zbv), the split, the data
and the rounds are those of :mod:`benchmarks.bench_pipeline`. Goal: engine <= 1.00.

    python -m benchmarks.bench_engine [--quick] [--rows gpipe 1f1b ...] [--profile-costs]
                                      [--torch-peak] [--per-rank]

Who loads which rows: torch's loop hands rank 0 every input row and the last stage's rank
every target row of the global batch; ours runs with ``data_loading="per_replica"``, every
rank loading the global batch (the one replica's), so neither side moves rows or asks for
batch sizes before a step. ``--per-rank``: ours with DDP's loading too (each rank its share,
the rows a rank reads moved at the step's start), a third side in the same alternated rounds,
as ``pipeline_engine_vs_torch[<schedule>, per-rank loading]`` against the same anchor, with
``extra["per_replica_over_per_rank"]``: the two loadings' ratio round by round (what that
semantics costs, measured side by side rather than in runs an hour apart).

Torch's order as a third side: where our default plan orders a rank's computations otherwise
than torch's schedule (read from its ``pipeline_order``; none at W=2 since interleaved's default
cap became S + 1, 2026-11-29: before it, our cap 4 on each rank against torch's peaks 5 and 3),
ours also runs with each rank's cap at the most microbatch-stages torch holds there
(:func:`torch_peaks`), in the same alternated rounds, as
``pipeline_engine_vs_torch[<schedule>, torch's peak]`` with ``extra["default_over_torch_peak"]``
(our default caps against torch's, round by round). Why: the caps change the order and so the
time; at torch's peaks our planner gives its order action for action
(``tests/test_benchmarks_pipeline_split.py``), so that row measures the engine alone on the same
program, and the plain row what a user of the schedule's default gets. ``--torch-peak``: only
that variant, for every row whose torch schedule keeps an order.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Sequence

from benchmarks.bench_pipeline import (
    FULL,
    MICROBATCHES,
    PER_RANK,
    QUICK,
    ROWS,
    WARMUP,
    WORLD,
    _anchor_side,
    _chosen,
    _fmt,
    _placement_text,
    process_counts,
)
from benchmarks.common import Result
from benchmarks.pipeline_split import local_stages
from benchmarks.rounds import Side, measure, ratio_result

MODULE = "benchmarks.bench_engine"
GOAL = "<= 1.00"


def engine_timed(rank: int, world: int, schedule: str, steps: int, per_rank: int,
                 microbatches: int = MICROBATCHES, profile_costs: bool = False,
                 cap: list[int] | None = None,
                 data_loading: str = "per_replica") -> dict[str, Any]:
    """One rank of ours in a plain Fabric loop; rank 0's wall and CPU seconds per step.
    ``profile_costs``: planned with the stages' seconds timed at the build (the option);
    ``cap``: per rank (None: the schedule's default); ``data_loading``: the option, and what
    the loop hands each rank (the global batch, or its ``per_rank`` rows of it)."""
    import torch
    from lightning.fabric import Fabric

    from benchmarks.model import GPTShape, build_core, lm_loss, token_data
    from lightning_gsched.fabric import GeneralParallelFabric

    shape = GPTShape()
    fabric = Fabric(accelerator="cpu", devices=world,
                    strategy=GeneralParallelFabric(schedule, microbatches=microbatches,
                                                   profile_costs=profile_costs,
                                                   data_loading=data_loading,
                                                   **({} if cap is None else {"cap": cap})))
    fabric.launch()
    core = build_core(shape, seed=0)
    opt = torch.optim.SGD(core.parameters(), lr=0.05, momentum=0.9)
    model, opt = fabric.setup(core, opt)
    rows = per_rank * world
    xs, ys = token_data(shape, rows * steps).tensors  # the anchor's global batches

    def loss_fn(module: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return lm_loss(module(x), y)

    times: list[float] = []
    cpu_times: list[float] = []
    losses: list[float] = []
    counts: list[list[int]] = []
    for i in range(steps):
        if data_loading == "per_replica":  # every rank: global batch i (the one replica's)
            lo, size = i * rows, rows
        else:  # this rank's rows of global batch i
            lo, size = i * rows + rank * per_rank, per_rank
        batch = (xs[lo:lo + size], ys[lo:lo + size])
        before = process_counts()
        cpu = time.process_time()
        start = time.perf_counter()
        loss = fabric.strategy.step(model, batch, loss_fn)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
        counts.append([b - a for a, b in zip(before, process_counts(), strict=True)])
        losses.append(float(loss))
    # our process groups (each a gloo thread that wakes every 10 ms) must not outlive the fit:
    # in reused processes (benchmarks/rounds.py) they would run beside the next fits, the
    # anchor's included
    fabric.strategy.teardown()
    return {"times": times, "cpu_times": cpu_times, "loss": losses[-1], "losses": losses,
            "threads": torch.get_num_threads(), "counts": counts}


def step_counts(runs: Any) -> list[list[float]]:
    """Per rank, the median over every round's steady steps of (minor page faults, voluntary,
    involuntary context switches) per step (:func:`process_counts`)."""
    from benchmarks.common import median

    per_rank: list[list[float]] = []
    for rank in range(len(runs.outputs[0])):
        steps = [c for out in runs.outputs for c in out[rank]["counts"][runs.warmup:]]
        per_rank.append([median([float(c[i]) for c in steps]) for i in range(3)])
    return per_rank


def torch_orders(schedule: str, world: int = WORLD, microbatches: int = MICROBATCHES
                 ) -> list[list[tuple[str, int, int]]]:
    """Per rank, torch's schedule of the row as ``(kind, stage, microbatch)`` computations in
    its ``pipeline_order`` (kind ``F``, ``B`` a full backward, ``I`` / ``W`` its halves). The
    schedule is built on stand-in stages (its constructor reads only their indices and counts;
    no process group), so this follows the installed torch. ``ValueError`` for schedules that
    keep no order (GPipe, 1F1B: one stage per rank)."""
    import torch
    from torch.distributed.pipelining import schedules

    row = ROWS[schedule]
    cls = getattr(schedules, row.torch_schedule)
    if not issubclass(cls, schedules.PipelineScheduleMulti):
        raise ValueError(f"{row.torch_schedule} keeps no pipeline_order to read")

    class StandIn:  # what the schedules' constructors read of a PipelineStage
        def __init__(self, index: int, rank: int) -> None:
            self.stage_index, self.num_stages = index, row.stages
            self.group_rank, self.group_size = rank, world
            self.is_first, self.is_last = index == 0, index == row.stages - 1
            self.submod, self.has_backward = torch.nn.Identity(), True

    orders = []
    for rank in range(world):
        stand_ins = [StandIn(s, rank)
                     for s in local_stages(row.placement, rank, world, row.stages)]
        made = cls(stand_ins, n_microbatches=microbatches, loss_fn=lambda out, target: out)
        orders.append([(a.computation_type.value, a.stage_index, a.microbatch_index)
                       for a in made.pipeline_order[rank]
                       if a is not None and a.computation_type.value in ("F", "B", "I", "W")])
    return orders


def torch_peaks(schedule: str, world: int = WORLD, microbatches: int = MICROBATCHES
                ) -> list[int]:
    """Per rank, the most microbatch-stages torch's schedule of the row holds at once: forwards
    run minus the last backward phase run (``W`` where split), along :func:`torch_orders`."""
    peaks = []
    for order in torch_orders(schedule, world, microbatches):
        ends = "W" if any(kind == "W" for kind, _, _ in order) else "B"
        held = peak = 0
        for kind, _, _ in order:
            held += (kind == "F") - (kind == ends)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def _engine_side(schedule: str, steps: int, profile_costs: bool = False,
                 cap: list[int] | None = None, data_loading: str = "per_replica") -> Side:
    return Side(f"{MODULE}:engine_timed",
                {"schedule": schedule, "steps": steps, "per_rank": PER_RANK,
                 "profile_costs": profile_costs, "cap": cap, "data_loading": data_loading})


def default_caps(schedule: str, world: int = WORLD, microbatches: int = MICROBATCHES
                 ) -> list[int | None]:
    """Per rank, the cap our planner gives the row's schedule by default (what ours runs)."""
    from lightning_gsched.schedule import plan

    return list(plan(schedule, workers=world, microbatches=microbatches).caps)


def our_orders(schedule: str, cap: list[int] | None = None, world: int = WORLD,
               microbatches: int = MICROBATCHES) -> list[list[tuple[str, int, int]]]:
    """Per rank, our plan's computations as :func:`torch_orders` lists torch's (default caps
    unless ``cap``)."""
    from lightning_gsched.schedule import plan

    kwargs = {} if cap is None else {"cap": cap}
    made = plan(schedule, workers=world, stages=ROWS[schedule].stages,
                microbatches=microbatches, **kwargs)
    return [[(a.op.name, a.stage, a.micro) for a in made.programs.ranks[rank]
             if a.op.name in ("F", "B", "W")] for rank in range(world)]


def torch_order_caps(schedule: str) -> list[int] | None:
    """torch's per-rank peaks where our default plan orders the row's computations otherwise
    than torch's schedule and those caps give torch's order (a third side then runs torch's
    program on our engine), else None (the same order already, torch's schedule keeps no
    order, or its order is not ours at any caps: zb-h1's and zbv's hand-written ones)."""
    try:
        peaks, theirs = torch_peaks(schedule), torch_orders(schedule)
    except ValueError:
        return None
    if our_orders(schedule) == theirs or our_orders(schedule, cap=peaks) != theirs:
        return None
    return peaks


def run(quick: bool, rows: Sequence[str] | None = None,
        profile_costs: bool = False, torch_peak: bool = False,
        per_rank: bool = False) -> list[Result]:
    """``pipeline_engine_vs_torch[<schedule>]`` for the chosen rows of bench_pipeline's table,
    and ``[<schedule>, torch's peak]`` where torch's order holds other peaks than our default
    caps (a third side of the same rounds; module docstring). With ``profile_costs``, ours
    planned with its stages' measured seconds, as ``[<schedule>, profiled costs]``; with
    ``torch_peak``, only ours at torch's per-rank peaks (rows whose torch schedule keeps no
    order are skipped); with ``per_rank``, ours with DDP's loading as another side of the same
    rounds."""
    cfg = QUICK if quick else FULL
    results = []
    for row in _chosen(rows):
        cap, torch_cap = None, None
        if torch_peak:
            try:
                cap = torch_peaks(row.schedule)
            except ValueError as exc:
                print(f"skipped {row.schedule} with --torch-peak: {exc}")
                continue
        elif not profile_costs:  # profiled costs plan other orders: compared at default caps
            torch_cap = torch_order_caps(row.schedule)
        sides = {"ours": _engine_side(row.schedule, cfg["steps"], profile_costs, cap),
                 "anchor": _anchor_side(row.schedule, cfg["steps"])}
        if torch_cap is not None:
            sides["torch_order"] = _engine_side(row.schedule, cfg["steps"], False, torch_cap)
        if per_rank:
            sides["per_rank"] = _engine_side(row.schedule, cfg["steps"], profile_costs, cap,
                                             "per_rank")
        wall = time.perf_counter()
        runs = measure(sides, WORLD, cfg["rounds"], WARMUP)
        wall = time.perf_counter() - wall
        label = ", ".join([row.schedule] + ["profiled costs"] * profile_costs
                          + ["torch's peak"] * (cap is not None))
        results.append(_row(label, row, runs["ours"], runs["anchor"], cfg["steps"], wall,
                             profile_costs, cap, "per_replica"))
        if torch_cap is not None:
            caps = ratio_result("caps", runs["ours"], runs["torch_order"], "", "")
            results.append(_row(f"{row.schedule}, torch's peak", row, runs["torch_order"],
                                runs["anchor"], cfg["steps"], wall, False, torch_cap,
                                "per_replica", {"default_caps": default_caps(row.schedule),
                                                "default_over_torch_peak": caps.ratio,
                                                "default_over_torch_peak_rounds":
                                                    caps.round_ratios}))
        if per_rank:
            loadings = ratio_result("loadings", runs["ours"], runs["per_rank"], "", "")
            results.append(_row(f"{label}, per-rank loading", row, runs["per_rank"],
                                runs["anchor"], cfg["steps"], wall, profile_costs, cap,
                                "per_rank", {"per_replica_over_per_rank": loadings.ratio,
                                             "per_replica_over_per_rank_rounds":
                                                 loadings.round_ratios}))
    return results


def _row(label: str, row: Any, ours: Any, anchor: Any, steps: int, wall: float,
         profile_costs: bool, cap: list[int] | None, loading: str,
         extra: dict[str, Any] | None = None) -> Result:
    """``pipeline_engine_vs_torch[<label>]``: ``ours`` (with ``loading``) against ``anchor``."""
    loss_ours, loss_anchor = ours.last()["loss"], anchor.last()["loss"]
    notes = (f"W={WORLD}, {_placement_text(row)}, {MICROBATCHES} microbatches, global "
             f"batch {PER_RANK * WORLD} rows; ours = GeneralParallelFabric"
             f"{'(profile_costs=True)' if profile_costs else ''}"
             f"{'' if cap is None else f'(cap={cap}, torch peaks)'}"
             f"(data_loading={loading!r}) in a plain "
             f"Fabric loop (no Trainer); anchor = torch.distributed.pipelining "
             f"{row.torch_schedule} in a plain loop, same split; loss at step "
             f"{steps}: ours {_fmt(loss_ours)}, torch {_fmt(loss_anchor)}")
    return ratio_result(
        f"pipeline_engine_vs_torch[{label}]", ours, anchor, GOAL, notes,
        extra={"loss_ours": loss_ours, "loss_anchor": loss_anchor, "steps_per_run": steps,
               "wall_s": round(wall, 1),
               "faults_switches_per_step": {"ours": step_counts(ours),
                                            "anchor": step_counts(anchor)},
               **(extra or {})})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=None)
    parser.add_argument("--profile-costs", action="store_true",
                        help="ours planned with the stages' measured seconds (profile_costs=True)")
    parser.add_argument("--torch-peak", action="store_true",
                        help="only ours with each rank's cap at torch's peak, for every row whose "
                             "torch schedule keeps an order")
    parser.add_argument("--per-rank", action="store_true",
                        help="also ours with data_loading='per_rank' (each rank its share, rows "
                             "moved), in the same rounds")
    args = parser.parse_args()
    for r in run(args.quick, args.rows, args.profile_costs, args.torch_peak, args.per_rank):
        print(f"{r.name:34s} ours {r.ours_s * 1e3:7.1f} ms  torch {r.anchor_s * 1e3:7.1f} ms  "
              f"ratio {r.ratio:.3f}  cpu ratio {r.cpu_ratio}  {r.notes}")
        print(f"  per rank (minor faults, voluntary, involuntary switches) per step: "
              f"{r.extra['faults_switches_per_step']}")
        if "per_replica_over_per_rank" in r.extra:
            print(f"  per_replica / per_rank, same rounds: {r.extra['per_replica_over_per_rank']:.3f}"
                  f" (rounds {[round(x, 3) for x in r.extra['per_replica_over_per_rank_rounds']]})")


if __name__ == "__main__":
    main()
