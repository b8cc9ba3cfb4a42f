"""W=8 as P=2 pipelines x G=2 replicas x T=2 tensor-parallel ranks trains
like one device (issue 35's 3D check, which the test suite's time budget leaves to a benchmark).

Not a speed row: eight processes share this machine's cores. What it checks is the result a
user of ``configs/1f1b_3d.yaml`` gets: ``GeneralParallel("1f1b", data_parallel_size=2,
tensor_parallel_size=2, ...)`` through the Trainer, and ``GeneralParallelFabric`` with the same
arguments in a user's own loop (``--front``), the benchmark GPT built with separate q, k,
v (``shardable=True``) and the plan of ``bench_tp`` (attention and MLP column-wise, then
row-wise), ``STEPS`` steps of SGD with momentum on fixed global batches, against the same fit on
one device in this process. Each of the W / T = 4 workers loads one share of every global batch
(as the strategy's ``distributed_sampler_kwargs`` would deal it) and the rows move to the ranks
that read them.

Printed: the largest difference of any final weight on any rank (the shards are gathered at
teardown, so every rank holds the full model) and of the logged loss at every step, and whether
both are within the suite's tolerance for tensor parallelism (rtol 1e-5, atol 1e-6: it only
moves where float32 sums are split, as microbatches and replicas already do; a wrong shard, a
missed all-reduce or a doubled gradient moves the weights by ~1e-3).

``--sequence``: the same check at W=4 as P=2 x T=2 (G=1) with Megatron-style sequence
parallelism instead (``benchmarks.bench_tp.sequence_plan``, the blocks leaf modules of the
split): the residual stream travels between stages as each rank's half of the sequence.
``--per-replica``: ``data_loading="per_replica"``, every rank of a replica given
the replica's batch (its workers' shares joined in position order, the same microbatches), so
no row moves after the build, whose probe sends microbatch 0 from each rank of replica 0 to
the rank at the same pipeline position and tensor-parallel index of replica 1.

    python -m benchmarks.check_3d [--quick] [--json] [--sequence] [--per-replica]
                                  # exit 1 if not equal
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import launch_ranks

WORLD, G, T = 8, 2, 2  # P = WORLD / (G * T) = 2
SEQUENCE_WORLD = 4  # --sequence: P = 2 x T, no replicas
GLOBAL_BATCH = 16  # rows per step: 4 per worker, cut into 4 microbatches per replica
QUICK_STEPS, FULL_STEPS = 2, 4
RTOL, ATOL = 1e-5, 1e-6


def _layout(sequence: bool, prefix: str, per_replica: bool = False) -> dict[str, Any]:
    """The strategy's parallel arguments: ``prefix`` leads the plan's module names (``"core."``
    under the LightningModule, ``""`` on the core itself)."""
    from benchmarks.bench_tp import plan, sequence_plan

    if sequence:
        return {"data_parallel_size": 1, "tensor_parallel_size": T,
                "tensor_parallel_plan": sequence_plan(prefix),
                "leaf_modules": ("ShardableBlock",)}
    return {"data_parallel_size": G, "tensor_parallel_size": T,
            "tensor_parallel_plan": plan(prefix),
            **({"data_loading": "per_replica"} if per_replica else {})}


def _loaded(rank: int, world: int, sequence: bool, per_replica: bool) -> tuple[int, list[int]]:
    """(rows per worker share, the workers whose shares this rank's batch joins): its own
    worker's, or with ``per_replica`` its replica's workers ``p * G + g`` in position order."""
    workers = world // T
    replicas = 1 if sequence else G
    share = GLOBAL_BATCH // workers
    if not per_replica:
        return share, [rank // T]
    return share, [p * replicas + (rank // T) % replicas for p in range(workers // replicas)]


def _fit(rank: int, world: int, steps: int, sequence: bool = False,
         per_replica: bool = False) -> tuple[dict[str, Any], list[float]]:
    """One fit on ``world`` ranks (1: one device): the final weights and the loss per step."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, Subset

    from benchmarks.lit_runs import run_fit
    from benchmarks.model import BenchLit, GPTShape, rank_loader, token_data
    from lightning_gsched import GeneralParallel

    losses: list[float] = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            losses.append(float(trainer.callback_metrics["train_loss"]))

    shape = GPTShape()
    if world == 1:
        strategy: Any = "auto"
        loader = rank_loader(shape, GLOBAL_BATCH, steps, 0, 1)
    else:
        strategy = GeneralParallel("1f1b", microbatches=4,
                                   **_layout(sequence, "core.", per_replica))
        share, mine = _loaded(rank, world, sequence, per_replica)
        index = [i * GLOBAL_BATCH + w * share + j
                 for i in range(steps) for w in mine for j in range(share)]
        loader = DataLoader(Subset(token_data(shape, GLOBAL_BATCH * steps), index),
                            batch_size=share * len(mine), shuffle=False)
    model = BenchLit(shardable=True)
    run_fit(strategy, rank, world, steps, GLOBAL_BATCH, shape, [Losses()], model=model,
            loader=loader)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _fabric_fit(rank: int, world: int, steps: int, sequence: bool = False,
                per_replica: bool = False) -> tuple[dict[str, Any], list[float]]:
    """The same training in a user's own Fabric loop (1: plain torch on one device): each
    worker's T ranks step on its share of every global batch with ``strategy.step`` (with
    ``per_replica``: every rank on its replica's batch)."""
    import torch

    from benchmarks.model import GPTShape, build_core, lm_loss, token_data

    shape = GPTShape()
    core = build_core(shape, seed=0, shardable=True)
    xs, ys = token_data(shape, GLOBAL_BATCH * steps).tensors
    losses: list[float] = []
    if world == 1:
        opt = torch.optim.SGD(core.parameters(), lr=0.05, momentum=0.9)
        for i in range(steps):
            rows = slice(i * GLOBAL_BATCH, (i + 1) * GLOBAL_BATCH)
            loss = lm_loss(core(xs[rows]), ys[rows])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return {k: v.detach().clone() for k, v in core.state_dict().items()}, losses
    from lightning.fabric import Fabric

    from lightning_gsched.fabric import GeneralParallelFabric

    fabric = Fabric(accelerator="cpu", devices=world, strategy=GeneralParallelFabric(
        "1f1b", microbatches=4, **_layout(sequence, "", per_replica)))
    fabric.launch()
    model, opt = fabric.setup(core, torch.optim.SGD(core.parameters(), lr=0.05, momentum=0.9))
    share, mine = _loaded(rank, world, sequence, per_replica)
    for i in range(steps):
        index = torch.cat([torch.arange(share) + i * GLOBAL_BATCH + w * share for w in mine])
        batch = (xs[index], ys[index])
        loss = fabric.strategy.step(model, batch, lambda m, b: lm_loss(m(b[0]), b[1]))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    fabric.strategy.finish()  # the shards gathered: every rank holds the full model
    weights = {k: v.detach().clone() for k, v in core.state_dict().items()}
    fabric.strategy.teardown()
    return weights, losses


FRONTS = {"trainer": _fit, "fabric": _fabric_fit}


def fit_rank(rank: int, world: int, steps: int, out: str, front: str,
             sequence: bool = False, per_replica: bool = False) -> list[float]:
    """A launched rank (:func:`benchmarks.common.launch_ranks`): its weights saved to ``out``,
    its losses returned."""
    import torch

    weights, losses = FRONTS[front](rank, world, steps, sequence, per_replica)
    torch.save(weights, Path(out) / f"rank{rank}.pt")
    return losses


def check(steps: int, front: str, sequence: bool = False,
          per_replica: bool = False) -> dict[str, Any]:
    """Every rank's weights and losses against one device's: the largest differences, and
    whether each rank is within RTOL / ATOL."""
    import torch

    world = SEQUENCE_WORLD if sequence else WORLD
    want, want_losses = FRONTS[front](0, 1, steps)
    with tempfile.TemporaryDirectory(prefix="gsched_3d_") as out:
        losses = launch_ranks("benchmarks.check_3d:fit_rank", world, steps=steps, out=out,
                              front=front, sequence=sequence, per_replica=per_replica)
        ranks = [torch.load(Path(out) / f"rank{r}.pt") for r in range(world)]
    weight_diff = max(float((got[k] - v).abs().max()) for got in ranks for k, v in want.items())
    within = [all(torch.allclose(got[k], v, rtol=RTOL, atol=ATOL) for k, v in want.items())
              for got in ranks]
    # each rank logs the step's global loss (the same value on every rank that reports it)
    a, b = torch.tensor(losses[0]), torch.tensor(want_losses)
    loss_ok = len(a) == len(b) and torch.allclose(a, b, rtol=RTOL, atol=ATOL)
    return {"front": front,
            "layout": (f"W={world} = P=2 x T={T}, sequence parallelism, 1f1b, 4 microbatches"
                       if sequence else
                       f"W={world} = P=2 x G={G} x T={T}, 1f1b, 4 microbatches per replica"
                       + (", data_loading='per_replica'" if per_replica else "")),
            "steps": steps, "largest_weight_diff": weight_diff,
            "ranks_within_tolerance": within, "losses": losses[0],
            "losses_one_device": want_losses, "losses_within_tolerance": loss_ok,
            "equal": all(within) and loss_ok}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--front", choices=sorted(FRONTS), action="append",
                        help="the front end(s) to check (default: both)")
    parser.add_argument("--sequence", action="store_true",
                        help="W=4 as P=2 x T=2 with sequence parallelism instead of W=8")
    parser.add_argument("--per-replica", action="store_true",
                        help="data_loading='per_replica': a replica's ranks load its batch")
    args = parser.parse_args(argv)
    fronts = args.front or list(FRONTS)
    results = [check(QUICK_STEPS if args.quick else FULL_STEPS, front, args.sequence,
                     args.per_replica)
               for front in fronts]
    for result in results:
        if args.json:
            print(json.dumps(result))
        else:
            print("\n".join(f"{key}: {value}" for key, value in result.items()) + "\n")
    sys.exit(0 if all(r["equal"] for r in results) else 1)


if __name__ == "__main__":
    main()
