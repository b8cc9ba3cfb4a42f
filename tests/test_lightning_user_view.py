"""What a user sees under GeneralParallel is what they see under DDP (issue 15, part 5).

Lightning's own callbacks read state the strategy has to keep right: the progress bar shows
``trainer.progress_bar_metrics`` (values logged with ``prog_bar=True``), the model summary counts
``pl_module.parameters()`` at ``on_fit_start``, and ``LearningRateMonitor`` reads the optimizers'
param groups each step. Under GeneralParallel a rank holds only its own stages once the pipeline
is built and a step's loss exists on the last-stage rank only, so each of these could show a
stage's share, a stale value or nothing. This module fits 3 steps on W=2 workers with the real
callbacks switched on (TQDM and Rich progress bars, ModelSummary, LearningRateMonitor, a
CSVLogger) and compares what they recorded with a single-device Trainer on the same global
batches. Values are captured from the callbacks' own state or small subclasses that record what
the callback was about to display, not by parsing terminal text.

The startup plan print is checked here too, without processes: for W=8 it must fit on a screen.
"""

from __future__ import annotations

import functools
import tempfile
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import (
    LearningRateMonitor,
    ModelSummary,
    RichProgressBar,
    TQDMProgressBar,
)

from dist_harness import WorkerContext
from lightning_models import as_worker, csv_metric, make_lit_gpt, rank_loader, tokens, trainer

pytestmark = pytest.mark.distributed

STEPS, GLOBAL_BATCH = 3, 8
WORLD_TIMEOUT = 300.0  # seconds per check: whole Trainer fits (conftest.worlds)


class RecordingBar(TQDMProgressBar):
    """The TQDM bar, recording the metrics it puts in its postfix after every training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.shown: list[dict[str, Any]] = []
        self.postfix = ""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        self.shown.append(dict(self.get_metrics(trainer, pl_module)))
        if trainer.is_global_zero:  # the bar is disabled on the other ranks, as under DDP
            self.postfix = str(self.train_progress_bar.postfix)


class RecordingRichBar(RichProgressBar):
    """The Rich bar, recording the metrics its metrics column shows after every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.shown: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        self.shown.append(dict(self.get_metrics(trainer, pl_module)))


class RecordingSummary(ModelSummary):
    """Lightning's ModelSummary (it runs at on_fit_start and prints on rank 0 only), recording
    the totals it prints."""

    def __init__(self) -> None:
        super().__init__(max_depth=1)
        self.printed: list[dict[str, Any]] = []

    def summarize(self, summary_data: Any, total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: Any, total_flops: int = 0,
                  **kwargs: Any) -> None:
        self.printed.append({"total": total_parameters, "trainable": trainable_parameters,
                             "size": model_size, "layers": summary_data})
        super().summarize(summary_data, total_parameters, trainable_parameters, model_size,
                          total_training_modes, total_flops=total_flops, **kwargs)


def _fit_with_callbacks(world: int, rank: int, strategy: Any, tmp: str, rich: bool) -> dict:
    bar: RecordingBar | RecordingRichBar = RecordingRichBar() if rich else RecordingBar()
    lr_monitor = LearningRateMonitor(logging_interval="step", log_momentum=True)
    callbacks: list[pl.Callback] = [bar, lr_monitor]
    summary = None
    if not rich:  # with a Rich bar, enable_model_summary picks RichModelSummary: let it print
        summary = RecordingSummary()
        callbacks.append(summary)
    model = make_lit_gpt()
    data = tokens(GLOBAL_BATCH * STEPS)
    fit = trainer(world, strategy, tmp, max_steps=STEPS, enable_progress_bar=True,
                  enable_model_summary=True, callbacks=callbacks)
    fit.fit(model, rank_loader(data, GLOBAL_BATCH, world, rank))
    return {
        "shown": [{k: v for k, v in m.items() if k != "v_num"} for m in bar.shown],
        "bar_metrics": {k: float(v) for k, v in fit.progress_bar_metrics.items()},
        "postfix": getattr(bar, "postfix", None),
        "summary": summary.printed if summary is not None else None,
        "lrs": {k: list(v) for k, v in lr_monitor.lrs.items()},
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def callbacks_on_worker(ctx: WorkerContext, tmp: str, rich: bool) -> dict:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    return _fit_with_callbacks(ctx.world_size, ctx.rank, GeneralParallel("fslpp"), tmp, rich)


@functools.lru_cache(maxsize=None)
def reference() -> tuple[dict, dict]:
    """Single-device Trainer with the same callbacks: what it showed, and its CSV columns."""
    tmp = tempfile.mkdtemp()
    shown = _fit_with_callbacks(1, 0, "auto", tmp, rich=False)
    columns = ("train_loss", "lr-SGD", "lr-SGD-momentum")
    return shown, {name: csv_metric(tmp, name) for name in columns}


def _assert_same_values(got: list[dict[str, Any]], want: list[dict[str, Any]], what: str) -> None:
    assert [sorted(g) for g in got] == [sorted(w) for w in want], what
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for name in w:
            assert g[name] == pytest.approx(w[name], rel=1e-5), f"{what} step {step} {name}"


@pytest.mark.parametrize("rich", [False, True], ids=["tqdm", "rich"])
def test_progress_bar_summary_and_lr_monitor_match_one_device(worlds, rich: bool,
                                                              tmp_path) -> None:
    want, want_csv = reference()
    results = worlds.get(2).run(callbacks_on_worker, str(tmp_path), rich)
    first = results[0]
    # the progress bar (rank 0 draws it) showed train_loss of the global batch at every step
    assert len(first["shown"]) == STEPS and all("train_loss" in m for m in first["shown"])
    _assert_same_values(first["shown"], want["shown"], "progress bar")
    if not rich:
        assert "train_loss=" in first["postfix"], first["postfix"]  # what tqdm draws
    for rank, result in enumerate(results):  # every rank holds the same values (DDP-like)
        _assert_same_values([result["bar_metrics"]], [want["bar_metrics"]], f"rank {rank}")
        # LearningRateMonitor: one LR per step, the single device's (StepLR, gamma 0.7)
        assert list(result["lrs"]) == ["lr-SGD"], result["lrs"]
        assert result["lrs"]["lr-SGD"] == pytest.approx(want["lrs"]["lr-SGD"], rel=1e-7)
        assert result["parameters"] == want["parameters"]  # full model again after the fit
    assert len(want["lrs"]["lr-SGD"]) == STEPS
    # rank 0's CSV log holds the loss, LR and momentum rows one device writes
    for name, rows in want_csv.items():
        got = csv_metric(str(tmp_path), name)
        assert [s for s, _ in got] == [s for s, _ in rows], name
        assert [v for _, v in got] == pytest.approx([v for _, v in rows], rel=1e-5), name
    if not rich:
        # the model summary, printed on rank 0 only, counted the whole model (not a stage, not 0)
        assert first["summary"] == want["summary"] and len(want["summary"]) == 1
        assert want["summary"][0]["total"] == want["parameters"]
        assert all(r["summary"] == [] for r in results[1:])


# ---------------------------------------------------------------------------- startup print


@functools.lru_cache(maxsize=None)
def _gpt_partition(stages: int) -> Any:
    from lightning_gsched.partition import partition
    from models import gpt_inputs, make_gpt

    return partition(make_gpt(layers=16), stages, gpt_inputs())


def _startup_text(schedule: str, **options: Any) -> str:
    """What rank 0 would print for this plan of a 16-layer GPT on 8 workers (no processes:
    the engine's own formatting function, with the stage sizes the runtime would report)."""
    from lightning_gsched.engine.memory_report import MemoryReport
    from lightning_gsched.engine.startup import startup_text
    from lightning_gsched.runtime import ParameterMemory
    from lightning_gsched.schedule.plan import plan
    from models import gpt_inputs

    part = _gpt_partition(plan(schedule, workers=8, **options).stages)
    result = plan(schedule, workers=8, ties=part.shared_parameters.values(), **options)
    params = dict(part.module.named_parameters())

    def nbytes(name: str) -> int:
        return params[name].numel() * params[name].element_size()

    stage_bytes = [sum(nbytes(n) for n in names if n not in part.shared_parameters)
                   for names in part.stage_parameter_names]
    tied: dict[int, int] = {}  # by home stage (the lowest reader)
    for name, stages in part.shared_parameters.items():
        tied[min(stages)] = tied.get(min(stages), 0) + nbytes(name)
    report = MemoryReport()  # the engine's: stages sized on one microbatch, bytes predicted
    report.predict(part.stages, gpt_inputs(), {}, result, [])
    assert report.predicted is not None, report.unavailable
    return startup_text(result, part, ParameterMemory(stage_bytes, tied, [], 0), custom=False,
                        memory_lines=report.startup_lines())


W8_PLANS = [("fslpp", {"R": 2, "microbatches": 16}), ("ddp", {}), ("fsdp", {}), ("gpipe", {}),
            ("1f1b", {}), ("lpp", {"R": 2}), ("interleaved", {}), ("fslpp-seed", {"R": 2})]


@pytest.mark.parametrize("schedule, options", W8_PLANS, ids=[s for s, _ in W8_PLANS])
def test_startup_print_fits_one_screen_at_w8(schedule: str, options: dict, capsys) -> None:
    from lightning_gsched import cli

    text = _startup_text(schedule, **options)
    lines = text.splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 120, text
    # what a user needs is there: configuration, latency/bubble, per-worker ranges, memory
    assert lines[0].startswith(f"GeneralParallel plan: {schedule} W=8 ")
    for needed in ("latency ", "bubble ", "stage owners: ", "peak stashed activations",
                   "parameters owned ", "peak resident ", "Partition of TinyGPT",
                   "predicted peak bytes per rank", "activations "):
        assert needed in text, (needed, text)
    if " S=1 " not in lines[0]:  # the tied embedding and head: one tie, home stage 0
        assert "; ties 0," in text and "tie fetches " in text, text
    # and the command it names prints the full per-worker table (one row per worker)
    (command,) = [line.split(": ", 1)[1] for line in lines if "per-worker table" in line]
    assert command.startswith("gsched plan ")
    assert cli.main(command.split()[1:]) == 0
    table = capsys.readouterr().out
    configuration = lines[0].removeprefix(f"GeneralParallel plan: {schedule} ")
    assert table.splitlines()[0] == f"schedule {schedule}: {configuration}"  # the same plan
    rows = [line for line in table.splitlines() if line.split(" ", 1)[0] in map(str, range(8))]
    assert len(rows) >= 8, table


def test_startup_print_for_fslpp_w8_r2_b16_reads_well() -> None:
    """The example of issue 15: the per-worker numbers as ranges, in 10 lines, and the stage
    table of the partition without its unit lists."""
    text = _startup_text("fslpp", R=2, microbatches=16)
    assert "W=8 S=8 B=16 R=2" in text
    assert "range over the 8 workers" in text
    assert "gsched plan fslpp -w 8 -s 8 -b 16 --R 2" in text
    assert "Stage 0 units:" not in text  # the unit lists are partition.report()'s
    # the plan's 10 lines, 3 of predicted bytes, the stage table: well inside one screen
    assert len(text.splitlines()) <= 28, text
