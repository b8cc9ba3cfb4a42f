"""GeneralParallel with tensor-parallel workers trains like one device, under the Trainer.

W = 4 ranks as P = 2 pipeline workers x T = 2 tensor-parallel ranks (rank ``w * 2 + t``): each
worker's stages are sharded over its two ranks by a ``tensor_parallel_plan`` written as for
``parallelize_module`` (q, k, v and the MLP's first layer column-wise, the projections after
them row-wise), on the model's own module names. Each schedule fits k=3 optimizer steps of
SGD with momentum and a per-step LR schedule on the same global batches as a single-process
Trainer run here, and:

* every rank's final weights (the shards gathered back at teardown, so each rank holds the full
  model) equal one device's, and so does rank 0's logged ``train_loss`` per step;
* the rows come from Lightning's own distributed sampler, which the strategy tells to give a
  worker's two ranks the same share (``distributed_sampler_kwargs``): the fit fails if they
  loaded different batches;
* ``trainer.strategy.device_mesh`` is (P, G, T) with ``"tensor_parallel"`` innermost, and
  each shard was held as a plain parameter of its local size during the fit.

Tolerance: ``assert_same_state``'s rtol 1e-5 / atol 1e-6, for its stated reason. Tensor
parallelism only changes where sums are split: a row-wise layer adds T partial dot products
(an all-reduce) where one device adds one, which reorders float32 summation as microbatches
and ranks already do; a wrong shard, a missed all-reduce or a doubled loss moves weights by
~1e-3.
"""

from __future__ import annotations

import functools
import tempfile
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, Subset, TensorDataset

from dist_harness import WorkerContext
from lightning_models import (
    as_worker,
    assert_same_state,
    csv_metric,
    make_lit_gpt,
    state_of,
    tokens,
    trainer,
)

pytestmark = pytest.mark.distributed

T = 2
STEPS, GLOBAL_BATCH = 3, 8
# the model's own names under the LightningModule (self.model): the stages keep them
PLAN = {"model.blocks.*.attn.q": "colwise", "model.blocks.*.attn.k": "colwise",
        "model.blocks.*.attn.v": "colwise", "model.blocks.*.attn.proj": "rowwise",
        "model.blocks.*.mlp.0": "colwise", "model.blocks.*.mlp.2": "rowwise"}
SCHEDULES = ["gpipe", "1f1b", "zb-h1", "zbv"]
WORLD_TIMEOUT = 400.0  # seconds per check: four whole Trainer fits


def _loader(workers: int) -> DataLoader:
    """Distributed: the whole dataset, which the Trainer's DistributedSampler deals to the
    W / T shares. Lightning always shuffles a training set it samples (seed 0 + epoch, no
    ``seed_everything`` here) and deals the permutation round-robin, so global batch i is
    the rows ``perm[i * GLOBAL_BATCH : (i + 1) * GLOBAL_BATCH]``: one device reads exactly
    those, in that order."""
    dataset = TensorDataset(tokens(GLOBAL_BATCH * STEPS))
    if workers > 1:
        return DataLoader(dataset, batch_size=GLOBAL_BATCH // workers, shuffle=False)
    perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
    return DataLoader(Subset(dataset, perm), batch_size=GLOBAL_BATCH, shuffle=False)


def _fit(world: int, strategy: Any, tmp: str) -> tuple[dict, Any]:
    model = make_lit_gpt(shardable=True)
    fit = trainer(world, strategy, tmp, max_steps=STEPS, use_distributed_sampler=world > 1)
    shapes: dict[str, tuple[int, ...]] = {}

    class Shapes(Callback):
        def on_train_batch_end(self, *args: Any) -> None:  # during the fit: the shards held
            shapes.update({n: tuple(p.shape) for n, p in model.named_parameters()
                           if ("attn.q" in n or "mlp.2.weight" in n) and p.numel()})

    fit.callbacks.append(Shapes())
    fit.fit(model, _loader(world // T if world > 1 else 1))
    mesh = fit.strategy.device_mesh if world > 1 else None
    return state_of(model), (shapes, None if mesh is None else (
        tuple(mesh.shape), mesh.mesh_dim_names))


def fits_on_worker(ctx: WorkerContext, tmp: str) -> list[tuple[dict, Any]]:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    out = []
    for schedule in SCHEDULES:
        strategy = GeneralParallel(schedule, microbatches=4, tensor_parallel_size=T,
                                   tensor_parallel_plan=PLAN)
        out.append(_fit(ctx.world_size, strategy, f"{tmp}/{schedule}"))
    return out


@functools.lru_cache(maxsize=None)
def reference() -> tuple[dict, list, dict]:
    tmp = tempfile.mkdtemp()
    state, (shapes, _) = _fit(1, "auto", tmp)
    return state, csv_metric(tmp, "train_loss"), shapes


def test_pipeline_of_tensor_parallel_workers_fits_like_one_device(worlds: Any,
                                                                   tmp_path: Any) -> None:
    want, want_log, full_shapes = reference()
    results = worlds.get(4).run(fits_on_worker, str(tmp_path))
    for rank, per_schedule in enumerate(results):
        for schedule, (state, (shapes, mesh)) in zip(SCHEDULES, per_schedule, strict=True):
            label = f"{schedule}, rank {rank}"
            assert_same_state(state, want, label)
            assert mesh == ((2, 1, 2), ("pipeline", "data_parallel", "tensor_parallel")), label
            assert shapes, label  # each worker holds some sharded layer
            for name, shape in shapes.items():  # column-wise: rows halved; row-wise: columns
                full = full_shapes[name]
                halved = 0 if "attn.q" in name else 1
                assert shape[halved] == full[halved] // T, (label, name, shape, full)
    for schedule in SCHEDULES:
        got = csv_metric(str(tmp_path / schedule), "train_loss")
        assert [s for s, _ in got] == [s for s, _ in want_log], schedule
        torch.testing.assert_close(torch.tensor([v for _, v in got]),
                                   torch.tensor([v for _, v in want_log]), rtol=1e-5, atol=1e-6)
