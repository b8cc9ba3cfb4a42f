"""Predicted (and measured) bytes per rank as text: the startup summary's memory lines.

Why a module of its own: describe.py renders counts and times of a plan; bytes need sizes the
plan does not have (measured by the torch layers), and a second form once the first steps have
run (predicted beside measured, per rank), which the Trainer and Fabric front ends print alike.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from lightning_gsched.schedule.describe import byte_text, span
from lightning_gsched.schedule.memory import CATEGORIES, RankMemory


def _span(values: Sequence[float]) -> str:
    return span(values, byte_text)


def predicted_text(memories: Sequence[RankMemory]) -> str:
    """Three lines of at most 100 characters: the predicted peak per rank (range, and the rank
    that peaks), and what that peak is made of (each category's range over the ranks' peaks)."""
    peaks = [m.peak for m in memories]
    top = max(range(len(peaks)), key=peaks.__getitem__)
    parts = [f"{c} {_span([getattr(m.at_peak, c) for m in memories])}" for c in CATEGORIES]
    return (f"    predicted peak bytes per rank {_span(peaks)} (highest: rank {top}), made of\n"
            f"      {', '.join(parts[:3])}\n      {', '.join(parts[3:])}")


def comparison_text(memories: Sequence[RankMemory], measured: Sequence[Mapping[str, int]],
                    step: int, device_peaks: Sequence[int | None] = ()) -> str:
    """Per rank: predicted and measured peak (and the device allocator's peak where known)."""
    lines = [f"GeneralParallel memory per rank, step {step}: predicted / measured peak "
             "(runtime accounting of the tensors it holds)"]
    for rank, (m, got) in enumerate(zip(memories, measured, strict=True)):
        total = got.get("total", 0)
        ratio = f"{total / m.peak:.3f}" if m.peak else "-"
        device = device_peaks[rank] if rank < len(device_peaks) else None
        extra = f", device allocator peak {byte_text(device)}" if device is not None else ""
        lines.append(f"  rank {rank}: {byte_text(m.peak)} / {byte_text(total)} "
                     f"(measured/predicted {ratio}){extra}")
    return "\n".join(lines)
