"""Pipeline diagrams, rows = workers, columns = time: ``ascii_timeline`` for a terminal (the
microbatch as a digit or letter under each job, so the cell "colour" survives plain text) and
``save_png``, with matplotlib imported lazily so that the planner stays dependency-free.
"""

from __future__ import annotations

import math
from functools import reduce

from lightning_gsched.schedule.simulate import Timeline

_MICRO_CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


MAX_WORKERS = 64  # workers drawn at most (the first ones); the legend counts the rest
MAX_COLUMNS = 1000  # a diagram wider than this many characters is not drawn
CELL, MAX_WIDTH = 3, 240  # characters per time unit, fewer where the diagram would be wider


def ascii_timeline(timeline: Timeline) -> str:
    """Two rows per worker, phase+stage labels and microbatch ids, for the first
    :data:`MAX_WORKERS` workers; nothing over :data:`MAX_COLUMNS` units wide."""
    if not timeline.order or not any(timeline.order):
        return "(empty timeline)"
    # the largest unit dividing every duration (so cells align), at least 1/8 of the shortest; a
    # duration depends on the stage and phase only: the microbatch-0 jobs have every one
    P, B = len(timeline.phases), timeline.micro
    durations = {round(timeline.end[i] - timeline.start[i], 6)
                 for i in (s * B * P + k for s in range(timeline.stages) for k in range(P))}
    unit = max(reduce(math.gcd, [round(d * 1000) for d in durations]) / 1000, min(durations) / 8)
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
            top[a:z] = "." * (z - a)
            bottom[a:z] = _MICRO_CHARS[job.micro % len(_MICRO_CHARS)] * (z - a)
            label = f"{job.phase.value}{job.stage}"[: max(1, z - a - 1)]
            top[a:a + len(label)] = label
            top[z - 1] = "|" if z - a > 1 else top[z - 1]
        lines.append(f"{'w' + str(worker):<{label_width}}{''.join(top)}")
        lines.append(f"{'':<{label_width}}{''.join(bottom)}")
    if shown < timeline.workers:
        lines.append(f"(workers {shown}-{timeline.workers - 1} not drawn: the first {shown} of "
                     f"{timeline.workers} only; --png PATH draws them all)")
    lines.append(f"time unit = {unit:g} per {cell} char(s); top row: F/B + stage, bottom row: "
                 f"microbatch (0-9, a-z, ...); latency {timeline.latency:g}")
    return "\n".join(lines)


def save_png(timeline: Timeline, path: str, title: str = "") -> str:
    """Draw the timeline with matplotlib (Agg backend) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = timeline.workers
    cmap = plt.get_cmap("tab20" if timeline.micro > 10 else "tab10")
    fig, ax = plt.subplots(figsize=(min(24.0, max(6.0, timeline.latency * 0.35)),
                                    max(1.6, 0.45 * workers + 1.0)))
    show_text = len(timeline.slots) <= 600
    for slot in timeline.slots:
        ax.broken_barh([(slot.start, slot.end - slot.start)], (slot.worker - 0.4, 0.8),
                       facecolors=cmap(slot.job.micro % cmap.N), edgecolors="black",
                       linewidth=0.4, hatch={"B": "//", "W": ".."}.get(slot.job.phase.value))
        if show_text:
            ax.text((slot.start + slot.end) / 2, slot.worker,
                    f"{slot.job.phase.value}{slot.job.stage}", ha="center", va="center", fontsize=7)
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
