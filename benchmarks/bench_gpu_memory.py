"""``gpu_memory[<schedule>]``: the planner's predicted peak against the CUDA allocator's.

Why: on a GPU the allocator itself says how many bytes of tensors a process held at its peak
(``torch.cuda.max_memory_allocated``), a measurement that shares nothing with the planner's
bytes model (``schedule/memory.py``) or the runtime's own accounting. This is the check the
CPU rows (``memory[...]`` by the torch profiler, ``memory_process[...]`` by the OS) cannot
make exactly: no freed-heap pages, no allocator of our choosing.

One GPU means one rank (W=1, every stage on the same device), so the rows check what a rank
holds under each schedule's programs at W=1 (all stages owned; fetches and hand-offs are
local). Each schedule fits the benchmark GPT (:mod:`benchmarks.model`, a larger shape) for
three steps; the engine predicts the rank's peak at the first batch and reads the allocator's
peak over the second step (``engine/memory_report.py``: reset at the step's start). A second
figure is the allocator's peak over the whole fit (set-up, first step, optimizer state).
A deferred row builds the model under ``trainer.init_module()`` (parameters on meta, each
materialised on the GPU at the build) and shows that the whole-fit peak stays the same.

Run on a machine with one CUDA device:

    python -m benchmarks.bench_gpu_memory [--schedules 1f1b gpipe] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

SCHEDULES = ("ddp", "fsdp", "gpipe", "1f1b", "lpp", "interleaved", "fslpp", "fslpp-seed",
             "zb-h1", "zb-h2", "zbv")
SHAPE = {"vocab": 4096, "seq": 256, "layers": 8, "dim": 1024, "heads": 16}
ROWS_PER_STEP = 16
STEPS = 3


def stages_of(schedule: str) -> int:
    """S at W=1: 4 stages where the placement accepts them (zbv's V needs exactly 2)."""
    return 2 if schedule == "zbv" else (1 if schedule == "ddp" else 4)


def fit_one(schedule: str, deferred: bool, accelerator: str = "cuda",
            shape_fields: dict[str, int] | None = None) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch

    from benchmarks.model import BenchLit, GPTShape, rank_loader
    from lightning_gsched import GeneralParallel

    cuda = accelerator == "cuda"
    fields = shape_fields or SHAPE
    base = torch.cuda.memory_allocated() if cuda else 0  # 0 in the fresh process of a row
    strategy = GeneralParallel(schedule, stages=stages_of(schedule), microbatches=4)
    trainer = pl.Trainer(accelerator=accelerator, devices=1, strategy=strategy, max_steps=STEPS,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         use_distributed_sampler=False)
    if deferred:
        with trainer.init_module():
            model = BenchLit(fields)
    else:
        model = BenchLit(fields)
    shape = GPTShape(**fields)
    trainer.fit(model, train_dataloaders=rank_loader(shape, ROWS_PER_STEP, STEPS, 0, 1))
    whole_fit = torch.cuda.max_memory_allocated() - base if cuda else None
    report = strategy.memory_report
    if report is None or report.predicted is None or report.measured is None:
        return {"error": f"no memory report ({getattr(report, 'unavailable', None)})"}
    predicted = report.predicted[0]
    step_peak = report.device_peaks[0] if report.device_peaks else None
    runtime_peak = (report.measured or [{}])[0].get("total")
    out = {"schedule": schedule, "deferred": deferred, "predicted": predicted.peak,
           "allocator_step": step_peak, "allocator_fit": whole_fit,
           "runtime_accounting": runtime_peak,
           "ratio_step": None if step_peak is None else step_peak / predicted.peak,
           "ratio_fit": None if whole_fit is None else whole_fit / predicted.peak,
           "predicted_categories": predicted.category_peaks.as_dict()}
    return out


def fit_in_fresh_process(schedule: str, deferred: bool, cpu_smoke: bool) -> dict[str, Any]:
    """One fit in its own interpreter: the allocator's peak is the process's, so nothing of an
    earlier fit (tensors still referenced, the caching allocator's state) can count."""
    command = [sys.executable, "-m", "benchmarks.bench_gpu_memory", "--one", schedule,
               "1" if deferred else "0", *(["--cpu-smoke"] if cpu_smoke else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if not rows:
        return {"schedule": schedule, "deferred": deferred,
                "error": f"exit {done.returncode}: {done.stderr.strip()[-300:]}"}
    row: dict[str, Any] = json.loads(rows[-1])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="*", default=list(SCHEDULES))
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", nargs=2, metavar=("SCHEDULE", "DEFERRED"),
                        help="(internal) one fit in this process, its row as JSON on the last line")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="a tiny model on the CPU: checks the script, measures nothing")
    args = parser.parse_args()
    import torch

    accelerator = "cpu" if args.cpu_smoke else "cuda"
    small = {"vocab": 64, "seq": 16, "layers": 4, "dim": 32, "heads": 2}
    if args.one:
        schedule, deferred = args.one[0], args.one[1] == "1"
        try:
            row = fit_one(schedule, deferred, accelerator, small if args.cpu_smoke else None)
        except Exception as exc:  # noqa: BLE001 - report every schedule
            row = {"schedule": schedule, "deferred": deferred,
                   "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print("ROW " + json.dumps(row), flush=True)
        return
    name = "cpu" if args.cpu_smoke else torch.cuda.get_device_name()
    print(f"device {name}, torch {torch.__version__}", flush=True)
    rows = []
    for schedule in args.schedules:
        for deferred in ((False, True) if schedule in ("fsdp", "1f1b") else (False,)):
            row = fit_in_fresh_process(schedule, deferred, args.cpu_smoke)
            rows.append(row)
            mib = 2**20
            if "error" in row:
                print(f"{schedule:12s} deferred={deferred!s:5s} ERROR {row['error']}", flush=True)
            elif row["allocator_step"] is None:  # --cpu-smoke: no allocator to read
                print(f"{schedule:12s} deferred={deferred!s:5s} predicted "
                      f"{row['predicted'] / mib:8.3f} MiB (no CUDA allocator)", flush=True)
            else:
                print(f"{schedule:12s} deferred={deferred!s:5s} predicted "
                      f"{row['predicted'] / mib:8.1f} MiB  allocator step "
                      f"{row['allocator_step'] / mib:8.1f} ({row['ratio_step']:.3f})  whole fit "
                      f"{row['allocator_fit'] / mib:8.1f} ({row['ratio_fit']:.3f})  runtime "
                      f"accounting {row['runtime_accounting'] / mib:8.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
