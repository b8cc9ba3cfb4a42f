"""A Fabric loop under GeneralParallelFabric that gets SIGTERM mid-run: the subject of
``test_fabric_faults.py`` and of the Fabric trials of ``benchmarks/fault_trials.py``.

Run as ``python fabric_preempt_script.py OUT_DIR RANK STEP [WHERE [FAULT [uncaught]]]``: Fabric's
script launcher re-runs it for rank 1 (as a user's ``python train.py`` with ``devices=2``). At
loop step STEP, rank RANK does FAULT (``sigterm``: SIGTERM to itself, the default, or
``sigterm-launcher``: to rank 0, the launcher) at WHERE: ``loss`` (the default: inside the loss
function after ``model(...)``; on the last stage's rank that code runs inside the schedule,
while the other rank is in the step's traffic; on rank 0 it is never reached), ``before_step``
(the loop's own code before ``strategy.step``) or ``after_step`` (after ``optimizer.step``). The
loop is the one docs/usage.md shows: after each step, if ``fabric.strategy.preempted``, save
and leave. It then checks that a further ``step`` raises ``PreemptedError``. Every rank writes
``OUT_DIR/rank<r>.json``: how its loop ended, the steps done, whether it did the fault
(``injected``) and what the extra step raised; ``OUT_DIR/pid<r>`` as it starts (the test kills
stuck ranks by it). With ``uncaught``, rank 1 then raises in the user's code, uncaught
(:func:`uncaught_on_one_rank`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # the tests' helpers; this checkout's package

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402

from models import make_mlp, seeded  # noqa: E402

STEPS, WORLD, GLOBAL_BATCH = 6, 2, 8


def main() -> None:
    from lightning_gsched.errors import PreemptedError
    from lightning_gsched.fabric import GeneralParallelFabric

    out, signal_rank, signal_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    where = sys.argv[4] if len(sys.argv) > 4 else "loss"
    fault = sys.argv[5] if len(sys.argv) > 5 else "sigterm"
    os.environ.setdefault("GSCHED_TEST_LAUNCHER", str(os.getpid()))  # rank 0's, inherited
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=WORLD,
                    strategy=GeneralParallelFabric("1f1b", step_timeout=30))
    fabric.launch()
    rank = fabric.global_rank
    with open(os.path.join(out, f"pid{rank}"), "w") as handle:
        handle.write(str(os.getpid()))
    model = make_mlp(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    inputs = seeded(1, lambda: torch.randn(GLOBAL_BATCH * STEPS, 16))
    targets = seeded(2, lambda: torch.randn(GLOBAL_BATCH * STEPS, 8))
    rows = GLOBAL_BATCH // WORLD
    step = 0

    injected: list[str] = []

    def inject(point: str) -> None:
        if rank == signal_rank and step == signal_step and point == where and not injected:
            injected.append(point)
            target = os.getpid() if fault == "sigterm" else int(os.environ["GSCHED_TEST_LAUNCHER"])
            os.kill(target, signal.SIGTERM)  # a preemption notice

    def loss_fn(model: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        output = model(x)
        inject("loss")
        return F.mse_loss(output, y)

    result: dict[str, Any] = {"rank": rank}
    try:
        for step in range(STEPS):  # noqa: B007 - loss_fn reads it
            start = step * GLOBAL_BATCH + rank * rows
            batch = (inputs[start:start + rows], targets[start:start + rows])
            optimizer.zero_grad()
            inject("before_step")
            fabric.strategy.step(model, batch, loss_fn)
            optimizer.step()
            inject("after_step")
            if fabric.strategy.preempted:
                fabric.save(os.path.join(out, "ckpt.pt"),
                            {"model": model, "optimizer": optimizer, "step": step + 1})
                break
        result["outcome"] = "preempted" if fabric.strategy.preempted else "finished"
        result["steps"] = step + 1
        result["notice"] = fabric.strategy.preemption
        try:  # a loop that stepped on regardless stops too, on every rank
            fabric.strategy.step(model, batch, loss_fn)
            result["after"] = "stepped"
        except PreemptedError as exc:
            result["after"] = str(exc)
    except BaseException as exc:  # noqa: BLE001 - the test reads how each rank ended
        result["outcome"] = type(exc).__name__
        result["message"] = str(exc)
        result["traceback"] = traceback.format_exc()
    result["injected"] = bool(injected)
    # whole or absent: the test reads a result as soon as its file exists (launched_jobs.py)
    path = os.path.join(out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as handle:
        json.dump(result, handle)
    os.replace(path + ".tmp", path)
    sys.stdout.flush()
    if sys.argv[-1] == "uncaught":
        uncaught_on_one_rank(fabric, out, rank)


def uncaught_on_one_rank(fabric: Fabric, out: str, rank: int) -> None:
    """Then a bug in the user's own loop: rank 1 raises and leaves it uncaught, while rank 0
    waits in a barrier. Rank 0 must stop at once naming rank 1's error, and live to write
    ``after0.json`` 6 s later (past the 5 s in which Lightning's launcher would SIGKILL it once
    rank 1 exited non-zero, unless rank 1 outlives it)."""
    import time

    if rank == 1:
        raise ValueError("a bug in the user's loop on rank 1")
    message = None
    try:
        fabric.barrier()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        message = f"{type(exc).__name__}: {exc}"
    time.sleep(6)
    with open(os.path.join(out, "after0.json"), "w") as handle:
        json.dump({"message": message}, handle)


if __name__ == "__main__":
    main()
