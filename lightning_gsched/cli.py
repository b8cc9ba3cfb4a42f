"""``gsched``: plan, draw and compare schedules from the command line (no torch needed).

    gsched plan fslpp --workers 4 --stages 4 --microbatches 8 --R 2 --png fslpp.png
    gsched plan 1f1b -w 4 -b 8 --json
    gsched plan fsdp -w 4 --forward-only --programs      # validation/test/predict programs
    gsched compare --workers 4 --stages 4 --microbatches 8
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from lightning_gsched.errors import GschedError
from lightning_gsched.schedule import LIBRARY, Plan, plan
from lightning_gsched.schedule.orders import ORDER_NAMES
from lightning_gsched.schedule.render import ascii_timeline, save_png


def _costs(text: str) -> float | list[float]:
    """'2' -> 2.0; '1,1,2,2' -> per-stage list."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"costs must be a number or comma-separated numbers, got {text!r}")
    return values[0] if len(values) == 1 else values


def _cap(text: str) -> int | str | None | list[int]:
    if text in ("none", "None"):
        return None
    if text in ("auto", "default"):
        return text
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cap must be an int, a comma list of ints, 'auto' or 'none', got {text!r}")
    return values[0] if len(values) == 1 else values


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-w", "--workers", type=int, required=True, help="W: number of workers (ranks)")
    parser.add_argument("-s", "--stages", type=int, default=None, help="S: pipeline stages (default: per schedule)")
    parser.add_argument("-b", "--microbatches", type=int, default=None, help="B: microbatches per step (default: per schedule)")
    parser.add_argument("--R", type=int, default=None, help="workers per looped group (lpp, fslpp, ...)")
    parser.add_argument("--forward-cost", type=_costs, default=1.0, help="F duration: one number or one per stage")
    parser.add_argument("--backward-cost", type=_costs, default=2.0, help="B duration: one number or one per stage")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gsched", description="Plan and compare lightning_gsched schedules.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="simulate one schedule; print its metrics and timeline")
    p.add_argument("schedule", help=f"one of: {', '.join(LIBRARY)}")
    _common(p)
    p.add_argument("--order", choices=ORDER_NAMES, default=None, help="tie-break order n(s,b,d)")
    p.add_argument("--cap", type=_cap, default="default", help="activation cap: int, list, 'auto' or 'none'")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--png", metavar="FILE", default=None, help="also draw the timeline to FILE")
    p.add_argument("--programs", action="store_true", help="also print every rank's program")
    p.add_argument("--forward-only", action="store_true",
                   help="plan forward jobs only (validate/test/predict); same owners as training, "
                        "the cap is ignored")
    c = sub.add_parser("compare", help="the seed's Table 1 with numbers, every library schedule side by side")
    _common(c)
    c.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    return parser


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    lines += [fmt.format(*[str(c) for c in r]) for r in rows]
    return "\n".join(lines)


def describe(result: Plan) -> str:
    """Text summary of a plan: configuration, latency, bubble, and one row per worker."""
    m = result.metrics
    head = (
        f"schedule {result.schedule}: W={result.workers} S={result.stages} B={result.micro}"
        + (f" R={result.R}" if result.R is not None else "")
        + f" order={result.order} cap={_cap_text(result.caps)}"
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
    return head + "\n" + _table(rows, header)


def _cap_text(caps: list) -> str:
    if all(c is None for c in caps):
        return "none"
    if len(set(caps)) == 1:
        return str(caps[0])
    return ",".join(str(c) for c in caps)


def compare_rows(workers: int, stages: int | None, micro: int | None, R: int | None,
                 forward_cost, backward_cost) -> list[dict]:
    rows = []
    for name in LIBRARY:
        try:
            uses_R = LIBRARY[name].default_R is not None
            result = plan(name, workers=workers, stages=stages, microbatches=micro,
                          R=R if uses_R and name != "interleaved" else None,
                          forward_cost=forward_cost, backward_cost=backward_cost)
        except GschedError as exc:
            rows.append({"schedule": name, "error": str(exc)})
            continue
        m = result.metrics
        rows.append({
            "schedule": name, "stages": result.stages, "microbatches": result.micro, "R": result.R,
            "latency": m.latency, "bubble_fraction": m.bubble_fraction,
            "activation_msgs_per_worker": m.max_of("activation_recvs") + m.max_of("input_grad_recvs"),
            "weight_fetches_per_worker": m.max_of("weight_fetches"),
            "grad_sends_per_worker": m.max_of("grad_sends"),
            "activation_storage_per_worker": m.max_of("peak_activations"),
            "weight_storage_per_worker": m.max_of("peak_resident_stages"),
            "owned_stages_max": m.max_of("owned_stages"),
        })
    return rows


def _compare_text(rows: list[dict], workers: int) -> str:
    header = ["scheme", "S", "B", "R", "latency", "bubble", "act msgs/w", "w fetches/w",
              "g reduces/w", "act store/w", "w store/w", "owned max"]
    table, errors = [], []
    for r in rows:
        if "error" in r:
            errors.append(f"  {r['schedule']}: {r['error']}")
            continue
        table.append([r["schedule"], r["stages"], r["microbatches"], r["R"] if r["R"] is not None else "-",
                      f"{r['latency']:g}", f"{r['bubble_fraction']:.1%}",
                      r["activation_msgs_per_worker"], r["weight_fetches_per_worker"],
                      r["grad_sends_per_worker"], r["activation_storage_per_worker"],
                      r["weight_storage_per_worker"], r["owned_stages_max"]])
    text = (f"W={workers}; per-worker columns are the maximum over workers; storage counts "
            "microbatch-stages (activations) and stages (weights)\n" + _table(table, header))
    if errors:
        text += "\nnot valid for these sizes:\n" + "\n".join(errors)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "plan":
            result = plan(args.schedule, workers=args.workers, stages=args.stages,
                          microbatches=args.microbatches, R=args.R, order=args.order, cap=args.cap,
                          forward_cost=args.forward_cost, backward_cost=args.backward_cost,
                          forward_only=args.forward_only)
            if args.png:
                save_png(result.timeline, args.png,
                         f"{result.schedule}: W={result.workers} S={result.stages} B={result.micro}"
                         + (" (forward only)" if result.forward_only else ""))
            if args.json:
                print(json.dumps(result.to_json()))
            else:
                print(describe(result))
                print()
                print(ascii_timeline(result.timeline))
                if args.programs:
                    print()
                    print(result.programs.text())
                if args.png:
                    print(f"wrote {args.png}")
        else:
            rows = compare_rows(args.workers, args.stages, args.microbatches, args.R,
                                args.forward_cost, args.backward_cost)
            print(json.dumps(rows) if args.json else _compare_text(rows, args.workers))
    except GschedError as exc:
        print(f"gsched: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
