"""Where the step goes: the fidelity rows' efficiency, split into what the rest of the step is.

A fidelity row (:mod:`benchmarks.bench_fidelity`) measures ``executor.step`` (the programs) and
reports efficiency = ideal / measured, where ideal = one process's forward+backward of the whole
global batch / W: the step a perfectly parallel run of the same work would take. This module
splits the measured step into five parts that add up to it exactly:

* **ideal**: the efficiency's numerator (single-process compute / W);
* **microbatch compute**: the work the planned jobs really do, per rank on average
  (B x the sum of every stage's in-run F, B and W times, / W) minus ideal. Splitting the batch
  into microbatches and the model into stages makes each job's matmuls smaller and adds the
  per-job fixed costs (autograd set-up, the loss on every microbatch), so this is usually > 0;
* **bubble**: the compute-only replay of the executed programs with the in-run costs (no
  communication), minus that average work: idle time of a rank waiting on another (pipeline
  fill and drain, imbalance between stages and ranks);
* **communication**: the prediction with the measured message, fetch and reduction times
  minus the compute-only replay: what the transfers add to the critical path;
* **runtime overhead**: measured - predicted: what the runtime costs beyond the model (Python
  dispatch, waiting that the model does not know of, noise).

The issue's coarser "bubble = predicted compute-only latency - ideal" is microbatch compute +
bubble here. Beside the five, the Lightning loop around the programs (optimizer step, hooks,
logging: the whole Lightning step - measured) is given for scale; it is not part of the sum.

Everything is recomputed in the parent from the row's ``extra``: the programs are planned again
from the same offline costs (planning is deterministic, and the compute-only latency of this
plan is checked against the one the run reported), then re-costed with the in-run means.
"""

from __future__ import annotations

import dataclasses
from typing import Any

PARTS = ("ideal", "microbatch_compute", "bubble", "communication", "runtime_overhead")
LABELS = {"ideal": "ideal compute", "microbatch_compute": "microbatch compute",
          "bubble": "bubble", "communication": "communication",
          "runtime_overhead": "runtime overhead"}


class ReplanMismatch(RuntimeError):
    """The programs planned again here are not the ones the fidelity run executed."""


def breakdown(r: dict[str, Any]) -> dict[str, float]:
    """Seconds per part of the measured step (:data:`PARTS`, summing to ``measured_s``).

    ``r``: a fidelity row's ``extra`` (what :func:`benchmarks.bench_fidelity.fidelity_run`
    returns). Also returns ``lightning_loop`` (whole Lightning step - measured programs).
    """
    from lightning_gsched.schedule.plan import plan
    from lightning_gsched.schedule.predict import predict_step_time
    from lightning_gsched.schedule.simulate import Costs

    costs = {"forward_cost": r["forward_cost_s"], "backward_cost": r["backward_cost_s"]}
    if r.get("weight_cost_s"):
        costs["weight_cost"] = r["weight_cost_s"]
    planned = plan(r["schedule"], workers=r["W"], microbatches=r["B"], R=r["R"], **costs)
    if abs(planned.metrics.latency - r["predicted_compute_only_s"]) > 1e-9 * max(
            1.0, r["predicted_compute_only_s"]):
        raise ReplanMismatch(
            f"{r['schedule']}: planning again gave a compute-only latency of "
            f"{planned.metrics.latency} s, the run reported {r['predicted_compute_only_s']} s")
    split = planned.programs.split_backward
    forward, backward = r["inrun_forward_cost_s"], r["inrun_backward_cost_s"]
    weight = r["inrun_weight_cost_s"] if split else None
    in_run = dataclasses.replace(
        planned, costs=Costs.build(r["S"], forward, backward, weight, split))
    compute_only = predict_step_time(in_run).latency
    work = r["B"] * (sum(forward) + sum(backward) + sum(weight or ())) / r["W"]
    ideal = r["single_process_s"] / r["W"]
    measured, predicted = r["measured_s"], r["predicted_s"]
    return {
        "ideal": ideal,
        "microbatch_compute": work - ideal,
        "bubble": compute_only - work,
        "communication": predicted - compute_only,
        "runtime_overhead": measured - predicted,
        "lightning_loop": r["lightning_step_s"] - measured,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    """One line per fidelity row: measured step, and each part as a share of it."""
    header = ["schedule", "measured", "efficiency", *(LABELS[p] for p in PARTS[1:]),
              "Lightning loop (not in the sum)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        try:
            parts = breakdown(r)
        except Exception as exc:  # one row must not hide the others
            lines.append(f"| {r['schedule']} | {r['measured_s'] * 1e3:.0f} ms | "
                         f"{r['efficiency']:.2f} | {type(exc).__name__}: {exc} |")
            continue
        measured = r["measured_s"]
        shares = [f"{parts[p] / measured:+.0%}" for p in PARTS[1:]]
        lines.append(f"| {r['schedule']} | {measured * 1e3:.0f} ms | "
                     f"{parts['ideal'] / measured:.2f} | " + " | ".join(shares)
                     + f" | {parts['lightning_loop'] * 1e3:+.0f} ms |")
    return "\n".join(lines)


def text(rows: list[dict[str, Any]]) -> str:
    """The same as :func:`markdown`, for a terminal."""
    return "\n".join(line.strip("|").replace(" | ", "  ") for line in markdown(rows).splitlines()
                     if not line.startswith("|---"))
