"""Forward-only programs (validation, test, predict) on the executor built for training.

For W in 2 and 4 and every named schedule, one check on all ranks interleaves training steps and
forward-only runs on one executor, against a single-process reference computed in the same check
(the tied-weight GPT, SGD in between):

    forward(eval)                       outputs == reference model (uneven microbatches, 0 rows)
    step(train)                         grads == reference
    forward(eval) in inference_mode()   outputs == reference; grads bit-identical, same buffers;
                                        non-owned stages released; nothing became an inference
                                        tensor; counters == the forward-only plan's metrics
    optimizer.step(); step(train)       grads == reference after one update
    forward(eval)                       outputs == reference after one update
    optimizer.step(); step(train)       weights and grads == reference after two updates

The eval programs have a different number of microbatches than the training programs. The
module also covers the config errors forward() raises and a failing forward (RuntimeFault on
every rank, promptly).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import pytest
import torch

import models
from dist_harness import WorkerContext
from lightning_gsched.errors import RuntimeConfigError, RuntimeFault
from lightning_gsched.partition import partition
from lightning_gsched.runtime import ProgramExecutor, stage_micros
from lightning_gsched.runtime.channels import Channels
from lightning_gsched.schedule import Programs, plan
from tie_helpers import held_parameters, with_ties

pytestmark = pytest.mark.distributed

SCHEDULES = ["ddp", "fsdp", "gpipe", "1f1b", "lpp", "interleaved", "fslpp", "fslpp-seed"]
VOCAB = 64
RTOL, ATOL = 1e-5, 1e-6
# Outputs after SGD updates: replicas' gradients were summed in another order than the
# reference's, so logits differ by float noise (a few 1e-6); a stale or wrong weight is ~1e-2.
OUT_RTOL, OUT_ATOL = 1e-4, 1e-5


# --------------------------------------------------------------------------- worker side


def build() -> torch.nn.Module:
    return models.make_gpt(seed=0, vocab=VOCAB)


def train_batch(micro: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    def make() -> dict:
        return {
            b: (torch.randint(0, VOCAB, (2, 8)), torch.randint(0, VOCAB, (2, 8)))
            for b in range(micro)
        }

    return models.seeded(123, make)


def eval_batch(micro: int, seed: int) -> dict[int, torch.Tensor]:
    """Uneven microbatches, as the split of a last, short eval batch: 1, 0, 3, 2, 1, 0, 3, ..."""
    sizes = [(1, 0, 3, 2)[b % 4] for b in range(micro)]
    return models.seeded(seed, lambda: {b: torch.randint(0, VOCAB, (n, 8)) for b, n in enumerate(sizes)})


def loss_fn_of(batch):
    def loss_fn(output: torch.Tensor, b: int) -> torch.Tensor:
        target = batch[b][1]
        return torch.nn.functional.cross_entropy(
            output.reshape(-1, output.shape[-1]), target.reshape(-1)
        )

    return loss_fn


def output_fn(output: torch.Tensor, b: int) -> dict[str, Any]:
    """Not a scalar: what a predict_step might return."""
    return {"logits": output, "rows": output.shape[0], "micro": b}


# The sequence every check runs, on the executor and (once per batch shape) on the reference.
SEQUENCE = ["forward 7", "step", "forward 8", "update", "step", "forward 9", "update", "step"]


@lru_cache(maxsize=None)
def reference(train_micro: int, micro: int) -> dict[str, Any]:
    """Single-process results of :data:`SEQUENCE`: outputs per eval seed, grads per step, final
    weights. It does not depend on the schedule, so each worker process computes it once per
    (training, eval) microbatch count and reuses it for every schedule."""
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = train_batch(train_micro)
    loss_fn = loss_fn_of(batch)
    out: dict[str, Any] = {"outputs": {}, "grads": []}
    for event in SEQUENCE:
        if event.startswith("forward"):
            seed = int(event.split()[1])
            with torch.no_grad():
                xs = eval_batch(micro, seed)
                out["outputs"][seed] = {b: model(x) for b, x in xs.items()}
        elif event == "step":
            model.zero_grad()
            for b, (x, _) in batch.items():
                (loss_fn(model(x), b) / len(batch)).backward()
            out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        else:
            optimizer.step()
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def eval_micro(schedule: str, W: int) -> int:
    """A microbatch count valid for the schedule and different from the training default."""
    return 2 * W if schedule in ("ddp", "fsdp") else W


def train_plan(schedule: str, W: int):
    return plan(schedule, workers=W, stages=2 if schedule == "ddp" else None)  # ddp: 2 replicas


_CHANNELS: dict[int, Channels] = {}


def shared_channels(W: int) -> Channels:
    """One set of process groups per world for every schedule's executor (built collectively
    by the first check): creating and destroying groups per executor costs more than a check."""
    if W not in _CHANNELS:
        replicas = sorted({o for s in SCHEDULES for o in train_plan(s, W).programs.owners if len(o) > 1})
        union = Programs([[] for _ in range(W)], len(replicas), 0, replicas, [])
        _CHANNELS[W] = Channels(union, timeout=60)
    return _CHANNELS[W]


def close_channels(ctx: WorkerContext) -> None:
    channels = _CHANNELS.pop(ctx.world_size, None)
    if channels is not None:
        channels.close()


class Run:
    """One rank's executor, model, reference and the checks, collecting problems in ``bad``."""

    def __init__(self, ctx: WorkerContext, schedule: str) -> None:
        self.ctx = ctx
        self.train = train_plan(schedule, ctx.world_size)
        self.eval = plan(schedule, workers=ctx.world_size, stages=self.train.stages, R=self.train.R,
                         microbatches=eval_micro(schedule, ctx.world_size), forward_only=True)
        assert self.eval.micro != self.train.micro
        self.model = build()
        self.ref = reference(self.train.micro, self.eval.micro)
        self.steps = 0
        self.batch = train_batch(self.train.micro)
        self.loss_fn = loss_fn_of(self.batch)
        part = partition(self.model, self.train.stages, example_args=(self.batch[0][0],))
        self.train, self.eval = with_ties(self.train, part), with_ties(self.eval, part)
        self.ex = ProgramExecutor(part.stages, self.train.programs, timeout=60,
                                  channels=shared_channels(ctx.world_size))
        self.names = {id(p): n for n, p in self.model.named_parameters()}
        self.owned = held_parameters(self.ex)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.bad: list[str] = []
        self.checks = 0

    # ---------------------------------------------------------------- the two kinds of run

    def step(self, tag: str) -> None:
        self.opt.zero_grad()
        self.ex.step({b: ((x,), {}) for b, (x, _) in self.batch.items()}, self.loss_fn)
        want = self.ref["grads"][self.steps]
        self.steps += 1
        for p in self.owned:
            name = self.names[id(p)]
            if p.grad is None or not torch.allclose(p.grad, want[name], rtol=RTOL, atol=ATOL):
                self.bad.append(f"{tag}: grad of {name} differs from the reference")
        self.checks += 1

    def forward(self, tag: str, seed: int, inference: bool = False) -> None:
        xs = eval_batch(self.eval.micro, seed)
        first, last = stage_micros(self.eval.programs, self.ctx.rank)
        if inference:
            with torch.inference_mode():
                xs = {b: x.clone() for b, x in xs.items()}  # inference tensors, as Lightning's
                # only the microbatches run here, and a signature every rank agrees on (the
                # shapes follow from the microbatch count alone)
                got = self.ex.forward(self.eval.programs, {b: ((xs[b],), {}) for b in first},
                                      output_fn, signature=("eval", self.eval.micro))
        else:  # every microbatch's inputs: the default signature is their shapes
            got = self.ex.forward(self.eval.programs, {b: ((x,), {}) for b, x in xs.items()},
                                  output_fn)
        want = self.ref["outputs"][seed]
        if sorted(got) != last:
            self.bad.append(f"{tag}: outputs for {sorted(got)}, expected {last}")
        for b, value in got.items():
            logits = value["logits"]
            if value["micro"] != b or value["rows"] != xs[b].shape[0]:
                self.bad.append(f"{tag}: output_fn got micro {value['micro']}, {value['rows']} rows")
            if logits.shape != want[b].shape or not torch.allclose(logits, want[b], rtol=OUT_RTOL, atol=OUT_ATOL):
                err = (logits - want[b]).abs().max().item() if logits.shape == want[b].shape else None
                self.bad.append(f"{tag}: output of microbatch {b} differs from the reference ({err})")
            if logits.requires_grad:
                self.bad.append(f"{tag}: output of microbatch {b} requires grad")
        counters = self.ex.last_forward_counters.planned()
        planned = self.eval.metrics.per_worker[self.ctx.rank].as_dict()
        if any(counters[k] != planned[k] for k in counters):
            self.bad.append(f"{tag}: counters {counters} != planned {planned}")
        self.covered = sorted(got)
        self.checks += 1

    # ---------------------------------------------------------------- state checks

    def grads(self) -> dict[str, Any]:
        snapshot = {id(p): (p.grad.clone(), p.grad.data_ptr()) for p in self.owned}
        flats = {s: self.ex.flats[s].grads.flat.clone() for s in self.ex.owned
                 if self.ex.flats[s].grads.flat is not None}
        return {"params": snapshot, "flats": flats}

    def grads_untouched(self, tag: str, before: dict[str, Any]) -> None:
        for p in self.owned:
            grad, ptr = before["params"][id(p)]
            if p.grad is None or p.grad.data_ptr() != ptr or not torch.equal(p.grad, grad):
                self.bad.append(f"{tag}: grad of {self.names[id(p)]} changed")
        for s, flat in before["flats"].items():
            if not torch.equal(self.ex.flats[s].grads.flat, flat):
                self.bad.append(f"{tag}: flat gradient buffer of stage {s} changed")
        self.checks += 1

    def released(self, tag: str) -> None:
        units = [*enumerate(self.ex.flats), *(("tie", u) for u in self.ex.ties.values())]
        for _, flat in units:
            if flat.owned:
                continue
            storage = 0 if flat.flat is None else flat.flat.untyped_storage().nbytes()
            for p in flat.params:
                if p.data.numel() or p.grad is not None or storage:
                    self.bad.append(f"{tag}: non-owned {self.names[id(p)]} not released")
        resident = sum(f.resident_bytes() for _, f in units)
        if resident != sum(f.nbytes for _, f in units if f.owned):
            self.bad.append(f"{tag}: {resident} resident bytes, more than the owned stages")
        for s, flat in units:
            if not flat.owned:
                continue
            tensors = [flat.flat, *(p.data for p in flat.params)]
            if any(t.is_inference() for t in tensors):
                self.bad.append(f"{tag}: weights of owned {s} became inference tensors")
        self.checks += 1

    def weights_match(self, tag: str) -> None:
        ref = self.ref["weights"]
        for p in self.owned:
            name = self.names[id(p)]
            if not torch.allclose(p.detach(), ref[name], rtol=RTOL, atol=ATOL):
                self.bad.append(f"{tag}: weight {name} differs from the reference")
        self.checks += 1

    def optimizer_step(self) -> None:
        self.opt.step()


def interleave_check(ctx: WorkerContext, schedule: str) -> dict[str, Any]:
    run = Run(ctx, schedule)
    covered = []
    run.forward("forward in inference_mode before any step", seed=7, inference=True)
    covered.append(run.covered)
    run.released("after the first forward")

    run.step("step 1")
    before = run.grads()
    run.forward("forward in inference_mode after step 1", seed=8, inference=True)
    covered.append(run.covered)
    run.grads_untouched("forward after step 1", before)
    run.released("after forward in inference_mode")

    run.optimizer_step()
    run.step("step 2 after an inference-mode forward")
    before = run.grads()
    run.forward("forward after step 2", seed=9)
    run.grads_untouched("forward after step 2", before)
    run.released("after forward 3")

    run.optimizer_step()
    run.step("step 3")
    run.weights_match("after two updates")
    run.released("after step 3")
    return {"bad": run.bad, "checks": run.checks, "covered": covered, "eval_micro": run.eval.micro}


def config_error_check(ctx: WorkerContext) -> list[str]:
    """forward() rejects programs it cannot run before any message moves (on every rank)."""
    W = ctx.world_size
    S = plan("fslpp", workers=W).stages
    part = partition(build(), S, example_args=(torch.randint(0, VOCAB, (2, 8)),))
    ties = part.shared_parameters.values()
    train = plan("fslpp", workers=W, ties=ties)
    ex = ProgramExecutor(part.stages, train.programs, timeout=30)
    cases = {
        "training programs": (train.programs, "forward_only=True"),
        "other stage count": (plan("fslpp", workers=W, stages=2 * W, forward_only=True).programs,
                              f"{2 * W} stages instead of {W}"),
        "other owners": (plan("lpp", workers=W, stages=W, forward_only=True,
                              ties=ties).programs, "stage owners"),
        "no ties": (plan("fslpp", workers=W, forward_only=True).programs, "ties {} instead of"),
    }
    messages = []
    for what, (programs, expected) in cases.items():
        try:
            ex.forward(programs, {}, output_fn)
            messages.append(f"{what}: no error")
        except RuntimeConfigError as exc:
            if expected not in str(exc):
                messages.append(f"{what}: unclear message {exc}")
    # the executor still works afterwards: nothing was sent
    ok = plan("fslpp", workers=W, forward_only=True, ties=ties)
    first, _ = stage_micros(ok.programs, ctx.rank)
    xs = eval_batch(ok.micro, 3)
    ex.forward(ok.programs, {b: ((xs[b],), {}) for b in first}, output_fn, signature="ok")
    ex.close()
    return messages


def fault_check(ctx: WorkerContext, failing_rank: int) -> dict[str, Any]:
    """gpipe forward-only: ``failing_rank`` raises in its stage's forward. Every wait is bounded
    by the executor's timeout (20 s): a peer that only stopped then would say "timed out"."""
    train = plan("gpipe", workers=ctx.world_size)
    part = partition(build(), train.stages, example_args=(torch.randint(0, VOCAB, (2, 8)),))
    train = with_ties(train, part)
    evaluation = plan("gpipe", workers=ctx.world_size, forward_only=True, ties=train.ties)
    ex = ProgramExecutor(part.stages, train.programs, timeout=20)
    if ctx.rank == failing_rank:

        def explode(module, args):
            raise ValueError("injected failure")

        part.stages[failing_rank].register_forward_pre_hook(explode)  # gpipe: rank r runs stage r
    xs = eval_batch(evaluation.micro, 5)
    try:
        ex.forward(evaluation.programs, {b: ((x,), {}) for b, x in xs.items()}, output_fn)
        error = None
    except RuntimeFault as fault:
        error = str(fault)
    ex.close()
    return {"rank": ctx.rank, "error": error}


# --------------------------------------------------------------------------- parent side


@pytest.mark.parametrize("W", [2, 4])
def test_forward_interleaved_with_training_matches_single_process(worlds, W):
    world = worlds.get(W)
    try:
        for schedule in SCHEDULES:
            results = world.run(interleave_check, schedule)
            for rank, r in enumerate(results):
                assert not r["bad"], f"{schedule} rank {rank}: {r['bad']}"
                assert r["checks"] >= 12
            for run in range(2):  # every eval microbatch's output returned by exactly one rank
                returned = sorted(b for r in results for b in r["covered"][run])
                assert returned == list(range(results[0]["eval_micro"])), (schedule, returned)
    finally:
        world.run(close_channels)


def test_forward_rejects_programs_it_cannot_run(worlds):
    results = worlds.get(4).run(config_error_check)
    for rank, messages in enumerate(results):
        assert not messages, f"rank {rank}: {messages}"


def test_failing_forward_fails_every_rank_promptly(worlds):
    results = worlds.get(4).run(fault_check, 1)
    assert results[1]["error"].startswith("rank 1 failed at 'F s1 b0' (action ")
    assert "ValueError: injected failure" in results[1]["error"]
    for r in results:
        if r["rank"] == 0 and r["error"] is None:
            continue  # rank 0 only sends in a forward-only gpipe: it may finish its program
        assert r["error"] is not None, f"rank {r['rank']} did not fail"
        assert r["error"].startswith(f"rank {r['rank']} "), r["error"]
        # promptly: on rank 1's closed connections, not at the end of the bounded wait
        assert "timed out" not in r["error"], r["error"]
    for r in results[2:]:  # downstream of rank 1: they wait for it, and quote its failure
        assert "First failure reported in the job: rank 1 failed at 'F s1 b0'" in r["error"], r
