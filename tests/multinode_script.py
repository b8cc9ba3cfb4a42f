"""One rank of the 2-node x 2-process job that ``test_lightning_multinode.py`` starts with torchrun.

Why a script and not a dist_harness check: the point is Lightning's own multi-node path, from
the environment torchrun sets (RANK, LOCAL_RANK, GROUP_RANK, WORLD_SIZE, MASTER_ADDR/PORT)
through ``Trainer(num_nodes=2, devices=2)`` and DDPStrategy's rank arithmetic to the process
group and GeneralParallel's plan, exactly as a user's job on two machines would run it.

    python -m torch.distributed.run --nnodes 2 --node_rank I --nproc-per-node 2 \\
        --master_addr 127.0.0.1 --master_port PORT tests/multinode_script.py OUT_DIR

Each rank trains the fixed LitGPT for ``STEPS`` steps on its rows of every global batch (SGD
with momentum and a StepLR, as in lightning_models), then writes ``OUT_DIR/rank<R>.json`` (what
Lightning, torch.distributed and the running engine saw) and ``OUT_DIR/rank<R>.pt`` (its
weights after the run, which ``gather_on_teardown`` makes the full model on every rank).
First of all it writes ``OUT_DIR/worker<R>.pid``: torchrun starts each worker in a session of
its own, so a test that kills a launcher must also know its workers to stop them.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before the slow imports, so a stuck start-up can be stopped too
    with open(os.path.join(sys.argv[1], f"worker{os.environ['RANK']}.pid"), "w") as pid_file:
        pid_file.write(str(os.getpid()))

import json
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_gsched import GeneralParallel
from lightning_models import RankSlices, make_lit_gpt, state_of, tokens, trainer

NUM_NODES = 2
DEVICES = 2  # processes per node
GLOBAL_BATCH = 8  # rows per step over all 4 ranks: 2 per rank
STEPS = 3
DATA_SEED = 3


class SeenByTheEngine(pl.Callback):
    """Records, during training, what the running GeneralParallel engine and the process group
    report (the engine is dropped at teardown, so it must be read while the fit runs)."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        assert engine is not None and engine.executor is not None
        self.seen = dict(
            plan_workers=engine.train_plan.workers,
            engine_world_size=engine.world_size,
            engine_rank=engine.rank,
            channels_rank=engine.executor.channels.rank,
            dist_rank=dist.get_rank(),
            dist_world_size=dist.get_world_size(),
            parameter_device=str(next(pl_module.parameters()).device),
        )


def main(out_dir: str) -> None:
    data = tokens(GLOBAL_BATCH * STEPS, seed=DATA_SEED)
    model = make_lit_gpt()
    seen = SeenByTheEngine()
    # step_timeout/timeout bound every wait, so a broken exchange fails instead of hanging
    strategy = GeneralParallel("fslpp", step_timeout=60, timeout=timedelta(seconds=120))
    run = trainer(DEVICES, strategy, num_nodes=NUM_NODES, max_steps=STEPS, callbacks=[seen])
    run.fit(model, datamodule=RankSlices(data, GLOBAL_BATCH))
    rank = run.global_rank
    record = dict(
        world_size=run.world_size, global_rank=rank, local_rank=run.local_rank,
        node_rank=run.node_rank, num_nodes=run.num_nodes,
        cluster_environment=type(run.strategy.cluster_environment).__name__,  # type: ignore
        env={k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE")},
        global_step=run.global_step, **seen.seen,
    )
    torch.save(state_of(model), os.path.join(out_dir, f"rank{rank}.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle)


if __name__ == "__main__":
    main(sys.argv[1])
