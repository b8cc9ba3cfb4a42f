"""GeneralParallelFabric with tensor-parallel workers trains like a single-device Fabric loop.

W = 4 ranks as P = 2 pipeline workers x T = 2 tensor-parallel ranks (rank ``w * 2 + t``), the
GPT's q, k, v and first MLP layer sharded column-wise and the projections after them row-wise
(``tensor_parallel_plan`` on the model's own module names). A worker's two ranks are given the
same share of each global batch, as the strategy's ``distributed_sampler_kwargs`` would deal
it. Per schedule (gpipe, 1f1b, zb-h1, zbv), in one launched job, against the same loop on one
device in this process:

* every step's returned loss and the weights after 3 steps (clipped by the global norm: each
  shard counted on its rank, each replicated weight once) (``strategy.finish`` gathers the
  shards back, so every rank holds the full model) equal one device's;
* ``strategy.evaluate`` returns this rank's rows of one device's outputs for the same weights,
  on every rank, the two ranks of a worker alike;
* while training, each rank held its shard of a column-wise layer (half its rows);
* ``fabric.save`` after step 2 of the 1f1b run (``stream_checkpoint=True``: each weight unit's
  and optimizer tensor's full tensor made by its worker's two ranks and sent to rank 0 one at a
  time), ``fabric.load`` into a zbv pipeline that already ran a step of its own (each rank takes
  its pieces), then step 3: every rank ends with one device's weights and step-3 loss;
* gpipe's save after step 2 is a sharded directory (``state_dict_type="sharded"``: every
  rank writes its pieces, four files); ``fabric.load`` of it into a fresh 1f1b pipeline, then
  step 3, ends with one device's weights and step-3 loss on every rank;
* after 1f1b's last step the same state saved streamed and gathered (every shard gathered to
  rank 0 at once) gives two files with equal tensors, bit for bit, of the full shapes;
* sequence parallelism (the styles by name, :func:`sequence_plan`: the norms sharded by
  sequence, the attention gathering its input once and the MLP's first layer its own, the
  projections after them giving the split layout back, the first block's input cut and the
  last block's output joined, each block kept whole in the split by ``leaf_modules`` so that
  its input and output hooks run) trains 1f1b like one device too.
* with dropout before the column-wise layers and every rank seeded apart, a worker's two
  ranks draw the same masks (the engine aligns their generators): their whole parameters stay
  bit-equal through three 1f1b steps (without it the build's gradient check refuses the run).

At W = 2 as one worker of T = 2 ranks (P = 1), a streamed save after step 1 and a gathered
one after step 2 leave the optimizer's own state as it was: steps 2 and 3 after them, and the
gathered file resumed under gpipe, end at one device's weights.

Tolerance (rtol 1e-5, atol 1e-6) for ``assert_same_state``'s reason: a row-wise layer adds two
partial dot products where one device adds one, float32 reordering as microbatches and ranks
already cause; SGD with momentum is linear in the gradient. A wrong shard or a missing
all-reduce moves weights by ~1e-3.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from dist_harness import WorkerContext
from lightning_models import as_worker, assert_same_state, state_of
from models import make_gpt
from test_fabric import (
    LR,
    SAVED_AT,
    global_batches,
    last_logits,
    share,
    single_device,
    train,  # the user's loop, clipping by the global norm at 0.5 (the norms are ~8: it binds)
)

pytestmark = pytest.mark.distributed

T = 2
SHARDED = "gpipe"  # the schedule whose save is a sharded directory (state_dict_type="sharded")
SCHEDULES = ["gpipe", "1f1b", "zb-h1", "zbv"]
PLAN = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise",
        "blocks.*.attn.v": "colwise", "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}
WORLD_TIMEOUT = 300.0


def sequence_plan() -> dict[str, Any]:
    """Megatron-style sequence parallelism on the test GPT, by the names a YAML config writes:
    between blocks the residual stream is split along the sequence (each rank its half, sent
    stage to stage as such); the norms run on their half (``"sequence"``); the attention
    gathers its input once (``"sequence_gather"``) for its plain column-wise q, k, v, the MLP's
    first layer gathers its own (``"colwise_from_sequence"``), and the projections before the
    residual adds scatter it again (``"rowwise_to_sequence"``); the first block's first input
    is cut to this rank's half (``"sequence_input"``: the block is called with the mask too)
    and the last block's output joined whole for the final norm and the head
    (``"sequence_output"``)."""
    scatter = "rowwise_to_sequence"
    return {"blocks.0": "sequence_input",
            "blocks.*.ln1": "sequence", "blocks.*.ln2": "sequence",
            "blocks.*.attn": "sequence_gather", "blocks.*.attn.q": "colwise",
            "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
            "blocks.*.attn.proj": scatter, "blocks.*.mlp.0": "colwise_from_sequence",
            "blocks.*.mlp.2": scatter, "blocks.2": "sequence_output"}


def _setup(fabric: Any) -> tuple[Any, Any]:
    model = make_gpt(0, shardable=True)
    return fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))


@functools.lru_cache(maxsize=None)
def reference() -> dict[str, Any]:
    fabric = single_device()
    model, optimizer = _setup(fabric)
    losses = train(fabric, model, optimizer, global_batches(), pipelined=False)
    with torch.no_grad():
        logits = last_logits(model, global_batches()[0])
    return {"losses": losses, "weights": state_of(model), "logits": logits}


def outputs_of(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """One device's ``last_logits`` of the first global batch with ``weights``."""
    model = make_gpt(0, shardable=True)
    model.load_state_dict(weights)
    with torch.no_grad():
        return last_logits(model, global_batches()[0])


def _pipelined(ctx: WorkerContext, schedule: str, plan: Any = None,
               **options: Any) -> tuple[Any, Any, Any, list[torch.Tensor]]:
    """This rank's Fabric running ``schedule`` on workers of T ranks (``plan``: the tensor-
    parallel plan, :data:`PLAN` by default; ``options``: more strategy arguments), the test GPT
    and its optimizer set up on it, and this worker's share of every global batch (a worker's
    ranks read the same rows)."""
    from lightning.fabric import Fabric

    from lightning_gsched.fabric import GeneralParallelFabric

    fabric = Fabric(accelerator="cpu", devices=ctx.world_size, strategy=GeneralParallelFabric(
        schedule, microbatches=4, tensor_parallel_size=T,
        tensor_parallel_plan=PLAN if plan is None else plan, **options))
    fabric.launch()
    model, optimizer = _setup(fabric)
    batches = [share(b, ctx.rank // T, ctx.world_size // T) for b in global_batches()]
    return fabric, model, optimizer, batches


def run_schedules(ctx: WorkerContext, folder: str,
                  ) -> tuple[list[dict[str, Any]], dict, dict, dict]:
    as_worker(ctx.rank)
    out = []
    for schedule in SCHEDULES:
        sharded = schedule == SHARDED  # its save a directory: each rank writes its pieces
        fabric, model, optimizer, batches = _pipelined(
            ctx, schedule, stream_checkpoint=schedule == "1f1b",
            state_dict_type="sharded" if sharded else "full")
        # a save while the pipeline runs: shards made whole, or each rank's pieces
        saved = f"{folder}/{schedule}" + ("" if sharded else ".ckpt")
        losses = train(fabric, model, optimizer, batches, pipelined=True, save_at=SAVED_AT,
                       path=saved)
        if schedule == "1f1b":  # the same state both ways
            for how, streamed in (("streamed", True), ("gathered", "auto")):
                fabric.strategy.stream_checkpoint = streamed
                fabric.save(f"{folder}/{how}.ckpt", {"model": model, "optimizer": optimizer})
        held = {n: tuple(p.shape) for n, p in model.named_parameters()
                if n.endswith("attn.q.weight") and p.numel()}
        logits = fabric.strategy.evaluate(model, batches[0], last_logits)
        fabric.strategy.finish()
        out.append({"losses": losses, "weights": state_of(model), "logits": logits,
                    "held": held, "sampler": fabric.strategy.distributed_sampler_kwargs})
    # no leaf_modules: the engine keeps the styled blocks (and the norms' holders) whole
    fabric, model, optimizer, batches = _pipelined(ctx, "1f1b", sequence_plan())
    sequence = {"losses": train(fabric, model, optimizer, batches, pipelined=True)}
    fabric.strategy.finish()
    sequence["weights"] = state_of(model)
    # 1f1b's checkpoint loaded into a running zbv pipeline (each rank takes its pieces of the
    # full tensors, model and optimizer state), then the remaining steps; traced with the
    # example's sizes fixed, as transformers' models are: the attention, which reads its head
    # count from a shape, runs whole (kept_whole), so its shard's count is read
    fabric, model, optimizer, batches = _pipelined(ctx, "zbv", static_shapes=True)
    train(fabric, model, optimizer, batches[:1], pipelined=True)  # builds the pipeline
    fabric.load(f"{folder}/1f1b.ckpt", {"model": model, "optimizer": optimizer})
    losses = train(fabric, model, optimizer, batches[SAVED_AT:], pipelined=True)
    fabric.strategy.finish()
    resumed = {"losses": losses, "weights": state_of(model)}
    # the sharded directory loaded into a fresh 1f1b pipeline (every rank reads it whole and
    # takes its pieces at the build), then the remaining steps
    fabric, model, optimizer, batches = _pipelined(ctx, "1f1b")
    fabric.load(f"{folder}/{SHARDED}", {"model": model, "optimizer": optimizer})
    losses = train(fabric, model, optimizer, batches[SAVED_AT:], pipelined=True)
    fabric.strategy.finish()
    from_directory = {"losses": losses, "weights": state_of(model)}
    return out, resumed, sequence, dropout_run(ctx), from_directory


def dropout_run(ctx: WorkerContext) -> dict[str, Any]:
    """1f1b with dropout on the whole embeddings' sum (before the column-wise q, k, v), each
    rank seeded apart as a user seeding replicas apart would: the engine aligns a worker's
    generators (runtime/aligned_rng.py), so its ranks draw the same masks and their copies of
    every whole parameter stay equal. Returns the losses and the whole parameters this rank
    held before ``finish`` gathers the model (after it every rank holds the same)."""
    from lightning.fabric import Fabric

    from lightning_gsched.fabric import GeneralParallelFabric

    fabric = Fabric(accelerator="cpu", devices=ctx.world_size, strategy=GeneralParallelFabric(
        "1f1b", microbatches=4, tensor_parallel_size=T, tensor_parallel_plan=PLAN))
    fabric.launch()
    model = make_gpt(0, shardable=True, dropout=0.2)
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    torch.manual_seed(100 + ctx.rank)  # every rank apart, before the build
    batches = [share(b, ctx.rank // T, ctx.world_size // T) for b in global_batches()]
    losses = train(fabric, model, optimizer, batches, pipelined=True)
    whole = {n: p.detach().clone() for n, p in model.module.named_parameters()
             if p.numel() and tuple(p.shape) == full[n]}
    fabric.strategy.finish()
    return {"losses": losses, "whole": whole}


def test_tensor_parallel_workers_train_like_one_device(worlds: Any, tmp_path: Any) -> None:
    want = reference()
    results = worlds.get(4).run(run_schedules, str(tmp_path))
    streamed, gathered = (torch.load(tmp_path / f"{how}.ckpt", weights_only=False)
                          for how in ("streamed", "gathered"))
    full = make_gpt(0, shardable=True).state_dict()
    assert {n: tuple(v.shape) for n, v in streamed["model"].items()} == {
        n: tuple(v.shape) for n, v in full.items()}, "the streamed file holds full tensors"
    for name, tensor in gathered["model"].items():
        assert torch.equal(streamed["model"][name], tensor), name
    params = list(make_gpt(0, shardable=True).parameters())  # the optimizer's indices
    momentum = {i: e["momentum_buffer"] for i, e in gathered["optimizer"]["state"].items()}
    assert {i: tuple(m.shape) for i, m in momentum.items()} == {
        i: tuple(p.shape) for i, p in enumerate(params)}, "full-shaped optimizer state"
    for i, m in momentum.items():
        assert torch.equal(streamed["optimizer"]["state"][i]["momentum_buffer"], m), i
    for worker in range(2):  # dropout: a worker's two ranks hold the same whole parameters
        first, second = (results[worker * T + t][3] for t in range(T))
        assert first["losses"] == second["losses"], worker
        assert first["losses"] != want["losses"], "the masks changed the losses"
        assert first["whole"] and first["whole"].keys() == second["whole"].keys(), worker
        for name, tensor in first["whole"].items():
            assert torch.equal(tensor, second["whole"][name]), (worker, name)
    pieces = sorted((tmp_path / SHARDED).glob("*.distcp"))
    assert len(pieces) == 4 and all(f.stat().st_size for f in pieces), pieces  # every rank's
    for rank, (per_schedule, resumed, sequence, _, from_directory) in enumerate(results):
        label = f"{SHARDED}'s sharded directory loaded into a fresh 1f1b pipeline, rank {rank}"
        assert_same_state(from_directory["weights"], want["weights"], label)
        torch.testing.assert_close(torch.tensor(from_directory["losses"]),
                                   torch.tensor(want["losses"][SAVED_AT:]), rtol=1e-5, atol=1e-6)
        label = f"1f1b with sequence parallelism, rank {rank}"
        assert_same_state(sequence["weights"], want["weights"], label)
        torch.testing.assert_close(torch.tensor(sequence["losses"]),
                                   torch.tensor(want["losses"]), rtol=1e-5, atol=1e-6, msg=label)
        label = f"1f1b's checkpoint loaded into a running zbv pipeline, rank {rank}"
        assert_same_state(resumed["weights"], want["weights"], label)
        torch.testing.assert_close(torch.tensor(resumed["losses"]),
                                   torch.tensor(want["losses"][SAVED_AT:]), rtol=1e-5, atol=1e-6)
        for schedule, got in zip(SCHEDULES, per_schedule, strict=True):
            label = f"{schedule} rank {rank}"
            assert got["sampler"] == {"num_replicas": 2, "rank": rank // T}, label
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                                       rtol=1e-5, atol=1e-6, msg=label)
            assert_same_state(got["weights"], want["weights"], label)
            # evaluate is the forward of the weights it ran with (those finish gathered): one
            # device's forward of them, so the training's own float noise is not compared twice
            # atol relative to the outputs' scale (up to ~27 here): reordered float32 sums err
            # relative to their summands, not to a logit that cancels to near 0 (measured 1.2e-6
            # on a logit of 0.016; 1e-6 x 27 is about 14 float32 ulps at 27); a wrong row or
            # shard is off by the outputs' scale
            full = outputs_of(got["weights"])
            mine = share(full, rank // T, 4 // T)
            torch.testing.assert_close(got["logits"], mine, rtol=1e-5,
                                       atol=1e-6 * float(full.abs().max()),
                                       msg=lambda m, label=label: f"{label}: {m}")
            assert got["held"], label  # this worker's blocks: q's rows halved
            full = want["weights"]["blocks.0.attn.q.weight"].shape[0]
            assert all(shape[0] == full // T for shape in got["held"].values()), (label, got)


def sequence_beside_whole_on_worker(ctx: WorkerContext) -> None:
    as_worker(ctx.rank)
    fabric, model, optimizer, batches = _pipelined(ctx, "1f1b",
                                                   {**PLAN, "blocks.*.ln1": "sequence"})
    train(fabric, model, optimizer, batches[:1], pipelined=True)


def test_a_plan_that_cannot_run_sharded_fails_every_rank_with_its_reason(worlds: Any) -> None:
    """A plan whose sharded stages cannot run (``"sequence"`` on a norm whose readers take
    whole activations) fails the build's check on every rank with the plan's own error, whole
    and naming the sequence-sharded pattern, not as a lost connection (the engine's bounded
    collectives pass this rank's own errors through)."""
    errors = worlds.get(4).run(sequence_beside_whole_on_worker, expect_errors=True)
    for rank, error in enumerate(errors):
        assert getattr(error, "type_name", None) == "TensorParallelPlanError", (rank, error)
        assert "'blocks.*.ln1' by sequence" in error.message, (rank, error.message)
        assert "lost the connection" not in error.message, (rank, error.message)


def aligned_draws(ctx: WorkerContext) -> list[tuple[float, float, float]]:
    """Each rank seeded apart, then its worker's generators aligned over the worker's two
    ranks (as the engine does): the next draw of torch's, Python's and numpy's generators."""
    import random

    import numpy as np
    import torch.distributed as dist

    from lightning_gsched.runtime import align_generators

    torch.manual_seed(ctx.rank)
    random.seed(ctx.rank)
    np.random.seed(ctx.rank)
    groups = [dist.new_group([w * T + t for t in range(T)]) for w in range(ctx.world_size // T)]
    align_generators(groups[ctx.rank // T], torch.device("cpu"))
    return [(torch.rand(()).item(), random.random(), float(np.random.random()))]


def test_aligned_generators_include_python_and_numpy(worlds: Any) -> None:
    """A layer drop drawn with ``random.random()`` in a module kept whole (tests/
    test_partition_trace_effects.py) must be decided alike by a worker's ranks, or they run
    different collectives; workers keep streams of their own."""
    draws = [r[0] for r in worlds.get(4).run(aligned_draws)]
    for worker in range(2):
        assert draws[worker * T] == draws[worker * T + 1], (worker, draws)
    assert all(a != b for a, b in zip(draws[0], draws[T], strict=True)), draws


def one_worker_saves_and_trains_on(ctx: WorkerContext, folder: str) -> dict[str, Any]:
    """W = 2 as one pipeline worker of T = 2 ranks (P = 1): a full checkpoint streamed after
    step 1 and one gathered after step 2 (the shards made whole on their way to rank 0), then
    step 3; then the gathered file loaded into a fresh run, which takes step 3 again."""
    as_worker(ctx.rank)
    fabric, model, optimizer, batches = _pipelined(ctx, "1f1b")
    path = f"{folder}/one_worker.ckpt"
    losses = train(fabric, model, optimizer, batches[:1], pipelined=True)
    fabric.strategy.stream_checkpoint = True
    fabric.save(f"{folder}/one_worker_streamed.ckpt", {"model": model, "optimizer": optimizer})
    fabric.strategy.stream_checkpoint = "auto"
    losses += train(fabric, model, optimizer, batches[1:], pipelined=True,
                    save_at=SAVED_AT - 1, path=path)
    fabric.strategy.finish()
    trained = {"losses": losses, "weights": state_of(model)}
    fabric, model, optimizer, batches = _pipelined(ctx, "gpipe")
    fabric.load(path, {"model": model, "optimizer": optimizer})
    losses = train(fabric, model, optimizer, batches[SAVED_AT:], pipelined=True)
    fabric.strategy.finish()
    return {"trained": trained, "resumed": {"losses": losses, "weights": state_of(model)}}


def test_one_tensor_parallel_worker_saves_and_trains_on(worlds: Any, tmp_path: Any) -> None:
    """P = 1: the only worker's saves must leave its optimizer's own state as it was (a
    gathered save once wrote the whole tensors into it when there was no other worker to
    gather from, and the next step failed); training on and resuming both end at one
    device's weights."""
    want = reference()
    for rank, got in enumerate(worlds.get(2).run(one_worker_saves_and_trains_on,
                                                 str(tmp_path))):
        for what, steps in (("trained", slice(None)), ("resumed", slice(SAVED_AT, None))):
            label = f"one worker, {what}, rank {rank}"
            assert_same_state(got[what]["weights"], want["weights"], label)
            torch.testing.assert_close(torch.tensor(got[what]["losses"]),
                                       torch.tensor(want["losses"][steps]), rtol=1e-5,
                                       atol=1e-6, msg=label)
