"""Activation checkpointing in the runtime (``ProgramExecutor(..., checkpointed=...)``), W=2.

* Dropout: a pipeline step with checkpointing equals the same pipeline step without it bit for
  bit (``torch.equal``: losses, every owned gradient, and the random stream after the step),
  for an ordinary (1f1b) and a split-backward (zbv: two stages per worker, the last one on
  rank 0) schedule, with every stage and with one stage checkpointed. Exact, not close: the
  replay runs the same kernels on the same values with the generators where the first forward
  had them, and the backward that follows is the ordinary one. Seeding the step differently
  changes the losses, so the masks really matter.
* Every library schedule with checkpointing on (and per-stage lists) trains like one device:
  two SGD steps of the GPT (tied weights) against the single-process reference of
  test_runtime_schedules (same model, batches and tolerance: rtol 1e-5, atol 1e-6, float32
  reordering of the microbatch sums), and the counters still equal the planner's metrics.
* The loss code may read a parameter of the last stage: it keeps that term's gradient (equal
  within float32 rounding: the two terms accumulate one after the other).
* Activations are really not kept: the bytes a forward saves for its backward
  (``saved_tensors_hooks``) are 0 for a checkpointed stage that is not the last, and only the
  loss's own for the last; the stash holds no outputs.
* BatchNorm: the recompute runs the norm layers a second time, yet every rank's running
  statistics after each step are one device's (test_runtime_batchnorm's reference).
* A stage that modifies its input in place is refused with an error naming the stage.
* Each stage draws its own dropout masks: two identical blocks in two stages on ranks seeded
  alike get different masks, the same again with the same seed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import models
from dist_harness import WorkerContext
from lightning_gsched.errors import RuntimeConfigError, RuntimeFault
from lightning_gsched.partition import partition
from lightning_gsched.runtime import ProgramExecutor
from lightning_gsched.runtime.channels import Channels
from lightning_gsched.schedule import Programs, plan
from lightning_gsched.schedule.library import LIBRARY
from test_runtime_batchnorm import compare, statistics, train_batch
from test_runtime_batchnorm import reference as batchnorm_reference
from test_runtime_schedules import (
    build,
    calls,
    global_batch,
    make_loss,
    sgd_steps_against_reference,
)
from tie_helpers import held_parameters, with_ties

pytestmark = pytest.mark.distributed

W = 2
RTOL, ATOL = 1e-5, 1e-6  # as test_runtime_schedules: float32 reordering of microbatch sums
SCHEDULES = list(LIBRARY)
PER_STAGE = [("1f1b", [False, True]), ("zbv", [True, False, False, True]),
             ("fslpp", [True, False])]


# --------------------------------------------------------------------------- worker side

_CHANNELS: dict[int, Channels] = {}


def shared_channels(world: int) -> Channels:
    """One set of process groups for every executor of this module (building groups per
    executor costs more than a step); the replica subgroups are those of every plan here."""
    if world not in _CHANNELS:
        groups = sorted({o for s in SCHEDULES for o in train_plan(s, world).programs.owners
                         if len(o) > 1})
        _CHANNELS[world] = Channels(Programs([[] for _ in range(world)], len(groups), 0, groups,
                                             []), timeout=60)
    return _CHANNELS[world]


def train_plan(schedule: str, world: int, checkpoint: Any = False) -> Any:
    stages = 2 if schedule == "ddp" else None  # ddp: replicate a 2-stage model
    return plan(schedule, workers=world, stages=stages, checkpoint_activations=checkpoint)


def owned_grads(ex: ProgramExecutor, model: nn.Module) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    owned = held_parameters(ex)
    return {names[id(p)]: p.grad.clone() for p in owned if p.grad is not None}


def dropout_run(ctx: WorkerContext, schedule: str, checkpoint: Any, seed: int) -> dict[str, Any]:
    """One step of the dropout MLP; the losses, owned gradients and the stream afterwards."""
    p = plan(schedule, workers=ctx.world_size, checkpoint_activations=checkpoint)
    model = models.make_dropout_mlp()
    inputs = models.seeded(7, lambda: {b: torch.randn(4, 16) for b in range(p.micro)})
    targets = models.seeded(8, lambda: {b: torch.randn(4, 8) for b in range(p.micro)})
    part = partition(model, p.stages, example_args=(inputs[0],))
    ex = ProgramExecutor(part.stages, p.programs, channels=shared_channels(ctx.world_size),
                         checkpointed=p.checkpointed)
    torch.manual_seed(seed + ctx.rank)
    result = ex.step({b: ((x,), {}) for b, x in inputs.items()},
                     lambda out, b: F.mse_loss(out, targets[b]))
    return {"losses": result.losses, "grads": owned_grads(ex, model), "after": torch.rand(8),
            "checkpointed": p.checkpointed}


def stage_masks_run(ctx: WorkerContext, seed: int) -> list[torch.Tensor]:
    """The dropout masks this rank's stage drew in one 1f1b step and one forward-only run in
    train mode, in microbatch order: two
    identical blocks (Linear, Dropout), one per stage, so equal generators would give both
    stages the same mask for each microbatch."""
    p = plan("1f1b", workers=ctx.world_size)
    model = models.seeded(0, lambda: nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5),
                                                   nn.Linear(16, 16), nn.Dropout(0.5)))
    inputs = models.seeded(7, lambda: {b: torch.randn(4, 16) for b in range(p.micro)})
    part = partition(model, 2, example_args=(inputs[0],), split_points=["2"])
    masks: list[torch.Tensor] = []
    for stage in part.stages:
        for module in stage.modules():
            if isinstance(module, nn.Dropout):
                module.register_forward_hook(lambda m, i, out: masks.append(out == 0))
    ex = ProgramExecutor(part.stages, p.programs, channels=shared_channels(ctx.world_size))
    torch.manual_seed(seed)  # every rank alike, as seed_everything does
    ex.step({b: ((x,), {}) for b, x in inputs.items()}, lambda out, b: out.square().mean())
    # a forward-only run in train mode (Monte Carlo dropout in a prediction) draws per stage too
    ex.forward(plan("1f1b", workers=ctx.world_size, forward_only=True).programs,
               {b: ((x,), {}) for b, x in inputs.items()}, lambda out, b: out)
    return masks


def stage_masks_check(ctx: WorkerContext) -> dict[str, Any]:
    first, again = stage_masks_run(ctx, 5), stage_masks_run(ctx, 5)
    repeatable = len(first) == len(again) and all(
        torch.equal(a, b) for a, b in zip(first, again, strict=True))
    return {"masks": first, "repeatable": repeatable, "after": torch.rand(4)}


def dropout_check(ctx: WorkerContext, schedule: str, checkpoint: Any) -> dict[str, Any]:
    plain = dropout_run(ctx, schedule, False, seed=100)
    ckpt = dropout_run(ctx, schedule, checkpoint, seed=100)
    other = dropout_run(ctx, schedule, checkpoint, seed=200)
    bad = [f"loss b{b}" for b in plain["losses"]
           if not torch.equal(plain["losses"][b], ckpt["losses"][b])]
    bad += [f"grad {n}" for n in plain["grads"]
            if n not in ckpt["grads"] or not torch.equal(plain["grads"][n], ckpt["grads"][n])]
    if not torch.equal(plain["after"], ckpt["after"]):
        bad.append("the random stream after the step")
    return {"bad": bad, "checked": len(plain["grads"]), "losses": len(plain["losses"]),
            "checkpointed": ckpt["checkpointed"],
            "seed_matters": any(not torch.equal(plain["losses"][b], other["losses"][b])
                                for b in plain["losses"])}


def train_check(ctx: WorkerContext, schedule: str, checkpoint: Any,
                steps: int = 2) -> dict[str, Any]:
    """``steps`` SGD steps of the GPT with checkpointing against one device."""
    p = train_plan(schedule, ctx.world_size, checkpoint)
    batch = global_batch("gpt", p.micro)
    loss_fn = make_loss("gpt", batch)
    model = build("gpt")
    part = partition(model, p.stages, example_args=batch[0][0])
    p = with_ties(p, part)
    ex = ProgramExecutor(part.stages, p.programs, channels=shared_channels(ctx.world_size),
                         checkpointed=p.checkpointed)
    out = sgd_steps_against_reference(ex, model, batch, loss_fn, "gpt", steps)
    return {**out, "checkpointed": p.checkpointed,
            "planned": {k: getattr(p.metrics.per_worker[ctx.rank], k)
                        for k in ex.last_counters.PLANNED}}


def loss_reads_weight_check(ctx: WorkerContext, schedule: str) -> dict[str, Any]:
    """The loss code reads a parameter of the last stage (``ln_f.weight``): with checkpointing
    it still gets that term's gradient, as without (also under a split backward)."""
    out = {}
    for checkpoint, term in ((False, True), (True, True), (True, False)):
        p = plan(schedule, workers=ctx.world_size, checkpoint_activations=checkpoint)
        batch = global_batch("gpt", p.micro)
        model = build("gpt")
        part = partition(model, p.stages, example_args=batch[0][0])
        p = with_ties(p, part)
        ex = ProgramExecutor(part.stages, p.programs, channels=shared_channels(ctx.world_size),
                             checkpointed=p.checkpointed)
        loss_fn = make_loss("gpt", batch)
        ex.step(calls(batch), lambda out, b, loss_fn=loss_fn, model=model, term=term:
                loss_fn(out, b) + (0.1 * model.ln_f.weight.square().sum() if term else 0.0))
        out[(checkpoint, term)] = owned_grads(ex, model)
    plain, ckpt, without = out[(False, True)], out[(True, True)], out[(True, False)]
    bad = [n for n in plain if n not in ckpt
           or not torch.allclose(plain[n], ckpt[n], rtol=RTOL, atol=ATOL)]
    moved = (float((ckpt["ln_f.weight"] - without["ln_f.weight"]).abs().max())
             if "ln_f.weight" in ckpt else None)
    return {"bad": bad, "moved": moved}


def loss_only_parameter_check(ctx: WorkerContext, schedule: str,
                              checkpoint: bool) -> dict[str, Any]:
    """The loss reads a parameter no stage reads (a learnable temperature on the logits, as a
    loss module would hold): after the hand-over its gradient is the single-process one, split
    backward or not (W must accumulate it as ``loss.backward()`` does)."""
    from lightning_gsched.runtime import ModelRuntime

    class WithTemperature(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = build("gpt")
            self.temperature = nn.Parameter(torch.tensor(1.5))

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.model(idx)

    p = plan(schedule, workers=ctx.world_size, checkpoint_activations=checkpoint)
    batch = global_batch("gpt", p.micro)
    base = make_loss("gpt", batch)

    def loss_fn(out: torch.Tensor, b: int, module: nn.Module) -> torch.Tensor:
        return base(out * module.temperature, b)

    reference = WithTemperature()
    for b, (args, _, _) in batch.items():
        (loss_fn(reference(*args), b, reference) / len(batch)).backward()
    module = WithTemperature()
    part = partition(module, p.stages, example_args=batch[0][0])
    p = with_ties(p, part)
    runtime = ModelRuntime(module, part.stages, p.programs, channels=shared_channels(ctx.world_size),
                           checkpointed=p.checkpointed)
    runtime.step(calls(batch), lambda out, b: loss_fn(out, b, module))
    runtime.hand_over()
    got, want = module.temperature.grad, reference.temperature.grad
    return {"got": None if got is None else float(got), "want": float(want)}


def saved_bytes_check(ctx: WorkerContext, schedule: str) -> dict[str, Any]:
    """Bytes each forward saves for its backward, per stage, without and with checkpointing;
    and what the stash holds right after a checkpointed forward."""
    out: dict[str, Any] = {}
    for checkpoint in (False, True):
        p = plan(schedule, workers=ctx.world_size, checkpoint_activations=checkpoint)
        batch = global_batch("gpt", p.micro)
        part = partition(build("gpt"), p.stages, example_args=batch[0][0])
        p = with_ties(p, part)
        ex = ProgramExecutor(part.stages, p.programs, channels=shared_channels(ctx.world_size),
                             checkpointed=p.checkpointed)
        compute, forward = ex.compute, ex.compute.forward
        saved: dict[int, int] = {}
        stash_outputs: list[tuple[int, int, bool]] = []  # (stage, outputs kept, replay kept)

        def counted(s: int, b: int, *args: Any, compute: Any = compute, forward: Any = forward,
                    saved: dict = saved, stash_outputs: list = stash_outputs) -> Any:
            total = [0]

            def pack(t: torch.Tensor) -> torch.Tensor:
                total[0] += t.numel() * t.element_size()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                result = forward(s, b, *args)
            saved[s] = max(saved.get(s, 0), total[0])
            stashed = compute.stash[(s, b)]
            stash_outputs.append((s, len(stashed.outputs), stashed.replay is not None))
            return result

        compute.forward = counted
        ex.step(calls(batch), make_loss("gpt", batch))
        out[str(checkpoint)] = {"saved": saved, "stash_outputs": stash_outputs,
                                "last": p.stages - 1}
    return out


def batchnorm_check(ctx: WorkerContext, schedule: str) -> dict[str, Any]:
    """Three SGD steps of the BatchNorm CNN, every stage checkpointed: running statistics after
    every step, and the last step's gradients, against one device."""
    p = plan(schedule, workers=ctx.world_size, checkpoint_activations=True)
    ref = batchnorm_reference(p.micro, ctx.world_size)
    batch = train_batch(p.micro)
    model = models.make_bn_cnn()
    part = partition(model, p.stages, example_args=(batch[0][0],))
    ex = ProgramExecutor(part.stages, p.programs, channels=shared_channels(ctx.world_size),
                         checkpointed=p.checkpointed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # test_runtime_batchnorm's LR
    bad: list[str] = []
    for step in range(len(ref["stats"])):
        optimizer.zero_grad()
        ex.step({b: ((x,), {}) for b, (x, _) in batch.items()},
                lambda out, b: F.cross_entropy(out, batch[b][1]))
        compare(bad, f"step {step + 1} statistics", statistics(model), ref["stats"][step])
        if step < len(ref["stats"]) - 1:
            optimizer.step()
    names = {id(q): n for n, q in model.named_parameters()}
    owned = [q for s in sorted(ex.owned) for q in ex.flats[s].params]
    compare(bad, "owned gradients", {names[id(q)]: q.grad for q in owned},
            {names[id(q)]: ref["grads"][names[id(q)]] for q in owned})
    return {"bad": bad, "stats": statistics(model)}


def in_place_check(ctx: WorkerContext) -> dict[str, Any]:
    """Stage 0 multiplies its input (the user's tensor, which needs no gradient) in place:
    fine without checkpointing, refused with it, naming the stage."""

    class ScalesItsInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x.mul_(2.0))

    out: dict[str, Any] = {}
    for checkpoint in (False, True):
        p = plan("gpipe", workers=ctx.world_size, microbatches=2,
                 checkpoint_activations=checkpoint)
        stages = models.seeded(0, lambda: [ScalesItsInput(), nn.Linear(4, 4)])
        ex = ProgramExecutor(stages, p.programs, timeout=20, checkpointed=p.checkpointed)
        inputs = {b: ((torch.randn(2, 4),), {}) for b in range(2)}
        try:
            ex.step(inputs, lambda out, b: out.square().mean())
            out[str(checkpoint)] = None
            ex.close()
        except RuntimeFault as fault:
            out[str(checkpoint)] = str(fault)
    return out


def close_channels(ctx: WorkerContext) -> None:
    channels = _CHANNELS.pop(ctx.world_size, None)
    if channels is not None:
        channels.close()


# --------------------------------------------------------------------------- parent side


@pytest.mark.parametrize("schedule, checkpoint", [
    ("1f1b", True), ("zbv", True), ("1f1b", [True, False]), ("zbv", [False, True, False, False]),
], ids=["1f1b-all", "zbv-all", "1f1b-first", "zbv-one"])
def test_dropout_masks_and_results_equal_without_checkpointing(worlds, schedule, checkpoint):
    results = worlds.get(W).run(dropout_check, schedule, checkpoint)
    for rank, r in enumerate(results):
        assert not r["bad"], f"rank {rank}: {r['bad']}"
    assert sum(r["losses"] for r in results) > 0 and all(r["checked"] for r in results)
    assert any(results[0]["checkpointed"])
    assert any(r["seed_matters"] for r in results)  # dropout draws masks that change results


def test_each_stage_draws_its_own_dropout_masks(worlds):
    """Ranks seeded alike: stage 1's forward on rank 1 drew what stage 0's drew on rank 0, so
    dropout layers in different stages had the same mask for every microbatch (found by
    probing). Each stage now draws from its own stream (runtime/stage_streams.py): the masks
    differ, the same seed gives the same masks again, and the ambient stream after the step
    is the same on every rank (the schedule's draws leave it alone)."""
    first, second = worlds.get(W).run(stage_masks_check)
    assert len(first["masks"]) == len(second["masks"]) > 0
    assert first["repeatable"] and second["repeatable"]
    for b, (mine, theirs) in enumerate(zip(first["masks"], second["masks"], strict=True)):
        assert mine.any() and not torch.equal(mine, theirs), b
    assert torch.equal(first["after"], second["after"])


@pytest.mark.parametrize("schedule, checkpoint",
                         [(s, True) for s in SCHEDULES] + PER_STAGE,
                         ids=SCHEDULES + [f"{s}-{''.join('1' if c else '0' for c in f)}"
                                          for s, f in PER_STAGE])
def test_checkpointed_schedule_trains_like_one_device(worlds, schedule, checkpoint):
    results = worlds.get(W).run(train_check, schedule, checkpoint)
    for rank, r in enumerate(results):
        assert not r["bad"], f"rank {rank}: {r['bad']}"
        assert r["checked"] > 0
        assert r["counters"] == r["planned"], f"rank {rank}"
    expected = checkpoint if isinstance(checkpoint, list) else [True] * len(
        results[0]["checkpointed"])
    assert list(results[0]["checkpointed"]) == expected


@pytest.mark.parametrize("schedule, checkpoint", [("1f1b", False), ("zb-h1", False),
                                                  ("zbv", True)])
def test_a_parameter_only_the_loss_reads_gets_its_gradient(worlds, schedule, checkpoint):
    """Split backward (zb-h1, zbv) included: W accumulates what loss.backward() would. The
    float32 tolerance: the pipeline sums the microbatches' terms in another order."""
    results = worlds.get(W).run(loss_only_parameter_check, schedule, checkpoint)
    for rank, r in enumerate(results):
        assert r["got"] is not None, f"rank {rank}: no gradient"
        assert r["got"] == pytest.approx(r["want"], rel=1e-5, abs=1e-6), (rank, r)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_loss_code_reading_a_stage_weight_keeps_its_gradient(worlds, schedule):
    """Equal within float32 rounding, not bit for bit: that weight then accumulates the loss
    code's term and the stage's one after the other instead of their sum (one rounding)."""
    results = worlds.get(W).run(loss_reads_weight_check, schedule)
    for rank, r in enumerate(results):
        assert not r["bad"], f"rank {rank}: {r['bad']}"
    assert any(r["moved"] is not None and r["moved"] > 1e-2 for r in results)  # the term counts


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_checkpointed_forward_keeps_no_activations(worlds, schedule):
    results = worlds.get(W).run(saved_bytes_check, schedule)
    for r in results:
        plain, ckpt = r["False"], r["True"]
        assert plain["saved"].keys() == ckpt["saved"].keys() and plain["saved"]
        for s, nbytes in ckpt["saved"].items():
            assert plain["saved"][s] > 0
            if s != ckpt["last"]:
                assert nbytes == 0, (s, nbytes)  # nothing but the inputs (not saved tensors)
            else:  # the loss's own graph (logits and targets), far below the stage's
                assert 0 < nbytes < plain["saved"][s] / 4, (nbytes, plain["saved"][s])
        assert ckpt["stash_outputs"] and all(n == 0 and replay
                                             for _, n, replay in ckpt["stash_outputs"])
        assert all((n > 0) == (s != plain["last"]) and not replay
                   for s, n, replay in plain["stash_outputs"])


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_running_statistics_are_one_devices_with_checkpointing(worlds, schedule):
    results = worlds.get(W).run(batchnorm_check, schedule)
    for rank, r in enumerate(results):
        assert not r["bad"], f"rank {rank}: {r['bad']}"
    for name, value in results[0]["stats"].items():  # every rank holds the same bits
        assert torch.equal(results[1]["stats"][name], value), name


def test_stage_modifying_its_input_in_place_is_refused(worlds):
    results = worlds.get(W).run(in_place_check)
    assert all(r["False"] is None for r in results), results  # legal without checkpointing
    error = results[0]["True"]  # rank 0 runs stage 0 (gpipe)
    assert error.startswith("rank 0 failed at 'B s0 b"), error
    assert "input tensor 0 (shape (2, 4)) of stage 0 was modified in place after F s0 b" in error
    assert "turn checkpoint_activations off for this stage" in error
    assert results[1]["True"] is not None  # the peer fails too (no hang)
    worlds.get(W).run(close_channels)


def test_wrong_flags_are_refused_before_any_collective():
    with pytest.raises(RuntimeConfigError, match="one bool per stage"):
        ProgramExecutor([nn.Linear(2, 2)] * 2, plan("gpipe", workers=2).programs,
                        checkpointed=[True])
