"""The results page's figures (matplotlib, Agg): fidelity, microbatch sweep, planner scaling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.common import Result  # noqa: E402


def fidelity_plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Measured vs predicted step time per schedule, with the Lightning step beside them."""
    names = [r["schedule"] for r in rows]
    xs = range(len(rows))
    width = 0.27
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar([x - width for x in xs], [r["predicted_s"] * 1e3 for r in rows], width,
           label="predicted (planner, profiled stage costs)", color="#8fb3d9")
    ax.bar(list(xs), [r["measured_s"] * 1e3 for r in rows], width,
           label="measured: executor.step (the programs)", color="#1f5f99")
    ax.bar([x + width for x in xs], [r["lightning_step_s"] * 1e3 for r in rows], width,
           label="measured: whole Lightning step", color="#bbbbbb")
    for x, r in enumerate(rows):
        error = r["measured_s"] / r["predicted_s"] - 1
        ax.annotate(f"{error:+.0%}", (x, r["measured_s"] * 1e3), ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("step time (ms)")
    W = rows[0]["W"] if rows else "?"
    ax.set_title(f"Planner fidelity: {W} ranks, global batch of the benchmark GPT")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Step time as microbatches grow (fixed global batch): measured lines, predicted dashed."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for schedule in sorted({r["schedule"] for r in rows}):
        mine = sorted((r for r in rows if r["schedule"] == schedule), key=lambda r: r["B"])
        bs = [r["B"] for r in mine]
        line, = ax.plot(bs, [r["measured_s"] * 1e3 for r in mine], marker="o",
                        label=f"{schedule} measured")
        ax.plot(bs, [r["predicted_s"] * 1e3 for r in mine], linestyle="--", marker="x",
                color=line.get_color(), label=f"{schedule} predicted")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("microbatches B (global batch fixed)")
    ax.set_ylabel("step time (ms)")
    ax.set_title("Step time as microbatches grow")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_all(results: list[Result], extras: dict[str, Any], folder: Path) -> list[tuple[str, Path]]:
    """Every figure the available results allow; (title, file) pairs."""
    figures = []
    fidelity = [r.extra for r in results if r.name.startswith("fidelity[") and r.extra]
    if fidelity:
        path = folder / "bench_fidelity.png"
        fidelity_plot(fidelity, path)
        figures.append(("measured vs predicted step time per schedule", path))
    if extras.get("sweep"):
        path = folder / "bench_microbatches.png"
        sweep_plot(extras["sweep"], path)
        figures.append(("step time as microbatches grow", path))
    if extras.get("scaling"):
        from benchmarks.bench_planner import plot_scaling

        path = folder / "bench_planner_scaling.png"
        plot_scaling(extras["scaling"], path)
        figures.append(("planner time as the problem grows", path))
    return figures
