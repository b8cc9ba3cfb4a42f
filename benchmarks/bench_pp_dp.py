"""``pp_dp_vs_torch[...]`` and ``pp_dp_shard_vs_fsdp2_pp``: a pipeline x data parallel on W=4.

Ours: ``GeneralParallel(schedule, microbatches=8, data_parallel_size=2, data_parallel=mode)``
at W=4, that is G=2 replicas of a P=2 pipeline (rank ``p*2 + g`` is position p of replica g).
The anchor: torch.distributed.pipelining on a 2 x 2 ``DeviceMesh`` (``("pp", "dp")``, the same
ranks), one ``PipelineStage`` per rank over the ``pp`` sub-group, the stage's module wrapped for
data parallelism over the ``dp`` sub-mesh, in a plain loop.

| row | ours | torch | S | data parallel (torch) |
|---|---|---|---|---|
| ``pp_dp_vs_torch[1f1b]`` | ``1f1b``, replicate | ``Schedule1F1B`` | 2 | ``DistributedDataParallel`` |
| ``pp_dp_vs_torch[zb-h1]`` | ``zb-h1``, replicate | ``ScheduleInterleavedZeroBubble`` | 2 | ``replicate`` (FSDP2's) |
| ``pp_dp_shard_vs_fsdp2_pp`` | ``1f1b``, shard | ``Schedule1F1B`` | 4 | ``fully_shard`` per stage |

* **Replicate, DDP.** torch's stage runs every microbatch but the last under DDP's ``no_sync``
  and calls the reducer's ``prepare_for_backward`` before the last backward, so DDP's bucketed
  all-reduce runs once per step, during that backward (ours: one all-reduce per stage after
  its last backward, started in buckets during it).
* **Why not DDP for zb-h1.** In torch 2.13 the split backward's weight pass
  (``stage_backward_weight``) computes weight gradients with ``torch.autograd.grad`` and adds
  them to ``.grad`` by hand, so DDP's autograd hooks never fire on a stage that is not the
  first: the last stage's gradients are never all-reduced (measured here: the replicas' weights
  differ by 8.7e-4 after 3 steps, where the 1F1B anchor matches one process to 4e-9). The
  anchor is therefore torch's own FSDP2-based ``replicate``
  (``torch.distributed._composable.replicate_with_fsdp``, what the pipelining runtime reduces
  in its ``REDUCE_GRAD`` step, ``PipelineStage.perform_reduce_grad``): whole weights on every
  rank, gradients all-reduced once after the last backward.
* **Shard.** Ours shards each stage over its column (S=4: each rank owns one stage, fetches the
  other stage of its position once per step and holds it to the step's end, reduces its
  gradient to the owner once). torch: position p's module is our stages 2p and 2p+1 in an
  ``nn.Sequential``, each under ``fully_shard(mesh=dp, reshard_after_forward=False)`` (then the
  root): all-gathered at the first forward, kept for the step (torchtitan's rule under a
  pipeline), gradients accumulated unsharded and reduce-scattered once in ``REDUCE_GRAD``.
  Peak bytes per rank are measured on both sides the same way, from outside both runtimes:
  one extra, untimed step under :class:`benchmarks.allocator_peak.StepPeak` (a census of the
  tensor storages alive at its start plus the peak of the profiler's allocation events during
  it; an upper bound; ours in a Trainer batch, torch's around ``schedule.step`` +
  ``optimizer.step`` + ``zero_grad``), less a census taken before the fit built anything
  (:func:`benchmarks.allocator_peak.fit_peak`: earlier fits of the same processes leave
  storages behind, torch's FSDP2-based ones the whole model).

Same split (:func:`benchmarks.pipeline_split.stage_split`: our partitioner's cut, rebuilt as
plain modules): S=2 cuts after ``blocks.1``; S=4 between every two blocks, so each position
holds the same blocks in all three rows. Same data: 16 rows per rank, a global batch of 64 rows
cut into 16 microbatches of 4 rows, microbatch b on replica b mod 2
(:mod:`benchmarks.pp_dp_layout`): each replica runs 8 microbatches of 4 rows, the
``pipeline_vs_torch`` rows' whole pipeline. Losses are compared (``loss_abs_diff``).

The rows alternate in rounds (:mod:`benchmarks.rounds`, all rows' sides in one launch: ours and
its anchor stay adjacent in every round). W=4 on the 2-core machine means two ranks per core,
unpinned (``benchmarks.common.core_plan``): read the CPU ratio beside the wall ratio.

    python -m benchmarks.bench_pp_dp [--quick] [--rows 1f1b zb-h1 shard]

(``--quick`` without ``--rows``: :data:`QUICK_ROWS`, what ``make bench`` runs.)
"""

from __future__ import annotations

import argparse
import functools
import time
from dataclasses import dataclass
from typing import Any, Sequence

from benchmarks.bench_pipeline import schedule_step
from benchmarks.common import Result
from benchmarks.pipeline_split import describe, stage_modules, stage_split
from benchmarks.pp_dp_layout import mesh_coords, position_stages, replica_rows
from benchmarks.rounds import Side, SideRuns, measure, ratio_result

MODULE = "benchmarks.bench_pp_dp"
PP, DP = 2, 2
WORLD = PP * DP
MICROBATCHES = 8  # per replica (GeneralParallel's microbatches=)
PER_RANK = 16
MICRO_ROWS = PER_RANK * WORLD // (MICROBATCHES * DP)  # 4, as in pipeline_vs_torch
WARMUP = 2
QUICK = {"steps": 5, "rounds": 3}
FULL = {"steps": 8, "rounds": 6}
# `make bench` keeps to its length: one replicate row and the shard row; zb-h1 in the full run
QUICK_ROWS = ("1f1b", "shard")


@dataclass(frozen=True)
class PpDpRow:
    """One row: our schedule and mode, torch's schedule and data-parallel wrapper, S."""

    key: str  # --rows name
    name: str
    schedule: str
    data_parallel: str  # ours: "replicate" | "shard"
    torch_schedule: str
    torch_dp: str  # "ddp" | "replicate" | "fsdp2"
    stages: int  # our default S at P=2, G=2 in that mode (tests/test_benchmarks_pp_dp.py)
    goal: str
    peak: bool = False  # also measure peak bytes per rank, both sides


ROWS = {row.key: row for row in (
    PpDpRow("1f1b", "pp_dp_vs_torch[1f1b]", "1f1b", "replicate", "Schedule1F1B", "ddp", 2,
            "<= 1.00"),
    PpDpRow("zb-h1", "pp_dp_vs_torch[zb-h1]", "zb-h1", "replicate",
            "ScheduleInterleavedZeroBubble", "replicate", 2, "<= 1.00"),
    PpDpRow("shard", "pp_dp_shard_vs_fsdp2_pp", "1f1b", "shard", "Schedule1F1B", "fsdp2", 4,
            "<= 1.00, peak <= FSDP2's", peak=True),
)}


@functools.lru_cache(maxsize=None)
def _split(stages: int) -> dict[str, Any]:
    from benchmarks.model import GPTShape

    return stage_split(GPTShape(), stages, MICRO_ROWS)


# --------------------------------------------------------------------------- the anchor


def wrap_position(modules: list[Any], how: str, dp_mesh: Any) -> Any:
    """A position's stage modules as one module, data parallel over ``dp_mesh`` (``how``: see
    :class:`PpDpRow`); the module handed to ``PipelineStage``."""
    import torch.nn as nn

    module = modules[0] if len(modules) == 1 else nn.Sequential(*modules)
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, process_group=dp_mesh.get_group())
    if how == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(module, mesh=dp_mesh)
        return module
    if how == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for part in modules:  # one group per stage of ours: the granularity ours shards at
            fully_shard(part, mesh=dp_mesh, reshard_after_forward=False)
        if len(modules) > 1:
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)
        return module
    raise ValueError(f"unknown data-parallel wrapper {how!r}")


def torch_pp_dp_timed(rank: int, world: int, row: str, steps: int, per_rank: int,
                      cuts: list[int], microbatches: int = MICROBATCHES,
                      peak: bool = False) -> dict[str, Any]:
    """One rank of the anchor (module docstring): rank 0's step times, the loss, peaks."""
    import torch.distributed as dist

    owned = not dist.is_initialized()  # in reused processes (benchmarks.rounds) it exists
    if owned:
        dist.init_process_group("gloo")
    try:
        return _torch_loop(rank, world, ROWS[row], steps, per_rank, cuts, microbatches, peak)
    finally:
        if owned:
            dist.destroy_process_group()


def _torch_loop(rank: int, world: int, row: PpDpRow, steps: int, per_rank: int,
                cuts: list[int], microbatches: int, peak: bool) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage

    from benchmarks.allocator_peak import StepPeak, census_now, fit_peak
    from benchmarks.model import GPTShape, build_core, lm_loss, token_data

    before_fit = census_now() if peak else 0
    shape = GPTShape()
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    p, g = mesh_coords(rank, DP)
    modules = stage_modules(build_core(shape, seed=0), cuts)
    module = wrap_position([modules[s] for s in position_stages(len(modules), PP)[p]],
                           row.torch_dp, mesh["dp"])
    del modules  # the other positions' stages
    stage = PipelineStage(module, p, PP, torch.device("cpu"), group=mesh["pp"].get_group())
    first, last = p == 0, p == PP - 1
    step = schedule_step([stage], row.torch_schedule, microbatches, lm_loss, module.parameters(),
                         first, last)
    rows = per_rank * world
    xs, ys = token_data(shape, rows * (steps + 1)).tensors
    mine = torch.tensor(replica_rows(g, DP, microbatches, rows, PP))
    batches = [(xs[i * rows:(i + 1) * rows][mine], ys[i * rows:(i + 1) * rows][mine])
               for i in range(steps + 1)]

    def one_step(x: Any, y: Any) -> float | None:
        losses = step(x, y)
        return None if losses is None else float(torch.stack(losses).mean())

    times, cpu_times, losses = [], [], []
    for x, y in batches[:steps]:
        cpu, start = time.process_time(), time.perf_counter()
        losses.append(one_step(x, y))
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
    measured = None
    if peak:  # one more step, untimed, measured from outside
        with StepPeak() as probe:
            losses.append(one_step(*batches[steps]))
        measured = None if probe.events is None else fit_peak(probe.events, before_fit)
    return {"times": times, "cpu_times": cpu_times, "threads": torch.get_num_threads(),
            **_gathered(losses, measured)}


def _gathered(losses: list[float | None], peak: dict[str, Any] | None) -> dict[str, Any]:
    """Every rank's peak, and the global batch's loss per step: the mean of the replicas'
    last-stage losses (the replicas' row counts are equal)."""
    import torch.distributed as dist

    box: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(box, (losses, peak))
    per_replica = [ls for ls, _ in box if ls and ls[0] is not None]
    mean = [sum(step) / len(step) for step in zip(*per_replica, strict=True)]
    return {"loss": mean[-1], "losses": mean, "peaks": [pk for _, pk in box]}


# --------------------------------------------------------------------------- ours


def fit_ours(rank: int, world: int, strategy: dict[str, Any], steps: int, per_rank: int,
             peak: bool = False) -> dict[str, Any]:
    """Ours through the Trainer (:func:`benchmarks.lit_runs.run_fit`): step and CPU times; with
    ``peak``, one more batch, untimed, under :class:`~benchmarks.allocator_peak.ProfilerPeak`
    (events and census only, as the anchor's :class:`StepPeak`)."""
    import torch
    import torch.distributed as dist

    from benchmarks.allocator_peak import ProfilerPeak, census_now, fit_peak
    from benchmarks.lit_runs import StepTimer, make_strategy, run_fit
    from benchmarks.model import GPTShape

    before_fit = census_now() if peak else 0
    timer = StepTimer(cpu=True)
    probe = ProfilerPeak(batch=steps, timeline=False)
    trainer = run_fit(make_strategy(strategy, world), rank, world, steps + int(peak), per_rank,
                      GPTShape(), [timer, probe] if peak else [timer])
    peaks: list[Any] = [None] * world
    dist.all_gather_object(peaks, None if probe.events is None
                           else fit_peak(probe.events, before_fit))
    loss = trainer.callback_metrics.get("train_loss")
    return {"times": timer.times[:steps], "cpu_times": (timer.cpu_times or [])[:steps],
            "loss": None if loss is None else float(loss), "threads": torch.get_num_threads(),
            "peaks": peaks}


# --------------------------------------------------------------------------- the rows


def ours_strategy(row: PpDpRow) -> dict[str, Any]:
    """Our GeneralParallel keywords for ``row`` (S given: the split the anchor rebuilds)."""
    return {"kind": "gsched", "schedule": row.schedule, "microbatches": MICROBATCHES,
            "stages": row.stages, "data_parallel_size": DP, "data_parallel": row.data_parallel}


def _sides(row: PpDpRow, steps: int) -> dict[str, Side]:
    return {
        f"ours:{row.key}": Side(f"{MODULE}:fit_ours", {
            "strategy": ours_strategy(row), "steps": steps, "per_rank": PER_RANK,
            "peak": row.peak}),
        f"torch:{row.key}": Side(f"{MODULE}:torch_pp_dp_timed", {
            "row": row.key, "steps": steps, "per_rank": PER_RANK,
            "cuts": _split(row.stages)["cuts"], "peak": row.peak}),
    }


def _loss(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def peak_cells(ours: list[Any], theirs: list[Any]) -> tuple[str, bool, list[list[int]]]:
    """Per rank ``ours/theirs`` MiB as text, whether ours <= theirs on every rank, the bytes."""
    pairs = [[o["total"], t["total"]] for o, t in zip(ours, theirs, strict=True)]
    text = ", ".join(f"r{r} {_mib(o)}/{_mib(t)}" for r, (o, t) in enumerate(pairs))
    return text, all(o <= t for o, t in pairs), pairs


def _row_result(row: PpDpRow, ours: SideRuns, anchor: SideRuns, steps: int) -> Result:
    from benchmarks.model import GPTShape

    last_ours, last_anchor = ours.last(), anchor.last()
    loss_o, loss_a = last_ours["loss"], last_anchor["loss"]
    diff = None if loss_o is None else abs(loss_o - loss_a)
    extra: dict[str, Any] = {
        "world": WORLD, "pipeline": PP, "data_parallel": DP, "mode": row.data_parallel,
        "stages": row.stages, "cuts_before_block": _split(row.stages)["cuts"],
        "microbatches_per_replica": MICROBATCHES, "per_rank": PER_RANK,
        "steps_per_run": steps, "warmup_dropped": WARMUP, "torch_dp": row.torch_dp,
        "loss_ours": loss_o, "loss_anchor": loss_a, "loss_abs_diff": diff}
    peak_note = ""
    if row.peak:
        text, met, pairs = peak_cells(last_ours["peaks"], last_anchor["peaks"])
        extra.update(peak_bytes_ours_anchor=pairs, peak_goal_met=met)
        peak_note = (f"; peak bytes per rank held by the fit, MiB ours/FSDP2 (census + "
                     f"allocation events of one untimed step, less a census before the fit; "
                     f"both sides alike): {text}; peak ours <= FSDP2: {met}")
    notes = (f"W={WORLD} = P={PP} x G={DP} ({row.data_parallel}), S={row.stages}, "
             f"{MICROBATCHES} microbatches of {MICRO_ROWS} rows per replica; split "
             f"{describe(_split(row.stages)['cuts'], GPTShape().layers)}; anchor = "
             f"torch.distributed.pipelining {row.torch_schedule} with each stage under "
             f"{row.torch_dp} over the dp sub-mesh, plain loop; loss at the last step: ours "
             f"{_loss(loss_o)}, torch {_loss(loss_a)}"
             f"{peak_note}")
    return ratio_result(row.name, ours, anchor, row.goal, notes, extra=extra)


def _chosen(keys: Sequence[str] | None) -> list[PpDpRow]:
    unknown = sorted(set(keys or ()) - set(ROWS))
    if unknown:
        raise ValueError(f"unknown pp_dp rows {unknown}; choose from {list(ROWS)}")
    return [row for key, row in ROWS.items() if not keys or key in keys]


def run(quick: bool, rows: Sequence[str] | None = None) -> list[Result]:
    """The chosen rows (default: all, :data:`QUICK_ROWS` when ``quick``), their sides
    alternated in one launch of W=4."""
    cfg = QUICK if quick else FULL
    chosen = _chosen(rows or (QUICK_ROWS if quick else None))
    sides: dict[str, Side] = {}
    for row in chosen:
        sides.update(_sides(row, cfg["steps"]))
    runs = measure(sides, WORLD, cfg["rounds"], WARMUP)
    return [_row_result(row, runs[f"ours:{row.key}"], runs[f"torch:{row.key}"], cfg["steps"])
            for row in chosen]


def _speed_line(r: Result) -> str:
    e = r.extra
    spread = "" if r.spread is None else f" ({r.spread[0]:.3f}-{r.spread[1]:.3f})"
    cpu = "-" if r.cpu_ratio is None else f"{r.cpu_ratio:.3f}"
    loss = f"{_loss(e.get('loss_ours'))} / {_loss(e.get('loss_anchor'))}"
    peaks = ", ".join(f"r{k} {_mib(o)}/{_mib(t)}"
                      for k, (o, t) in enumerate(e.get("peak_bytes_ours_anchor", [])))
    return f"| {r.name} | {r.ratio:.3f}{spread} | {cpu} | {loss} | {peaks or '-'} |"


def _memory_line(r: Result) -> str:
    pairs = list(zip(r.extra["predicted"], r.extra["measured_events"], strict=True))
    ratios = ", ".join(f"r{k} {m['total'] / p['total']:.3f}" for k, (p, m) in enumerate(pairs))
    sizes = ", ".join(f"r{k} {_mib(m['total'])}/{_mib(p['total'])}"
                      for k, (p, m) in enumerate(pairs))
    return f"| {r.name} | {ratios} | {sizes} |"


def markdown(results: Sequence[Result]) -> str | None:
    """The results page's tables of these rows and of the 2x2 ``memory[...]`` rows, every rank
    (the main table shows one worst rank); None when neither ran."""
    speed = [_speed_line(r) for r in results
             if r.name.startswith("pp_dp") and r.ratio is not None]
    memory = [_memory_line(r) for r in results
              if r.name.startswith("memory[") and f" {PP}x{DP} " in r.name and r.ours_s]
    out = []
    if speed:
        out += ["| row | ratio ours/torch (spread over rounds) | CPU ratio | loss ours / torch "
                "| peak bytes per rank, MiB ours/torch |", "|---|---|---|---|---|", *speed]
    if memory:
        out += ["", "| row | measured / predicted bytes per rank | MiB measured/predicted |",
                "|---|---|---|", *memory]
    return "\n".join(out).strip() or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=None)
    args = parser.parse_args()
    start = time.perf_counter()
    for r in run(args.quick, args.rows):
        print(f"{r.name:26s} ours {1e3 * (r.ours_s or 0):7.1f} ms  torch "
              f"{1e3 * (r.anchor_s or 0):7.1f} ms  ratio {r.ratio:.3f}  spread {r.spread}  "
              f"cpu ratio {r.cpu_ratio}\n  {r.notes}")
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
