"""Every named schedule, executed for real on 1, 2 and 4 gloo processes.

For each (W, schedule, model) one step runs on all ranks and each rank checks, against a
single-process reference it computes itself on the same seeded global batch:

* every parameter's gradient on its owner(s) equals the single-process gradient of the mean
  loss over the B microbatches (replicas and tied weights included: the GPT's embedding and
  head are one tie, planned from the partition's ``shared_parameters``);
* the runtime's counters equal the planner's per-worker metrics, field by field;
* weights of non-owned stages and ties are really released after the step (empty ``.data``,
  0-byte storage, no ``.grad``), and the peak of resident stage and tie bytes the runtime
  measured on its buffers' storage equals the planner's figure read off the programs
  (``resident_bytes``).

BatchNorm (residual CNN) stays in train mode: batch statistics are per microbatch in the
pipeline, so the reference also runs the microbatches one at a time (same statistics, same
gradients); running statistics do not enter the gradients.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import models
from dist_harness import WorkerContext
from lightning_gsched.partition import partition
from lightning_gsched.runtime import ProgramExecutor
from lightning_gsched.schedule import plan
from lightning_gsched.schedule.memory import resident_bytes
from tie_helpers import held_parameters, with_ties

pytestmark = pytest.mark.distributed

SCHEDULES = ["ddp", "fsdp", "gpipe", "1f1b", "lpp", "interleaved", "fslpp", "fslpp-seed",
             "zb-h1", "zb-h2", "zbv"]
MODELS = ["gpt", "cnn"]
EXTRA_SCHEDULES = ["1f1b", "fsdp", "fslpp", "zb-h1"]
EXTRA_MODELS = ["long_skip", "kwargs", "custom_fn"]  # custom_fn: user backward, B/W split
# the memory-controlled V schedules (reserved caps): at W=2 and 4, where the worlds run anyway
V_MEMORY = ["v-half", "v-min"]
DATA_PARALLEL = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "lpp", "fslpp"]
VOCAB = 64
RTOL, ATOL = 1e-5, 1e-6


# --------------------------------------------------------------------------- worker side


Batch = dict[int, tuple[tuple, dict, Any]]  # b -> (args, kwargs, target)


def build(model_name: str) -> torch.nn.Module:
    return {
        "gpt": lambda: models.make_gpt(seed=0, vocab=VOCAB),
        "cnn": lambda: models.make_cnn(seed=0),
        "long_skip": lambda: models.make_long_skip(seed=0),
        "kwargs": lambda: models.make_kwargs_model(seed=0),
        "custom_fn": lambda: models.make_custom_functions(seed=0),
    }[model_name]()


def global_batch(model_name: str, micro: int) -> Batch:
    """{b: (args, kwargs, target)}, identical on every rank (seeded)."""

    def one(b: int) -> tuple[tuple, dict, Any]:
        if model_name == "gpt":
            return (torch.randint(0, VOCAB, (2, 8)),), {}, torch.randint(0, VOCAB, (2, 8))
        if model_name == "cnn":
            return (torch.randn(2, 3, 8, 8),), {}, torch.randint(0, 10, (2,))
        if model_name == "long_skip":
            return (torch.randn(4, 16),), {}, torch.randn(4, 16)
        if model_name == "custom_fn":
            return (torch.randn(4, 16),), {}, torch.randn(4, 8)
        args, kwargs = models.kwargs_inputs(batch=3, seed=100 + b)
        return args, kwargs, None

    return models.seeded(123, lambda: {b: one(b) for b in range(micro)})


def make_loss(model_name: str, batch: Batch):
    def loss_fn(output: Any, b: int) -> torch.Tensor:
        target = batch[b][2]
        if model_name in ("gpt", "cnn"):
            return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
        if model_name in ("long_skip", "custom_fn"):
            return F.mse_loss(output, target)
        return models.loss_of(output)  # dict with a list of tensors, an int and None

    return loss_fn


def reference(
    model_name: str, batch: Batch, loss_fn, steps: int = 1, lr: float = 0.0
) -> tuple[torch.nn.Module, dict[str, torch.Tensor], dict[int, float]]:
    """Single-process model, gradients of the mean loss (microbatch by microbatch), losses.

    With ``steps > 1`` it takes SGD steps in between, like the distributed run.
    """
    model = build(model_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        optimizer.zero_grad()
        losses = {}
        for b, (args, kwargs, _) in batch.items():
            loss = loss_fn(model(*args, **kwargs), b)
            (loss / len(batch)).backward()
            losses[b] = loss.item()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if step < steps - 1:
            optimizer.step()
    return model, grads, losses


def setup(ctx: WorkerContext, schedule: str, model_name: str, stages: int | None,
          fetch_window: int | None = None):
    """(plan, batch, loss_fn, model, executor, canonical names) for one distributed run."""
    name, _, replicas = schedule.partition("@")  # "1f1b@2-shard": 2 replicas, sharded
    G, _, mode = replicas.partition("-")
    p = plan(name, workers=ctx.world_size, stages=stages, fetch_window=fetch_window,
             data_parallel_size=int(G or 1), data_parallel=mode or "replicate")
    batch = global_batch(model_name, p.micro)
    model = build(model_name)
    args, kwargs, _ = batch[0]
    part = partition(model, p.stages, example_args=args, example_kwargs=kwargs)
    p = with_ties(p, part)
    ex = ProgramExecutor(part.stages, p.programs, timeout=60)
    return p, batch, make_loss(model_name, batch), model, ex


def calls(batch: Batch) -> dict[int, tuple[tuple, dict]]:
    return {b: (args, kwargs) for b, (args, kwargs, _) in batch.items()}


def step_check(
    ctx: WorkerContext, schedule: str, model_name: str, stages: int | None,
    fetch_window: int | None = None,
) -> dict[str, Any]:
    p, batch, loss_fn, model, ex = setup(ctx, schedule, model_name, stages, fetch_window)
    _, ref_grads, ref_losses = reference(model_name, batch, loss_fn)
    name_of = {id(param): name for name, param in model.named_parameters()}
    result = ex.step(calls(batch), loss_fn)

    compared, mismatches, max_err = [], [], 0.0
    for param in held_parameters(ex):
        name = name_of[id(param)]
        compared.append(name)
        if param.grad is None:
            mismatches.append(f"{name}: no gradient")
            continue
        err = (param.grad - ref_grads[name]).abs().max().item()
        max_err = max(max_err, err)
        if not torch.allclose(param.grad, ref_grads[name], rtol=RTOL, atol=ATOL):
            mismatches.append(f"{name}: max abs err {err:.3g}")

    released = []
    units = [*enumerate(ex.flats), *ex.ties.items()]
    for _, flat in units:
        if flat.owned:
            continue
        for param in flat.params:
            ok = param.data.numel() == 0 and param.grad is None
            ok = ok and (flat.flat is None or flat.flat.untyped_storage().nbytes() == 0)
            released.append((name_of[id(param)], ok))

    out = {
        "stages": p.stages,
        "compared": compared,
        "mismatches": mismatches,
        "max_err": max_err,
        "params_with_grad": sorted(ref_grads),
        "counters": result.counters.planned(),
        "planned": {k: getattr(p.metrics.per_worker[ctx.rank], k) for k in result.counters.PLANNED},
        "released": released,
        "resident_bytes_now": sum(f.resident_bytes() for _, f in units),
        "owned_bytes": sum(f.nbytes for _, f in units if f.owned),
        "all_bytes": sum(f.nbytes for _, f in units),
        "peak_bytes": result.counters.peak_resident_param_bytes,
        # the planner's figures for this rank, from the programs and the buffers' sizes
        "planned_bytes": resident_bytes(p.programs, [f.nbytes for f in ex.flats],
                                        {h: t.nbytes for h, t in ex.ties.items()})[ctx.rank],
        "losses": {b: (v.item(), ref_losses[b]) for b, v in result.losses.items()},
        "micro": p.micro,
    }
    ex.close()
    return out


# --------------------------------------------------------------------------- parent side


def _cases() -> list:
    cases = []
    for W in (1, 2, 4):
        combos = [(schedule, m) for schedule in SCHEDULES for m in MODELS]
        if W == 2:  # pytrees: a long skip (pass-through that needs grad), kwargs and dict output
            combos += [(schedule, m) for schedule in EXTRA_SCHEDULES for m in EXTRA_MODELS]
        if W > 1:
            combos += [(schedule, "gpt") for schedule in V_MEMORY]
        for schedule, model_name in combos:
            stages = 2 if schedule == "ddp" else None  # ddp: replicate a 2-stage model
            cases.append(pytest.param(W, schedule, model_name, stages, None,
                                      id=f"W{W}-{schedule}-{model_name}"))
        # fsdp with two stages per worker (fetched weights freed between a stage's forward and
        # its backward, the benchmark's configuration at W=2), and with a fetch window of one
        # stage where consecutive fetched stages would otherwise overlap (W=4)
        cases.append(pytest.param(W, "fsdp", "gpt", 2 * W, None, id=f"W{W}-fsdp-gpt-S{2 * W}"))
        if W == 4:
            cases.append(pytest.param(W, "fsdp", "gpt", None, 1, id=f"W{W}-fsdp-gpt-window1"))
            # pipelines x data parallel: P=2 x G=2, each stage replicated or sharded
            cases += [pytest.param(W, f"{name}@2-{mode}", "gpt", None, None,
                                   id=f"W{W}-{name}-2x2-{mode}")
                      for name in DATA_PARALLEL for mode in ("replicate", "shard")]
    return cases


@pytest.mark.parametrize("W,schedule,model_name,stages,fetch_window", _cases())
def test_step_matches_single_process(worlds, W, schedule, model_name, stages, fetch_window):
    results = worlds.get(W).run(step_check, schedule, model_name, stages, fetch_window)

    # gradients: every parameter checked by at least one owner, all equal to the reference
    for rank, r in enumerate(results):
        assert not r["mismatches"], f"rank {rank}: {r['mismatches']}"
    covered = set().union(*(r["compared"] for r in results))
    expected = set(results[0]["params_with_grad"])
    assert covered >= expected, sorted(expected - covered)

    # every microbatch's loss computed exactly once, equal to the reference
    losses = [b for r in results for b in r["losses"]]
    assert sorted(losses) == list(range(results[0]["micro"]))
    for r in results:
        for b, (got, want) in r["losses"].items():
            assert got == pytest.approx(want, rel=1e-6), b

    # counters == planner metrics, field by field (the tie counters included)
    for rank, r in enumerate(results):
        assert r["counters"] == r["planned"], f"rank {rank}"
    if model_name == "gpt" and W > 1:  # the tied embedding/head really moved as planned
        ties = [{k: v for k, v in r["counters"].items() if k.startswith("tie_")} for r in results]
        if schedule in ("gpipe", "fsdp") and stages is None:  # stage 3 / every rank reads it
            assert sum(t["tie_fetches"] for t in ties) == (1 if schedule == "gpipe" else W - 1)
            assert sum(t["tie_grad_sends"] for t in ties) == sum(t["tie_fetches"] for t in ties)
        if schedule == "ddp":
            assert all(t["tie_allreduces"] == 1 for t in ties), ties
        if schedule in ("zbv", *V_MEMORY):  # the V: stages 0 and S-1 on rank 0
            assert not any(v for t in ties for v in t.values()), ties

    # memory: non-owned weights released; measured bytes at rest and at peak = the planner's
    for r in results:
        assert all(ok for _, ok in r["released"]), [n for n, ok in r["released"] if not ok]
        assert r["resident_bytes_now"] == r["owned_bytes"] == r["planned_bytes"].owned
        assert r["peak_bytes"] == r["planned_bytes"].peak
    if schedule == "ddp":
        assert all(r["counters"]["peak_resident_stages"] == r["stages"] for r in results)
    if schedule in ("fsdp", "fslpp") and W > 1:
        assert any(r["released"] for r in results)  # something was actually sharded
        for r in results:  # fewer stages resident at peak than the model has: fewer bytes too
            if r["planned"]["peak_resident_stages"] < r["stages"]:
                assert r["peak_bytes"] < r["all_bytes"]


def sgd_steps_against_reference(ex: ProgramExecutor, model: torch.nn.Module, batch: Batch,
                                loss_fn, model_name: str, steps: int) -> dict[str, Any]:
    """``steps`` executor steps with SGD (lr 0.1) in between, against :func:`reference` taking
    the same steps: the owned weights and gradients that differ, how many were checked, and the
    last step's counters."""
    ref_model, ref_grads, _ = reference(model_name, batch, loss_fn, steps=steps, lr=0.1)
    ref_params = dict(ref_model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # non-owned params have no grad
    for i in range(steps):
        optimizer.zero_grad()
        result = ex.step(calls(batch), loss_fn)
        if i < steps - 1:
            optimizer.step()
    bad = []
    owned = held_parameters(ex)
    names = {id(param): name for name, param in model.named_parameters()}
    for param in owned:
        name = names[id(param)]
        if not torch.allclose(param.detach(), ref_params[name].detach(), rtol=RTOL, atol=ATOL):
            bad.append(f"weight {name}")
        if not torch.allclose(param.grad, ref_grads[name], rtol=RTOL, atol=ATOL):
            bad.append(f"grad {name}")
    return {"bad": bad, "checked": len(owned), "counters": result.counters.planned()}


def train_check(ctx: WorkerContext, schedule: str, model_name: str, steps: int) -> dict[str, Any]:
    """Several steps with SGD in between: owners' weights and gradients follow the reference."""
    p, batch, loss_fn, model, ex = setup(ctx, schedule, model_name, None)
    out = sgd_steps_against_reference(ex, model, batch, loss_fn, model_name, steps)
    out["planned"] = {k: getattr(p.metrics.per_worker[ctx.rank], k)
                      for k in ex.last_counters.PLANNED}
    ex.close()
    return out


def close_check(ctx: WorkerContext) -> dict[str, Any]:
    """One 1f1b step (it sends, so the send releaser's thread starts), then ``close``: whether
    the thread ended and the executor, with its flat buffers, was freed."""
    import gc
    import threading
    import weakref

    def releasers() -> list[threading.Thread]:  # the thread's name: runtime/transport.py
        return [t for t in threading.enumerate() if t.name == "gsched-send-release"]

    earlier = set(releasers())  # an earlier module's executors left open on this world's ranks
    _, batch, loss_fn, _, ex = setup(ctx, "1f1b", "gpt", None)
    ex.step(calls(batch), loss_fn)
    threads = [t for t in releasers() if t not in earlier]
    ref = weakref.ref(ex)
    ex.close()
    del ex
    for thread in threads:
        thread.join(timeout=10)
    gc.collect()
    return {"started": len(threads) == 1, "thread_alive": any(t.is_alive() for t in threads),
            "executor_alive": ref() is not None}


def test_close_ends_the_send_thread_and_frees_the_executor(worlds):
    """A closed executor must not outlive its fit: the send releaser's thread held it (and every
    flat buffer) forever, so a second fit in the process counted the first one's bytes."""
    for rank, r in enumerate(worlds.get(2).run(close_check)):
        assert r == {"started": True, "thread_alive": False, "executor_alive": False}, rank


@pytest.mark.parametrize("schedule", ["fsdp", "lpp", "fslpp"])
def test_training_steps_follow_single_process(worlds, schedule):
    """Three steps with SGD between them (fetches must carry the updated weights, replicas stay
    equal, gradients restart from zero each step)."""
    results = worlds.get(4).run(train_check, schedule, "gpt", 3)
    for rank, r in enumerate(results):
        assert not r["bad"], f"rank {rank}: {r['bad']}"
        assert r["checked"] > 0
        assert r["counters"] == r["planned"]


# --------------------------------------------------------------------------- faults
# Placed after the W=4 cases so they reuse that world. Each fault check builds its own executor
# (own process groups), so the aborted groups do not affect later checks.

FAULT_TIMEOUT = 20.0


def fault_check(ctx: WorkerContext, failing_rank: int, mode: str, timeout: float,
                schedule: str = "gpipe") -> dict[str, Any]:
    """``schedule`` over all ranks; ``failing_rank`` raises in its first forward ("raise"), in
    its first weight-gradient accumulation ("raise_w": a W of a zero-bubble schedule), or never
    steps ("hang"). Returns, per rank, how the step ended. Every wait is bounded by ``timeout``
    (the executor's step timeout), so a check never hangs."""
    from lightning_gsched.errors import RuntimeFault

    p = plan(schedule, workers=ctx.world_size)
    batch = global_batch("gpt", p.micro)
    part = partition(build("gpt"), p.stages, example_args=batch[0][0])
    ex = ProgramExecutor(part.stages, with_ties(p, part).programs, timeout=timeout)
    if ctx.rank == failing_rank and mode == "raise":

        def explode(module, args):
            raise ValueError("injected failure")

        part.stages[failing_rank].register_forward_pre_hook(explode)  # gpipe: rank r runs stage r
    if ctx.rank == failing_rank and mode == "raise_w":

        def explode_w(param):
            raise ValueError("injected failure in a weight gradient")

        next(part.stages[failing_rank].parameters()).register_post_accumulate_grad_hook(explode_w)
    outcome: dict[str, Any] = {"rank": ctx.rank}
    if ctx.rank == failing_rank and mode == "hang":
        ctx.store.wait(
            [f"fault_done/{ctx.world_size}/{mode}"], __import__("datetime").timedelta(seconds=120)
        )
        outcome.update(error=None)
        ex.close()
        return outcome
    try:
        ex.step(calls(batch), make_loss("gpt", batch))
        outcome.update(error=None)
    except RuntimeFault as fault:
        outcome.update(error=str(fault), type=type(fault).__name__)
    ctx.store.add(f"fault_finished/{ctx.world_size}/{mode}", 1)
    if ctx.store.add(f"fault_finished/{ctx.world_size}/{mode}", 0) == ctx.world_size - (
        mode == "hang"
    ):
        ctx.store.set(f"fault_done/{ctx.world_size}/{mode}", "1")
    ex.close()
    return outcome


def test_failing_forward_fails_every_rank_promptly(worlds):
    """Rank 1 raises inside its first stage forward: it reports rank, stage, microbatch and
    action; every peer ends with a RuntimeFault naming its own rank, the action it waited at and
    rank 1's failure, on rank 1's closed connections rather than at the end of the bounded
    wait (a peer that waited it out would say "timed out")."""
    results = worlds.get(4).run(fault_check, 1, "raise", FAULT_TIMEOUT)
    failing = results[1]
    assert failing["type"] == "RuntimeFault"
    assert failing["error"].startswith("rank 1 failed at 'F s1 b0' (action ")
    assert "ValueError: injected failure" in failing["error"]
    for r in results:
        assert r["error"] is not None, f"rank {r['rank']} did not fail"
        assert "timed out" not in r["error"], r["error"]
        if r["rank"] != 1:
            assert r["error"].startswith(f"rank {r['rank']} "), r["error"]
            assert " at '" in r["error"] and "waiting for " in r["error"], r["error"]
            assert "First failure reported in the job: rank 1 failed at 'F s1 b0'" in r["error"], r[
                "error"
            ]


def test_failing_weight_gradient_names_the_w_action(worlds):
    """zb-h1: rank 1's first W fails (after its B sent the input gradient on): rank 1 names
    the W action, rank 0 ends with a RuntimeFault quoting it, both promptly (no one waits out
    the bounded wait)."""
    results = worlds.get(2).run(fault_check, 1, "raise_w", FAULT_TIMEOUT, "zb-h1")
    failing = results[1]
    assert failing["type"] == "RuntimeFault"
    assert failing["error"].startswith("rank 1 failed at 'W s1 b0' (action "), failing["error"]
    assert "injected failure in a weight gradient" in failing["error"]
    other = results[0]
    assert other["error"] is not None and other["error"].startswith("rank 0 "), other
    assert "First failure reported in the job: rank 1 failed at 'W s1 b0'" in other["error"]
    assert all("timed out" not in r["error"] for r in results), results


def test_stuck_rank_times_out_every_peer(worlds):
    """Rank 3 never runs its step: its peers fail within the timeout instead of hanging, the
    first one saying it timed out and what it waited for, the others quoting it."""
    timeout = 3.0
    results = worlds.get(4).run(fault_check, 3, "hang", timeout)
    errors = [r for r in results if r["rank"] != 3]
    assert all(r["error"] for r in errors), errors
    timed_out = [r for r in errors if r["error"].startswith(f"rank {r['rank']} timed out at '")]
    assert timed_out, errors
    for r in timed_out:  # the bound that ended the wait is the step timeout given
        assert f"nothing arrived within {timeout:g} s" in r["error"], r["error"]
        # where each rank waits, as they posted it: the stuck one posted nothing
        places = r["error"].split("Where the ranks wait: ")[1]
        assert f"rank {r['rank']} at '" in places or f", {r['rank']} at '" in places, places
        assert re.search(r"ranks? [\d, ]*\b3 posted nothing \(stuck, died, or not waiting\)",
                         places), places
    for r in errors:
        assert r["error"].startswith(f"rank {r['rank']} "), r["error"]
