"""``memory_process[<schedule>]`` and ``large_model[<schedule>]``: what the OS says a rank holds.

Both rows build a stack of ``Linear(d, d)`` layers (ReLU between) with Adam under
``trainer.init_module()`` (deferred initialisation: parameters on the meta device, each rank
materialises only the stages it keeps, docs/memory.md) and fit a few steps with
``GeneralParallel`` on W=4 CPU processes (gloo), 4 rows per rank, MSE loss.

Measured by the OS, not the runtime (``extra.measured_by = "rss"``): each rank writes ``5`` to
``/proc/self/clear_refs`` once its imports are done and its ``Trainer`` exists, before the model
exists, which resets the kernel's resident-set high-water mark (``VmHWM``) to the current
``VmRSS``; after ``fit`` returns it reads ``VmHWM`` again. The rank's growth is
``VmHWM(end) - VmRSS(start)``: every resident page the fit added at its peak, the allocator's
retained free blocks, gloo's buffers, Lightning's objects and lazily imported modules included.

* ``memory_process[<schedule>]`` (fsdp with S=2W, fslpp, 1f1b; 32 x Linear(2048, 2048), 512 MiB
  of fp32 parameters, 3 steps): the row's ratio is the growth / the strategy's predicted peak
  (``strategy.memory_report.predicted[rank].peak``) of the rank with the largest ratio; goal:
  growth <= 1.25 x predicted + 64 MiB on every rank (``extra.within_goal``).
* ``large_model[<schedule>]`` (W=4, 2 steps; fslpp and fsdp (S=8): 32 x Linear(4096, 4096),
  2 GiB of fp32 parameters): whole replicas plus gradients and Adam's two moments would need
  4 x 8 GiB; the row reports every
  rank's peak RSS (``VmHWM``, absolute) and their sum, and the growth / predicted ratio as
  above. Not the issue's ~3 GiB: on this 24 GiB machine fslpp at 3 GiB would peak at about
  22 GiB summed over the ranks. It runs only when ``/proc/meminfo`` shows at least 18 GiB
  available (otherwise the row says so); ``run.py`` runs it in the full run only.

    python -m benchmarks.bench_process_memory [--large] [--schedules fsdp 1f1b]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from benchmarks.common import Result, launch

WORLD = 4
PER_RANK = 4
MIB = 2**20
GOAL_FACTOR, GOAL_SLACK = 1.25, 64 * MIB
SMALL = {"layers": 32, "width": 2048, "steps": 3}
LARGE = {"fslpp": {"layers": 32, "width": 4096, "steps": 2},
         "fsdp": {"layers": 32, "width": 4096, "steps": 2}}
LARGE_NEEDS_AVAILABLE = 18 * 2**30
SMALL_SCHEDULES = ["fsdp", "fslpp", "1f1b"]
LARGE_SCHEDULES = list(LARGE)


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


class RssTrace(pl.Callback):
    """A diagnostic (``trace=True``): (hook, VmRSS, VmHWM, seconds since the fit started) at
    Lightning's hooks, in ``points``."""

    def __init__(self) -> None:
        self.points: list[tuple[str, int, int, float]] = []
        self.started = time.perf_counter()

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.started = time.perf_counter()

    def _mark(self, name: str) -> None:
        self.points.append((name, _status_bytes("VmRSS"), _status_bytes("VmHWM"),
                            time.perf_counter() - self.started))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        self._mark(f"batch {batch_idx} start")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._mark("before backward (the schedule ran)")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._mark("before optimizer step")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._mark(f"batch {batch_idx} end")


def linear_stack(layers: int, width: int) -> Any:
    """The rows' model: ``layers`` x Linear(width, width), ReLU between (built on whatever
    device the caller's context says, meta included)."""
    from torch import nn

    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def rank_rows(rank: int, rows: int, width: int) -> tuple[Any, Any]:
    """This rank's inputs and targets (seeded by the rank), made before the measurement."""
    import torch

    gen = torch.Generator().manual_seed(rank)
    return (torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen))


def strategy_kwargs(schedule: str, world: int) -> dict[str, Any]:
    """fsdp with two stages per rank (S=2W); the other schedules at their defaults."""
    return {"stages": 2 * world} if schedule == "fsdp" else {}


def rss_run(rank: int, world: int, schedule: str, layers: int, width: int, steps: int,
            per_rank: int = PER_RANK, trace: bool = False) -> dict[str, Any]:
    """One deferred fit in this process; this rank's RSS growth, peak and the prediction."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_gsched import GeneralParallel

    class Stack(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = linear_stack(layers, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    data = TensorDataset(*rank_rows(rank, per_rank * steps, width))
    loader = DataLoader(data, batch_size=per_rank, shuffle=False)
    strategy = GeneralParallel(schedule, **strategy_kwargs(schedule, world))
    tracer = RssTrace() if trace else None
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, num_nodes=1, strategy=strategy, max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, num_sanity_val_steps=0,
        callbacks=[tracer] if tracer is not None else None)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS, before the model exists
    start = _status_bytes("VmRSS")
    with trainer.init_module():
        model = Stack()
    trainer.fit(model, train_dataloaders=loader)
    peak = _status_bytes("VmHWM")
    end = _status_bytes("VmRSS")
    report = strategy.memory_report
    if report is None or report.predicted is None:
        raise RuntimeError(f"no memory prediction for {schedule}: "
                           f"{getattr(report, 'unavailable', None)}")
    predicted = report.predicted[rank]
    mine = {"rank": rank, "rss_start": start, "rss_peak": peak, "rss_end": end,
            "growth": peak - start, "predicted": predicted.peak,
            "predicted_at_peak": dict(predicted.at_peak.as_dict()),
            "params": sum(p.numel() * p.element_size() for p in model.parameters()
                          if not p.is_meta)}
    if tracer is not None:
        mine["trace"] = tracer.points
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone}


def fsdp2_rss_run(rank: int, world: int, layers: int, width: int, steps: int,
                  per_rank: int = PER_RANK) -> dict[str, Any]:
    """FSDP2 at its best on :func:`rss_run`'s model, data and optimizer, in a plain loop; this
    rank's RSS growth measured the same way (``VmHWM`` after the loop - ``VmRSS`` before the
    model exists).

    Like for like with ours: the model is built on the meta device and each rank materialises
    only its shards (``to_empty`` + ``reset_parameters``, torchtitan's deferred init); one
    ``fully_shard`` group per ``Linear`` (the finest grouping, the smallest unsharded working
    set) with ``reshard_after_forward=True`` (a layer is unsharded for its forward and again for
    its backward), Adam over the sharded parameters; and the heap's free pages handed back to
    the OS at every step start, as our runtime does (``runtime/host_heap.py``): without it
    FSDP2's growth on CPU was 2.1-2.9 GiB per rank, mostly freed blocks glibc kept."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    xs, ys = rank_rows(rank, per_rank * steps, width)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS, before the model exists
    start = _status_bytes("VmRSS")
    with torch.device("meta"):
        model = linear_stack(layers, width)
    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module, reshard_after_forward=True)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model:
            if isinstance(module, nn.Linear):
                module.reset_parameters()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    from lightning_gsched.runtime.host_heap import release_free_heap

    for i in range(steps):
        release_free_heap(torch.device("cpu"))
        x, y = xs[i * per_rank:(i + 1) * per_rank], ys[i * per_rank:(i + 1) * per_rank]
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    peak = _status_bytes("VmHWM")
    mine = {"rank": rank, "rss_start": start, "rss_peak": peak, "growth": peak - start}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone}


def run_vs_fsdp2(quick: bool) -> list[Result]:
    """``fsdp_process_vs_fsdp2``: the worst rank's RSS growth, ours (fsdp, S=2W) / FSDP2's, each
    side in fresh processes on the ``memory_process`` model (goal <= 1.00)."""
    ours = launch("benchmarks.bench_process_memory:rss_run", WORLD, schedule="fsdp",
                  **SMALL)["ranks"]
    rival = launch("benchmarks.bench_process_memory:fsdp2_rss_run", WORLD, **SMALL)["ranks"]
    worst_ours = max(r["growth"] for r in ours)
    worst_rival = max(r["growth"] for r in rival)
    per = "; ".join(f"r{a['rank']} {a['growth'] / MIB:.0f}/{b['growth'] / MIB:.0f}"
                    for a, b in zip(ours, rival, strict=True))
    return [Result(
        name="fsdp_process_vs_fsdp2", ours_s=worst_ours, anchor_s=worst_rival, unit="bytes",
        goal="<= 1.00",
        notes=(f"peak RSS growth of the worst rank (VmHWM after training - VmRSS before the "
               f"model), ours fsdp S={2 * WORLD} / FSDP2 one group per Linear, reshard after "
               f"forward, heap trimmed at each step like ours; per rank ours/FSDP2 MiB: {per}; {SMALL['layers']} x "
               f"Linear({SMALL['width']}), Adam, deferred init on both sides, W={WORLD}, "
               f"{SMALL['steps']} steps, fresh processes per side"),
        extra={"measured_by": "rss", "ours": ours, "fsdp2": rival, **SMALL, "world": WORLD})]


def _row(prefix: str, schedule: str, cfg: dict[str, Any], ranks: list[dict[str, Any]],
         quick: bool) -> Result:
    ratios = [r["growth"] / r["predicted"] for r in ranks]
    worst = max(range(len(ratios)), key=ratios.__getitem__)
    ok = all(r["growth"] <= GOAL_FACTOR * r["predicted"] + GOAL_SLACK for r in ranks)
    total_params = cfg["layers"] * (cfg["width"] ** 2 + cfg["width"]) * 4
    per = "; ".join(f"r{r['rank']} {r['growth'] / MIB:.0f}/{r['predicted'] / MIB:.0f}"
                    for r in ranks)
    peaks = ", ".join(f"{r['rss_peak'] / MIB:.0f}" for r in ranks)
    sum_peak = sum(r["rss_peak"] for r in ranks)
    extra = {"measured_by": "rss", "schedule": schedule, **cfg, "world": WORLD,
             "per_rank_rows": PER_RANK, "param_bytes": total_params,
             "strategy_kwargs": strategy_kwargs(schedule, WORLD), "ranks": ranks,
             "ratios": ratios, "within_goal": ok, "sum_rss_peak": sum_peak}
    return Result(
        name=f"{prefix}[{schedule}]", ours_s=ranks[worst]["growth"],
        anchor_s=ranks[worst]["predicted"], unit="bytes",
        goal=f"<= {GOAL_FACTOR} x pred + 64 MiB",
        notes=(f"{'MET' if ok else 'MISSED'}; RSS growth (VmHWM at end - VmRSS before the model) "
               f"/ predicted peak, rank {worst}; per rank growth/predicted MiB: {per}; peak RSS "
               f"per rank MiB: {peaks} (sum {sum_peak / 2**30:.2f} GiB); "
               f"{cfg['layers']} x Linear({cfg['width']}) = {total_params / 2**30:.2f} GiB fp32, "
               f"Adam, deferred, W={WORLD}, {cfg['steps']} steps"),
        extra=extra)


def run_small(quick: bool, schedules: list[str] | None = None) -> list[Result]:
    out = []
    for schedule in schedules or SMALL_SCHEDULES:
        runs = launch("benchmarks.bench_process_memory:rss_run", WORLD, schedule=schedule,
                      **SMALL)
        out.append(_row("memory_process", schedule, SMALL, runs["ranks"], quick))
    return out


def run_large(quick: bool, schedules: list[str] | None = None) -> list[Result]:
    out = []
    for schedule in schedules or LARGE_SCHEDULES:
        if schedule not in LARGE:
            raise SystemExit(f"large_model has a size for {sorted(LARGE)} only, not {schedule!r}")
        avail = available_bytes()
        if avail < LARGE_NEEDS_AVAILABLE:
            out.append(Result(name=f"large_model[{schedule}]", ours_s=None, anchor_s=None,
                              unit="bytes", goal="trains; peak RSS per rank",
                              notes=f"not run: {avail / 2**30:.1f} GiB available < "
                                    f"{LARGE_NEEDS_AVAILABLE / 2**30:.0f} GiB",
                              extra={"measured_by": None}))
            continue
        runs = launch("benchmarks.bench_process_memory:rss_run", WORLD, timeout=1500.0,
                      schedule=schedule, **LARGE[schedule])
        out.append(_row("large_model", schedule, LARGE[schedule], runs["ranks"], quick))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="the large_model rows instead")
    parser.add_argument("--vs-fsdp2", action="store_true",
                        help="the fsdp_process_vs_fsdp2 row instead")
    parser.add_argument("--schedules", nargs="*")
    args = parser.parse_args()
    if args.vs_fsdp2:
        rows = run_vs_fsdp2(True)
    else:
        rows = (run_large if args.large else run_small)(True, args.schedules)
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.3f}"
        print(f"{r.name:26s} ratio {ratio}  {r.notes}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
