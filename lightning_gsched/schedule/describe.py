"""Text summaries of a plan: the configuration line and one row per worker.

Lives in the schedule layer (not in the CLI) because both the ``gsched`` CLI and the Lightning
strategy print it: the strategy logs the plan it is about to run, and it must not depend on the
CLI to do so (``tests/test_layering.py`` checks that nothing imports ``lightning_gsched.cli``).
"""

from __future__ import annotations

from typing import Sequence

from lightning_gsched.schedule.plan import Plan


def text_table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """Columns padded to their widest cell; the first left-aligned, the rest right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    lines += [fmt.format(*[str(c) for c in r]) for r in rows]
    return "\n".join(lines)


def cap_text(caps: Sequence[int | None]) -> str:
    """Per-stage activation caps, folded: ``none``, one shared value, or a comma list."""
    if all(c is None for c in caps):
        return "none"
    if len(set(caps)) == 1:
        return str(caps[0])
    return ",".join(str(c) for c in caps)


def describe(result: Plan) -> str:
    """Text summary of a plan: configuration, latency, bubble, and one row per worker."""
    m = result.metrics
    head = (
        f"schedule {result.schedule}: W={result.workers} S={result.stages} B={result.micro}"
        + (f" R={result.R}" if result.R is not None else "")
        + f" order={result.order} cap={cap_text(result.caps)}"
        + (" forward-only" if result.forward_only else "") + "\n"
        f"latency {m.latency:g}   bubble {m.bubble_fraction:.1%}   "
        f"stage owners {[list(o) for o in result.table.owners]}"
    )
    header = ["worker", "busy", "act in/out", "grad in/out", "w fetch/serve", "g reduce out/in",
              "allreduce", "peak act", "owned", "peak resident"]
    rows = [
        [w.worker, f"{w.busy:g}", f"{w.activation_recvs}/{w.activation_sends}",
         f"{w.input_grad_recvs}/{w.input_grad_sends}", f"{w.weight_fetches}/{w.weight_serves}",
         f"{w.grad_sends}/{w.grad_recvs}", w.allreduces, w.peak_activations, w.owned_stages,
         w.peak_resident_stages]
        for w in m.per_worker
    ]
    return head + "\n" + text_table(rows, header)
