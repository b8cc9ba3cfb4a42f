"""Pipeline diagrams: rows = workers, columns = time, one cell per job.

``ascii_timeline`` prints in a terminal (``F3`` = phase + stage, the microbatch as a digit or
letter underneath so the cell "colour" survives plain text); ``save_png`` draws it with
matplotlib, imported lazily so that the planner stays dependency-free.
"""

from __future__ import annotations

import math
from functools import reduce

from lightning_gsched.schedule.simulate import Timeline

_MICRO_CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _time_unit(timeline: Timeline) -> float:
    """Largest unit that divides every duration (so cells align), at least 1/8 of the shortest.
    A duration depends on the stage and phase only: the microbatch-0 jobs hold every one."""
    P, B = len(timeline.phases), timeline.micro
    first = [(s * B) * P + k for s in range(timeline.stages) for k in range(P)]
    durations = {round(timeline.end[i] - timeline.start[i], 6) for i in first}
    shortest = min(durations)
    scaled = [round(d * 1000) for d in durations]
    unit = reduce(math.gcd, scaled) / 1000
    return max(unit, shortest / 8)


MAX_WORKERS = 64  # workers drawn at most (the first ones); the legend counts the rest
MAX_COLUMNS = 1000  # a diagram wider than this many characters is not drawn
CELL, MAX_WIDTH = 3, 240  # characters per time unit, fewer where the diagram would be wider


def ascii_timeline(timeline: Timeline) -> str:
    """Two text rows per worker: phase+stage labels and microbatch ids, aligned in time; the
    first :data:`MAX_WORKERS` workers, nothing over :data:`MAX_COLUMNS` units wide."""
    if not timeline.order or not any(timeline.order):
        return "(empty timeline)"
    unit = _time_unit(timeline)
    columns = int(round(timeline.latency / unit))
    if columns > MAX_COLUMNS:
        return (f"(timeline not drawn: {columns} time units of {unit:g} over {timeline.workers} "
                f"workers is wider than {MAX_COLUMNS} characters; --png PATH draws it, --json "
                f"lists every slot; latency {timeline.latency:g})")
    cell = CELL if columns * CELL <= MAX_WIDTH else max(1, MAX_WIDTH // columns)
    shown = min(timeline.workers, MAX_WORKERS)
    label_width = len(f"w{shown - 1}") + 1
    lines = []
    for worker in range(shown):
        top, bottom = [" "] * (columns * cell), [" "] * (columns * cell)
        for index in timeline.order[worker]:  # not by_worker: no Slot for workers not drawn
            job = timeline.job(index)
            a = int(round(timeline.start[index] / unit)) * cell
            z = int(round(timeline.end[index] / unit)) * cell
            text = f"{job.phase.value}{job.stage}"
            micro = _MICRO_CHARS[job.micro % len(_MICRO_CHARS)]
            for i in range(a, z):
                top[i] = "."
                bottom[i] = micro
            for i, ch in enumerate(text[: max(1, z - a - 1)]):
                top[a + i] = ch
            top[a] = text[0]
            top[z - 1] = "|" if z - a > 1 else top[z - 1]
        lines.append(f"{'w' + str(worker):<{label_width}}{''.join(top)}")
        lines.append(f"{'':<{label_width}}{''.join(bottom)}")
    if shown < timeline.workers:
        lines.append(f"(workers {shown}-{timeline.workers - 1} not drawn: the first {shown} of "
                     f"{timeline.workers} only; --png PATH draws them all)")
    legend = (
        f"time unit = {unit:g} per {cell} char(s); top row: F/B + stage, bottom row: microbatch "
        f"(0-9, a-z, ...); latency {timeline.latency:g}")
    return "\n".join(lines + [legend])


def save_png(timeline: Timeline, path: str, title: str = "") -> str:
    """Draw the timeline with matplotlib (Agg backend) and write it to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = timeline.workers
    cmap = plt.get_cmap("tab20" if timeline.micro > 10 else "tab10")
    width = min(24.0, max(6.0, timeline.latency * 0.35))
    height = max(1.6, 0.45 * workers + 1.0)
    fig, ax = plt.subplots(figsize=(width, height))
    show_text = len(timeline.slots) <= 600
    for slot in timeline.slots:
        colour = cmap(slot.job.micro % cmap.N)
        hatch = {"B": "//", "W": ".."}.get(slot.job.phase.value)
        ax.broken_barh(
            [(slot.start, slot.end - slot.start)], (slot.worker - 0.4, 0.8),
            facecolors=colour, edgecolors="black", linewidth=0.4, hatch=hatch)
        if show_text:
            ax.text(
                (slot.start + slot.end) / 2, slot.worker, f"{slot.job.phase.value}{slot.job.stage}",
                ha="center", va="center", fontsize=7)
    ax.set_ylim(workers - 0.5, -0.5)
    ax.set_xlim(0, timeline.latency)
    ax.set_yticks(range(workers))
    ax.set_yticklabels([f"worker {w}" for w in range(workers)])
    ax.set_xlabel("time (cost units); colour = microbatch, hatched = backward, dotted = W")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
