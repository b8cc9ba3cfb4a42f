"""GeneralParallel with tensor-parallel workers trains like one device, under the Trainer.

W = 4 ranks as P = 2 pipeline workers x T = 2 tensor-parallel ranks (rank ``w * 2 + t``): each
worker's stages are sharded over its two ranks by a ``tensor_parallel_plan`` written as for
``parallelize_module`` (q, k, v and the MLP's first layer column-wise, the projections after
them row-wise), on the model's own module names. Each schedule fits k=3 optimizer steps of
SGD with momentum and a per-step LR schedule on the same global batches as a single-process
Trainer run here, with gradient clipping by the global norm (0.5, which binds: the first
steps' norms are above it), and:

* every rank's final weights (the shards gathered back at teardown, so each rank holds the full
  model) equal one device's, and so does rank 0's logged ``train_loss`` per step;
* the rows come from Lightning's own distributed sampler, which the strategy tells to give a
  worker's two ranks the same share (``distributed_sampler_kwargs``): the fit fails if they
  loaded different batches;
* ``trainer.strategy.device_mesh`` is (P, G, T) with ``"tensor_parallel"`` innermost, and
  each shard was held as a plain parameter of its local size during the fit;
* the start-up memory prediction (made from the sharded stages) is within 0.85-1.25 of what the
  runtime accounted each rank to hold in the measured step, on every rank;
* the trained model's own forward after the fit (whole again, the styles' hooks gone) gives
  one device's outputs.

``"auto"`` with ``tensor_parallel_size=2`` runs in the same job (its pick's profiles measured on
sharded stages by ranks 0 and 1) and must end with one device's weights and losses too.

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
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dist_harness import WorkerContext
from lightning_models import (
    LitGPT,
    as_worker,
    assert_same_state,
    csv_metric,
    make_lit_gpt,
    state_of,
    tokens,
    trainer,
)
from models import seeded

pytestmark = pytest.mark.distributed

T = 2
STEPS, GLOBAL_BATCH = 3, 8
DEFERRED_SEED = 1234
CLIP = 0.5  # by the global norm: each shard counted on its rank, each replicated weight once
# the model's own names under the LightningModule (self.model): the stages keep them
PLAN = {"model.blocks.*.attn.q": "colwise", "model.blocks.*.attn.k": "colwise",
        "model.blocks.*.attn.v": "colwise", "model.blocks.*.attn.proj": "rowwise",
        "model.blocks.*.mlp.0": "colwise", "model.blocks.*.mlp.2": "rowwise"}
SCHEDULES = ["gpipe", "1f1b", "zb-h1", "zbv"]
WORLD_TIMEOUT = 400.0  # seconds per check: four whole Trainer fits


def _loader(workers: int) -> DataLoader:
    """Distributed: the whole dataset, which the Trainer's DistributedSampler deals to the
    W / T shares. Lightning always shuffles a training set it samples (a permutation seeded
    0 + epoch, no ``seed_everything`` here) and deals it round-robin, so global batch i is
    the permutation's rows ``[i * GLOBAL_BATCH, (i + 1) * GLOBAL_BATCH)``: one device reads
    the same rows through the same sampler with one replica."""
    dataset = TensorDataset(tokens(GLOBAL_BATCH * STEPS))
    if workers > 1:
        return DataLoader(dataset, batch_size=GLOBAL_BATCH // workers, shuffle=False)
    return DataLoader(dataset, batch_size=GLOBAL_BATCH,
                      sampler=DistributedSampler(dataset, num_replicas=1, rank=0, seed=0))


def _fit(world: int, strategy: Any, tmp: str, ckpt_path: str | None = None,
         deferred: bool = False, shares: int | None = None, **options: Any
         ) -> tuple[dict, Any]:
    """One fit (``options``: Trainer options over ``max_steps=STEPS``; ``deferred``: the model
    built without weights, ``trainer.init_module()``): the final state, the shapes of two
    sharded weights held during the fit, and the device mesh's shape and names. ``shares``:
    how many shares the sampler deals (default: one per worker of T ranks)."""
    fit = trainer(world, strategy, tmp, use_distributed_sampler=world > 1,
                  **{"max_steps": STEPS, "gradient_clip_val": CLIP, **options})
    if deferred:
        with fit.init_module():
            model = LitGPT(shardable=True)
    else:
        model = make_lit_gpt(shardable=True)
    shapes: dict[str, tuple[int, ...]] = {}

    class Shapes(Callback):
        def on_train_batch_end(self, *args: Any) -> None:  # during the fit: the shards held
            shapes.update({n: tuple(p.shape) for n, p in model.named_parameters()
                           if ("attn.q" in n or "mlp.2.weight" in n) and p.numel()})

    fit.callbacks.append(Shapes())
    if shares is None:
        shares = world // T if world > 1 else 1
    fit.fit(model, _loader(shares), ckpt_path=ckpt_path)
    mesh = fit.strategy.device_mesh if world > 1 else None
    ratios = _memory_ratios(fit.strategy)
    state = _kept(model) if deferred else state_of(model)
    # the model after the run, in a plain forward of its own: whole again, no sharded layer's
    # hooks left (they would turn its inputs into DTensors)
    with torch.no_grad():
        after = None if deferred else model(tokens(2, seed=9))
    return state, (shapes, None if mesh is None else (
        tuple(mesh.shape), mesh.mesh_dim_names), ratios, after)


def _memory_ratios(strategy: Any) -> list[float]:
    """Per rank: the bytes the runtime accounted in the measured step over the start-up
    prediction (the strategy's memory report); empty without one."""
    report = getattr(strategy, "memory_report", None)
    if report is None or report.predicted is None or report.measured is None:
        return []
    return [got.get("total", 0) / want.peak
            for want, got in zip(report.predicted, report.measured, strict=True)]


def _kept(model: Any) -> dict[str, torch.Tensor]:
    """A model built without weights after its fit: the parameters this rank kept (its
    worker's; the shards' pieces stay pieces), by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()
            if not p.is_meta and p.numel() > 0}


def assert_pieces_of(kept: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rank: int,
                     label: str) -> int:
    """Each kept tensor equals one device's (``want``), a shard its piece at this rank's
    tensor-parallel index; returns how many were shards."""
    assert kept and len(kept) < len(want), (label, rank, sorted(kept))  # its worker's only
    sharded = 0
    for name, got in kept.items():
        full = want[name]
        dims = [d for d in range(full.dim()) if got.shape[d] != full.shape[d]]
        if dims:  # a shard: the piece at this rank's tensor-parallel index
            full = full.chunk(T, dim=dims[0])[rank % T]
            sharded += 1
        assert_same_state({name: got}, {name: full}, f"{label}, rank {rank}")
    return sharded


def fits_on_worker(ctx: WorkerContext, tmp: str) -> list[tuple[dict, Any]]:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    out = []
    for schedule in SCHEDULES:
        strategy = GeneralParallel(schedule, microbatches=4, tensor_parallel_size=T,
                                   tensor_parallel_plan=PLAN)
        out.append(_fit(ctx.world_size, strategy, f"{tmp}/{schedule}"))
    # "auto" on the W / T = 2 workers, its profiles measured on sharded stages by ranks 0, 1
    auto = GeneralParallel("auto", tensor_parallel_size=T, tensor_parallel_plan=PLAN)
    out.append(_fit(ctx.world_size, auto, f"{tmp}/auto"))
    return out


@functools.lru_cache(maxsize=None)
def reference() -> tuple[dict, list, dict, torch.Tensor]:
    tmp = tempfile.mkdtemp()
    state, (shapes, _, _, after) = _fit(1, "auto", tmp)
    return state, csv_metric(tmp, "train_loss"), shapes, after


def test_pipeline_of_tensor_parallel_workers_fits_like_one_device(worlds: Any,
                                                                   tmp_path: Any) -> None:
    want, want_log, full_shapes, want_after = reference()
    results = worlds.get(4).run(fits_on_worker, str(tmp_path))
    for rank, per_schedule in enumerate(results):
        state, (_, mesh, _, _) = per_schedule.pop()  # "auto": its pick's G is its own
        assert_same_state(state, want, f"auto, rank {rank}")
        assert mesh[0][2] == T and mesh[1][2] == "tensor_parallel", (rank, mesh)
        for schedule, (state, (shapes, mesh, ratios, after)) in zip(SCHEDULES, per_schedule,
                                                                     strict=True):
            label = f"{schedule}, rank {rank}"
            # the bytes model, from the sharded stages, against the runtime's own accounting
            # of what each rank held (the memory report's measured step): every rank
            assert len(ratios) == 4 and all(0.85 <= r <= 1.25 for r in ratios), (label, ratios)
            assert_same_state(state, want, label)
            torch.testing.assert_close(after, want_after, rtol=1e-5, atol=1e-5, msg=label)
            assert mesh == ((2, 1, 2), ("pipeline", "data_parallel", "tensor_parallel")), label
            assert shapes, label  # each worker holds some sharded layer
            for name, shape in shapes.items():  # column-wise: rows halved; row-wise: columns
                full = full_shapes[name]
                halved = 0 if "attn.q" in name else 1
                assert shape[halved] == full[halved] // T, (label, name, shape, full)
    for schedule in [*SCHEDULES, "auto"]:
        got = csv_metric(str(tmp_path / schedule), "train_loss")
        assert [s for s, _ in got] == [s for s, _ in want_log], schedule
        torch.testing.assert_close(torch.tensor([v for _, v in got]),
                                   torch.tensor([v for _, v in want_log]), rtol=1e-5, atol=1e-6)


def save_and_resume_on_worker(ctx: WorkerContext, tmp: str, kind: str) -> list[dict]:
    """Epoch 1 under 1f1b with ModelCheckpoint saving after every step while the pipeline runs
    (``kind`` "full": the shards gathered into full tensors in one file; "sharded": every rank
    writes its own pieces into one directory), then epoch 2 resumed from it under zbv, whose
    stages shard differently, twice: into a model with weights (Lightning restores the file
    before the build; the full optimizer state is cut to each rank's shard when the stages are
    sharded), and into one built without weights (each rank reads only its pieces at the
    build: a directory through DTensor views, a file mapped and cut)."""
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)

    def strategy(schedule: str) -> Any:
        return GeneralParallel(schedule, microbatches=4, tensor_parallel_size=T,
                               tensor_parallel_plan=PLAN, state_dict_type=kind)

    # a save after every step, so that training goes on after each (a save must leave the
    # optimizer's own state as it was: a sharded save once swapped DTensor views into it)
    saver = ModelCheckpoint(dirpath=f"{tmp}/ckpt", save_last=True, save_top_k=0,
                            every_n_train_steps=1)
    _fit(ctx.world_size, strategy("1f1b"), f"{tmp}/first", max_steps=-1, max_epochs=1,
         enable_checkpointing=True, callbacks=[saver])
    return [_fit(ctx.world_size, strategy("zbv"), f"{tmp}/{name}", max_steps=-1,
                 max_epochs=2, ckpt_path=f"{tmp}/ckpt/last.ckpt", deferred=deferred)[0]
            for name, deferred in (("resumed", False), ("resumed_deferred", True))]


@functools.lru_cache(maxsize=None)
def two_epochs() -> dict:
    return _fit(1, "auto", tempfile.mkdtemp(), max_steps=-1, max_epochs=2)[0]


def searched_on_worker(ctx: WorkerContext, tmp: str) -> list[tuple[int, str, dict, dict]]:
    """``"auto"`` searching T over [1, 2]: every rank loads its own rows (a quarter of the
    global batch), whatever T runs. First as a user runs it (the tuner's pick), then with the
    other T forced (the choice over T patched to take it), so that both data paths run: four
    workers of one rank, and two workers whose batch is their two ranks' rows joined."""
    from lightning_gsched import GeneralParallel
    from lightning_gsched.engine import auto

    as_worker(ctx.rank)
    out: list[tuple[int, str, dict, dict]] = []
    choose = auto.best_over_sizes
    for forced in (None, "the other"):
        if forced is not None:
            other = 3 - out[0][0]  # the T the tuner did not pick

            def only(outcomes: Any, other: int = other) -> Any:
                return choose({other: outcomes[other]})

            auto.best_over_sizes = only
        # S and B fixed: the search over T is what is checked, and each T tunes fewer cuts
        strategy = GeneralParallel("auto", stages=2, microbatches=4, tensor_parallel_size=[1, T],
                                   tensor_parallel_plan=PLAN)
        try:
            state, _ = _fit(ctx.world_size, strategy, f"{tmp}/searched{len(out)}",
                            shares=ctx.world_size)
        finally:
            auto.best_over_sizes = choose
        config = strategy.schedule_config
        out.append((config.tensor_parallel_size, config.choice_text, state,
                    strategy.distributed_sampler_kwargs))
    return out


def test_auto_searches_the_tensor_parallel_size(worlds: Any, tmp_path: Any) -> None:
    want, want_log, _, _ = reference()
    results = worlds.get(4).run(searched_on_worker, str(tmp_path))
    for rank, runs in enumerate(results):
        assert sorted(run[0] for run in runs) == [1, T], (rank, [run[0] for run in runs])
        for picked, _, state, sampler in runs:
            label = f"searched, T={picked}, rank {rank}"
            assert sampler == {"num_replicas": 4, "rank": rank}, label  # per rank, any T
            assert_same_state(state, want, label)
        if rank == 0:  # the tuner's own pick names what each T gave
            assert "searched tensor_parallel_size over [1, 2]" in runs[0][1], runs[0][1]
    for run in range(2):
        got = csv_metric(str(tmp_path / f"searched{run}"), "train_loss")
        torch.testing.assert_close(torch.tensor([v for _, v in got]),
                                   torch.tensor([v for _, v in want_log]), rtol=1e-5, atol=1e-6)


def refusals_on_worker(ctx: WorkerContext) -> tuple[str, str]:
    """Two fits refused at the first batch: the GPT with each block compiled, and the plain GPT
    whose plan styles the final norm, which the network holds, with a sequence-sharded
    output (torchtitan's plan does): their errors."""
    from lightning_gsched import GeneralParallel
    from lightning_gsched.errors import StrategyConfigError
    from lightning_gsched.partition.tensor_parallel import TensorParallelPlanError

    as_worker(ctx.rank)
    messages = []
    for plan, backend in ((PLAN, "aot_eager"), ({**PLAN, "model.ln_f": "sequence"}, None)):
        fit = trainer(ctx.world_size, GeneralParallel("1f1b", tensor_parallel_size=T,
                                                      tensor_parallel_plan=plan), max_steps=1)
        model = make_lit_gpt(shardable=True, compile_backend=backend)
        try:
            fit.fit(model, _loader(ctx.world_size // T))
            messages.append("trained")
        except (StrategyConfigError, TensorParallelPlanError) as exc:
            messages.append(str(exc))
    return messages[0], messages[1]


def test_compiled_modules_and_a_network_kept_whole_are_refused_naming_them(worlds: Any
                                                                          ) -> None:
    """The stages are sharded after the split; torch.compile'd blocks (their names under
    '_orig_mod', which the plan's patterns do not match) are refused at the first batch on
    every rank, before any collective of the build, naming them. A style with a sharded
    output on a module the network holds (its final norm) keeps the network whole, one unit
    for two stages: refused naming the holder, the module and the styles that fit (it said
    to remove modules from leaf_modules, which the user never gave)."""
    for compiled, whole in worlds.get(4).run(refusals_on_worker):
        assert compiled.startswith(f"tensor_parallel_size={T} shards each stage's modules"), \
            compiled
        assert "(model.blocks.0, model.blocks.1, model.blocks.2)" in compiled
        assert "'model' (for 'model.ln_f')" in whole, whole
        assert "'sequence_input' on the first block" in whole, whole


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_a_checkpoint_holds_full_tensors_and_resumes_into_other_shards(worlds: Any,
                                                                       tmp_path: Any,
                                                                       kind: str) -> None:
    from lightning_gsched.engine.checkpoint_sharded import load

    after_epoch = reference()[0]  # one epoch is STEPS batches
    states = worlds.get(4).run(save_and_resume_on_worker, str(tmp_path), kind)
    path = tmp_path / "ckpt" / "last.ckpt"
    # read here, in one process: a sharded directory's pieces come back as full tensors
    saved = torch.load(path, weights_only=False) if kind == "full" else load(path)
    assert_same_state(saved["state_dict"], after_epoch, "the checkpoint's weights")
    momentum = saved["optimizer_states"][0]["state"]
    assert [tuple(e["momentum_buffer"].shape) for e in momentum.values()] == [
        tuple(v.shape) for v in make_lit_gpt(shardable=True).parameters()], "full-shaped state"
    want = two_epochs()
    for rank, (eager, deferred) in enumerate(states):
        assert_same_state(eager, want, f"resumed, rank {rank}")
        assert_pieces_of(deferred, want, rank, "resumed into a model built without weights")


def deferred_on_worker(ctx: WorkerContext, init_weights: str | None = None,
                       folder: str | None = None
                       ) -> tuple[dict[str, torch.Tensor], list[float], Any]:
    """A model built without weights (``trainer.init_module()``): the stages are sharded on
    the meta device, then each rank draws its worker's parameters from the agreed seed (or
    reads its regions of them from ``init_weights``) and keeps its pieces. Returns them and the
    memory ratios (measured / predicted per rank; the prediction sized the sharded stages on
    meta tensors). ``folder``: ModelCheckpoint saves there at the fit's end, while the pipeline
    runs (``stream_checkpoint="auto"``: streamed, the model never whole on one rank); rank 0
    also returns what the streamed save held."""
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    torch.manual_seed(DEFERRED_SEED)
    strategy = GeneralParallel("1f1b", microbatches=4, tensor_parallel_size=T,
                               tensor_parallel_plan=PLAN, init_weights=init_weights)
    saving = {} if folder is None else dict(enable_checkpointing=True, callbacks=[
        ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0)])
    fit = trainer(ctx.world_size, strategy, max_steps=STEPS, gradient_clip_val=CLIP,
                  use_distributed_sampler=True, **saving)
    with fit.init_module():
        model = LitGPT(shardable=True)
    assert all(p.is_meta for p in model.parameters())
    fit.fit(model, _loader(ctx.world_size // T))
    return _kept(model), _memory_ratios(fit.strategy), fit.strategy.checkpoint_stream_stats


@pytest.mark.parametrize("pretrained", [False, True], ids=["drawn", "read"])
def test_a_model_built_without_weights_trains_like_one_device(worlds: Any, tmp_path: Any,
                                                              pretrained: bool) -> None:
    """Each rank keeps its worker's parameters only, sharded: every kept tensor equals its
    piece of one device's (``initialize`` from the same seed, or the same safetensors file
    read by ``init_weights``, then the same fit)."""
    from safetensors.torch import save_file

    from lightning_gsched.runtime.materialize import deferred_parameters, initialize

    init_weights = None
    if pretrained:  # other weights than the seed's: a one-device model of another seed
        init_weights = str(tmp_path / "model.safetensors")
        saved = seeded(7, lambda: LitGPT(shardable=True)).state_dict()
        save_file({k: v.contiguous() for k, v in saved.items()}, init_weights)
        model = LitGPT(shardable=True)
        model.load_state_dict(saved)
    else:
        with deferred_parameters():
            model = LitGPT(shardable=True)
        initialize(model, DEFERRED_SEED)
    fit = trainer(1, "auto", max_steps=STEPS, gradient_clip_val=CLIP)
    fit.fit(model, _loader(1))
    want = {n: p.detach() for n, p in model.named_parameters()}
    folder = None if pretrained else str(tmp_path / "ckpt")
    results = worlds.get(4).run(deferred_on_worker, init_weights, folder)
    assert sum(assert_pieces_of(kept, want, rank, "deferred")
               for rank, (kept, _, _) in enumerate(results)) > 0
    for rank, (_, ratios, _) in enumerate(results):  # as in the fits with weights
        assert len(ratios) == 4 and all(0.85 <= r <= 1.25 for r in ratios), (rank, ratios)
    if folder is not None:  # the streamed checkpoint: one device's full tensors
        saved = torch.load(f"{folder}/last.ckpt", weights_only=False)["state_dict"]
        assert_same_state({n: saved[n] for n in want}, want,
                          "the streamed checkpoint of a model built without weights")
        stats = results[0][2]  # rank 0 held one unit's full tensors at a time, not the model
        assert stats is not None and stats.records >= len(want), "rank 0 streamed the save"
        assert 0 < stats.peak_bytes < sum(p.numel() * p.element_size() for p in want.values())


class ModelParallelGPT(LitGPT):
    """The same module for Lightning's ModelParallelStrategy: the user shards it in
    ``configure_model`` over ``self.device_mesh["tensor_parallel"]`` (torch's own styles, the
    plan above without the ``model.`` prefix: ``parallelize_module`` is applied to ``self.model``)."""

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        from lightning_gsched.partition.tensor_parallel import style_of

        plan = {k.removeprefix("model."): style_of(v, k) for k, v in PLAN.items()}
        parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)


def against_model_parallel_on_worker(ctx: WorkerContext, tmp: str) -> tuple[dict, dict]:
    """W=2 as one worker of T=2 (P=1): GeneralParallel, then ModelParallelStrategy
    (data_parallel_size=1, tensor_parallel_size=2) with the same plan, same data."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    # no clipping here: Lightning's clip_grad_norm_ under ModelParallelStrategy fails on a
    # model mixing DTensor and plain parameters ("got mixed torch.Tensor and DTensor")
    ours, _ = _fit(ctx.world_size, GeneralParallel("gpipe", tensor_parallel_size=T,
                                                   tensor_parallel_plan=PLAN), f"{tmp}/ours",
                   gradient_clip_val=None)
    model = seeded(0, lambda: ModelParallelGPT(shardable=True))
    fit = trainer(ctx.world_size, ModelParallelStrategy(data_parallel_size=1,
                                                        tensor_parallel_size=T),
                  max_steps=STEPS, use_distributed_sampler=True)
    fit.fit(model, _loader(1))  # one data-parallel share: both ranks read the whole batch
    theirs = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
              for k, v in model.state_dict().items()}
    return ours, theirs


@functools.lru_cache(maxsize=None)
def unclipped() -> dict:
    return _fit(1, "auto", tempfile.mkdtemp(), gradient_clip_val=None)[0]


def test_same_weights_as_lightning_model_parallel_with_the_same_plan(worlds: Any,
                                                                    tmp_path: Any) -> None:
    want = unclipped()
    for rank, (ours, theirs) in enumerate(worlds.get(2).run(against_model_parallel_on_worker,
                                                            str(tmp_path))):
        assert_same_state(theirs, want, f"ModelParallelStrategy, rank {rank}")  # the premise
        assert_same_state(ours, theirs, f"GeneralParallel against it, rank {rank}")
