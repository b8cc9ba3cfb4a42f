"""Running statistics (BatchNorm, InstanceNorm) end every step as one device's, on every rank.

The semantics under test (docs/runtime.md, "BatchNorm and other running statistics"): after each
training step every rank holds, for every stage, the running statistics one device has after
running the forward on microbatches 0..B-1 in order, in training mode, with gradient
accumulation (loss / B) — while each forward still normalises with its microbatch's own batch
statistics.

For every library schedule at W=2 (and four at W=4) one check on all ranks trains
:class:`models.BatchNormCNN` (BatchNorm2d with two momenta, a tracking InstanceNorm2d, a
BatchNorm1d with ``momentum=None``) for 3 steps with SGD in between and compares, against a
single-process reference computed in the worker:

* after every step, every rank's ``running_mean``, ``running_var`` and ``num_batches_tracked``
  of every stage (owned, fetched or never run here) — and the ranks' buffers are bit-identical;
* the last step's gradients and the weights on their owners, and the gathered full state dict
  (rank 0: weights and buffers);
* eval-mode outputs of a forward-only run afterwards; forward-only runs (eval, and train mode)
  leave the buffers unchanged; the statistics cost one all-reduce per step of the planned size.

Tolerance: rtol 1e-5 / atol 1e-6 as the other runtime tests. The fold mixes each captured
statistic in with torch's own float32 formula; the one extra rounding is the batch variance,
which ATen keeps in double until the update and the runtime captures in float32 (one float32
rounding, ~1e-7 relative), plus gradients summed in another order (see test_runtime_schedules).

Also at W=2: a module called from two stages (folded in stage order), a module called twice in
one stage forward and nn.SyncBatchNorm (clear errors), a Lightning Trainer fit (gpipe and
fslpp) whose state dict after fit equals a plain-torch loop over the same microbatches, and
Trainer(sync_batchnorm=True) refused.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import models
from dist_harness import WorkerContext
from lightning_gsched.errors import GschedError, RuntimeConfigError, RuntimeFault
from lightning_gsched.partition import partition
from lightning_gsched.runtime import ProgramExecutor, tie_map
from lightning_gsched.runtime.channels import Channels
from lightning_gsched.runtime.fullstate import full_state_dict
from lightning_gsched.schedule import Op, Programs, plan
from lightning_gsched.schedule.library import LIBRARY

pytestmark = pytest.mark.distributed

SCHEDULES = [name for name in LIBRARY if name != "v-min"]  # at W=2 v-min's plan is v-half's (test_schedule_vshape_memory): run once
W4_SCHEDULES = ["1f1b", "lpp", "interleaved", "fslpp"]
# 8 rows per microbatch: over 4 rows BatchNorm is so ill-conditioned that the third step's
# gradients of the first convolutions move by 5e-6 (measured) when one process merely sums the
# same microbatch gradients in two groups; with 8 rows that reordering moves them by 3e-7
STEPS, LR, ROWS, CLASSES = 3, 0.1, 8, 5
RTOL, ATOL = 1e-5, 1e-6
# eval outputs after SGD updates: the weights differ from the reference's by gradient
# reordering noise, which the logits carry at a few 1e-6; a stale statistic moves them ~1e-2
OUT_RTOL, OUT_ATOL = 1e-4, 1e-5
WORLD_TIMEOUT = 300.0  # the Lightning fits (conftest.worlds)

Batch = dict[int, tuple[torch.Tensor, torch.Tensor]]


# --------------------------------------------------------------------------- worker side


def train_plan(schedule: str, W: int) -> Any:
    return plan(schedule, workers=W, stages=2 if schedule == "ddp" else None)  # ddp: 2 replicas


def train_batch(micro: int, seed: int = 11) -> Batch:
    return models.seeded(seed, lambda: {
        b: (torch.randn(ROWS, 3, 8, 8), torch.randint(0, CLASSES, (ROWS,))) for b in range(micro)
    })


def eval_inputs(micro: int) -> dict[int, torch.Tensor]:
    """Uneven eval microbatches (2 rows or more: BatchNorm in train mode needs 2)."""
    return models.seeded(12, lambda: {b: torch.randn(2 + b % 3, 3, 8, 8) for b in range(micro)})


def loss_of(batch: Batch):
    return lambda output, b: F.cross_entropy(output, batch[b][1])


def statistics(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every running-statistics buffer by name, cloned."""
    return {n: t.detach().clone() for n, t in module.named_buffers()
            if n.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")}


@lru_cache(maxsize=None)
def reference(micro: int, eval_micro: int) -> dict[str, Any]:
    """One device, microbatches in order with gradient accumulation, SGD between steps: the
    statistics after each step, the last step's gradients, the state dict, eval outputs."""
    model = models.make_bn_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batch = train_batch(micro)
    loss_fn = loss_of(batch)
    stats = []
    for step in range(STEPS):
        optimizer.zero_grad()
        for b, (x, _) in batch.items():
            (loss_fn(model(x), b) / micro).backward()
        stats.append(statistics(model))
        if step < STEPS - 1:
            optimizer.step()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():
        outputs = {b: model(x) for b, x in eval_inputs(eval_micro).items()}
    return {"stats": stats, "grads": grads, "state": model.state_dict(), "outputs": outputs}


_CHANNELS: dict[int, Channels] = {}


def shared_channels(W: int) -> Channels:
    """One set of process groups per world for every schedule's executor (creating groups per
    executor costs more than a check)."""
    if W not in _CHANNELS:
        replicas = sorted({o for s in SCHEDULES for o in train_plan(s, W).programs.owners
                           if len(o) > 1})
        union = Programs([[] for _ in range(W)], len(replicas), 0, replicas, [])
        _CHANNELS[W] = Channels(union, timeout=60)
    return _CHANNELS[W]


def close_channels(ctx: WorkerContext) -> None:
    channels = _CHANNELS.pop(ctx.world_size, None)
    if channels is not None:
        channels.close()


@pytest.fixture(scope="module", autouse=True)
def _shared_channels_closed(worlds) -> None:
    """The workers cache one Channels per world (:func:`shared_channels`): close it in every
    world (W=2 and W=4) before that world ends, whichever test used it last."""
    worlds.before_close(close_channels)


def compare(bad: list[str], what: str, got: dict[str, torch.Tensor],
            want: dict[str, torch.Tensor], rtol: float = RTOL, atol: float = ATOL) -> None:
    for name, value in want.items():
        if name not in got:
            bad.append(f"{what}: {name} missing")
        elif value.dtype == torch.long:
            if not torch.equal(got[name], value):
                bad.append(f"{what}: {name} {got[name].tolist()} != {value.tolist()}")
        elif not torch.allclose(got[name], value, rtol=rtol, atol=atol):
            err = (got[name] - value).abs().max().item()
            bad.append(f"{what}: {name} max abs err {err:.3g}")


def schedule_check(ctx: WorkerContext, schedule: str) -> dict[str, Any]:
    """3 training steps, then eval and train-mode forward-only runs (see the module docstring)."""
    W = ctx.world_size
    train = train_plan(schedule, W)
    eval_micro = 2 * W if schedule in ("ddp", "fsdp") else W
    evaluation = plan(schedule, workers=W, stages=train.stages, R=train.R,
                      microbatches=eval_micro, forward_only=True)
    ref = reference(train.micro, eval_micro)
    batch = train_batch(train.micro)
    model = models.make_bn_cnn()
    part = partition(model, train.stages, example_args=(batch[0][0],))
    ex = ProgramExecutor(part.stages, train.programs, timeout=60, channels=shared_channels(W))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)  # non-owned params get no grad
    bad: list[str] = []
    holders = [sum(1 for m in stage.modules() if "running_mean" in dict(m.named_buffers()))
               for stage in part.stages]
    run_here = {s for s in range(train.stages)
                if any(a.op is Op.F and a.stage == s for a in ex.program)}
    counters = []
    for step in range(STEPS):
        optimizer.zero_grad()
        result = ex.step({b: ((x,), {}) for b, (x, _) in batch.items()}, loss_of(batch))
        counters.append((result.counters.stats_allreduces, result.counters.stats_allreduce_bytes))
        compare(bad, f"step {step + 1} statistics", statistics(model), ref["stats"][step])
        if step < STEPS - 1:
            optimizer.step()
    names = {id(p): n for n, p in model.named_parameters()}
    owned = [p for s in sorted(ex.owned) for p in ex.flats[s].params]
    compare(bad, "owned weights", {names[id(p)]: p.detach() for p in owned},
            {names[id(p)]: ref["state"][names[id(p)]] for p in owned})
    compare(bad, "owned gradients", {names[id(p)]: p.grad for p in owned},
            {names[id(p)]: ref["grads"][names[id(p)]] for p in owned})
    norms = [m for m in model.modules() if "running_mean" in dict(m.named_buffers())]
    fresh = [m for m in models.make_bn_cnn().modules() if "running_mean" in dict(m.named_buffers())]
    if [m.momentum for m in norms] != [m.momentum for m in fresh]:
        bad.append(f"momentum not restored: {[m.momentum for m in norms]}")
    if any(m._forward_hooks for m in norms):
        bad.append("forward hooks left on norm modules")
    full = full_state_dict(model, ex, ctx.world_size)
    if ctx.rank == 0:
        compare(bad, "full state dict", full, ref["state"])
    trained = statistics(model)

    # evaluation: running statistics normalise, outputs are one device's
    model.eval()
    xs = eval_inputs(eval_micro)
    outputs = ex.forward(evaluation.programs, {b: ((x,), {}) for b, x in xs.items()},
                         lambda out, b: out)
    compare(bad, "eval outputs", {str(b): v for b, v in outputs.items()},
            {str(b): ref["outputs"][b] for b in outputs}, OUT_RTOL, OUT_ATOL)
    compare(bad, "statistics after eval", statistics(model), trained, 0.0, 0.0)
    model.train()  # a forward-only run in training mode: batch statistics, buffers untouched
    ex.forward(evaluation.programs, {b: ((x,), {}) for b, x in xs.items()}, lambda out, b: None)
    compare(bad, "statistics after a train-mode forward()", statistics(model), trained, 0.0, 0.0)
    return {"bad": bad, "stats": trained, "holders": holders, "run_here": sorted(run_here),
            "counters": counters, "micro": train.micro, "width": sum(
                2 * m.running_mean.numel() + 1 for stage in part.stages
                for m in stage.modules() if "running_mean" in dict(m.named_buffers()))}


def check_schedule(results: list[dict[str, Any]], schedule: str) -> None:
    for rank, r in enumerate(results):
        assert not r["bad"], f"{schedule} rank {rank}: {r['bad']}"
    for r in results[1:]:  # every rank holds the same bits, not just close ones
        assert r["stats"].keys() == results[0]["stats"].keys()
        for name, value in results[0]["stats"].items():
            assert torch.equal(r["stats"][name], value), name
    holders = results[0]["holders"]
    assert sum(1 for h in holders if h) >= min(2, len(holders)), holders  # spread over stages
    if schedule not in ("ddp", "fsdp"):  # pipelines: ranks fold stages they never ran
        assert any(len(r["run_here"]) < len(holders) for r in results), schedule
    size = results[0]["micro"] * results[0]["width"] * 4  # float32 table, one row per microbatch
    for r in results:
        assert r["counters"] == [(1, size)] * STEPS, r["counters"]


# --------------------------------------------------------------------------- W = 2


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_statistics_match_one_device_w2(worlds, schedule: str) -> None:
    check_schedule(worlds.get(2).run(schedule_check, schedule), schedule)


class SharedNorm(nn.Module):
    """Two stages calling one BatchNorm1d (and an InstanceNorm1d with momentum=None, which
    tracks nothing): a chain of plain modules, as the runtime accepts any stages."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(6, momentum=0.2)
        self.first = nn.Sequential(nn.Linear(5, 6), self.norm, nn.ReLU())
        self.second = nn.Sequential(
            nn.Linear(6, 6), self.norm,
            nn.Unflatten(1, (2, 3)),
            nn.InstanceNorm1d(2, momentum=None, track_running_stats=True), nn.Flatten(),
            nn.Linear(6, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.norm(x))


def shared_check(ctx: WorkerContext, schedule: str) -> list[str]:
    """A module called from two stages folds once per stage, in stage order (one device:
    stage 0's call, then stage 1's, microbatch by microbatch)."""
    model, ref = models.seeded(0, SharedNorm), models.seeded(0, SharedNorm)
    # the norm's affine weights are read by both stages: a tie the plan places
    p = plan(schedule, workers=ctx.world_size, stages=2,
             ties=tie_map([model.first, model.second]))
    batch = models.seeded(3, lambda: {b: (torch.randn(4, 5), torch.randint(0, 3, (4,)))
                                      for b in range(p.micro)})
    ex = ProgramExecutor([model.first, model.second], p.programs, timeout=60,
                         channels=shared_channels(ctx.world_size))
    bad: list[str] = []
    for step in range(2):
        ex.step({b: ((x,), {}) for b, (x, _) in batch.items()}, loss_of(batch))
        for x, y in batch.values():
            (F.cross_entropy(ref(x), y) / p.micro).backward()
        compare(bad, f"step {step + 1}", statistics(model), statistics(ref))
    assert int(model.norm.num_batches_tracked) == 2 * 2 * p.micro
    return bad


def broadcast_check(ctx: WorkerContext) -> dict[str, torch.Tensor]:
    """Ranks that start with different statistics start the first step with rank 0's."""
    model = models.seeded(0, SharedNorm)
    with torch.no_grad():
        model.norm.running_mean.fill_(ctx.rank)
        model.norm.num_batches_tracked.fill_(7 * ctx.rank)
    p = plan("gpipe", workers=ctx.world_size, stages=2, ties=tie_map([model.first, model.second]))
    ProgramExecutor([model.first, model.second], p.programs, timeout=60,
                    channels=shared_channels(ctx.world_size))
    return statistics(model)


def test_construction_broadcasts_rank0_statistics(worlds) -> None:
    results = worlds.get(2).run(broadcast_check)
    assert torch.equal(results[0]["norm.running_mean"], torch.zeros(6))
    for name, value in results[0].items():
        assert torch.equal(results[1][name], value), name


def error_check(ctx: WorkerContext) -> dict[str, str]:
    """SyncBatchNorm: refused before any collective, on every rank. A module called twice in one
    stage forward: the rank running it fails naming it, every rank gets a RuntimeFault."""
    p = plan("gpipe", workers=ctx.world_size)
    out = {}
    sync = [nn.Sequential(nn.Linear(5, 5), nn.SyncBatchNorm(5)), nn.Linear(5, 3)]
    try:
        ProgramExecutor(sync, p.programs)
    except RuntimeConfigError as exc:
        assert isinstance(exc, GschedError)
        out["sync"] = str(exc)
    stages = [nn.Linear(5, 5), nn.Sequential(Twice(), nn.Linear(5, 3))]
    ex = ProgramExecutor(stages, p.programs, timeout=30)
    batch = models.seeded(3, lambda: {b: (torch.randn(4, 5), torch.randint(0, 3, (4,)))
                                      for b in range(p.micro)})
    try:
        ex.step({b: ((x,), {}) for b, (x, _) in batch.items()}, loss_of(batch))
    except RuntimeFault as fault:
        out["twice"] = str(fault)
    ex.close()
    out["nbt"] = str(int(stages[1][0].norm.num_batches_tracked))  # put back after the failure
    return out


def test_module_called_from_two_stages(worlds) -> None:
    for schedule in ("gpipe", "fsdp"):
        for rank, bad in enumerate(worlds.get(2).run(shared_check, schedule)):
            assert not bad, f"{schedule} rank {rank}: {bad}"


def test_unsupported_norms_fail_clearly(worlds) -> None:
    results = worlds.get(2).run(error_check)
    for r in results:
        assert "stage 0 contains nn.SyncBatchNorm (1)" in r["sync"], r["sync"]
        assert "Use nn.BatchNorm1d/2d/3d instead" in r["sync"]
        assert r["nbt"] == "0"
    assert "BatchNorm1d in stage 1 ran twice in one forward" in results[1]["twice"]
    assert results[1]["twice"].startswith("rank 1 failed at 'F s1 b0'")
    assert "First failure reported in the job: rank 1 failed" in results[0]["twice"]


# --------------------------------------------------------------------------- Lightning

GLOBAL_BATCH = 32  # 4 microbatches of ROWS rows


def lightning_data() -> tuple[torch.Tensor, torch.Tensor]:
    rows = GLOBAL_BATCH * STEPS
    return models.seeded(21, lambda: (torch.randn(rows, 3, 8, 8),
                                      torch.randint(0, CLASSES, (rows,))))


def fit_check(ctx: WorkerContext, schedule: str) -> dict[str, torch.Tensor]:
    from lightning_gsched import GeneralParallel
    from lightning_models import as_worker, rank_loader, state_of, trainer

    as_worker(ctx.rank)
    model = models.make_bn_lightning(lr=LR)
    fit = trainer(ctx.world_size, GeneralParallel(schedule), max_steps=STEPS)
    fit.fit(model, rank_loader(lightning_data(), GLOBAL_BATCH, ctx.world_size, ctx.rank))
    return state_of(model)


def lightning_reference(micro: int) -> dict[str, torch.Tensor]:
    """What one device does with the microbatches GeneralParallel cuts: global batch i is rows
    [i*G, (i+1)*G), cut into B equal pieces in order; loss / B accumulated; one SGD step."""
    model = models.make_bn_lightning(lr=LR)
    model.train()
    optimizer = model.configure_optimizers()
    x, y = lightning_data()
    for i in range(STEPS):
        optimizer.zero_grad()
        rows = slice(i * GLOBAL_BATCH, (i + 1) * GLOBAL_BATCH)
        for xb, yb in zip(x[rows].chunk(micro), y[rows].chunk(micro), strict=True):
            (model.training_step((xb, yb), i) / micro).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("schedule", ["gpipe", "fslpp"])
def test_lightning_fit_matches_one_device(worlds, schedule: str) -> None:
    from lightning_models import assert_same_state

    want = lightning_reference(plan(schedule, workers=2).micro)
    for rank, state in enumerate(worlds.get(2).run(fit_check, schedule)):
        assert_same_state(state, want, f"{schedule} rank {rank}")


def sync_batchnorm_check(ctx: WorkerContext) -> str:
    from lightning_gsched import GeneralParallel
    from lightning_gsched.errors import StrategyConfigError
    from lightning_models import as_worker, rank_loader, trainer

    as_worker(ctx.rank)
    fit = trainer(ctx.world_size, GeneralParallel("gpipe"), max_steps=1, sync_batchnorm=True)
    try:
        fit.fit(models.make_bn_lightning(),
                rank_loader(lightning_data(), GLOBAL_BATCH, ctx.world_size, ctx.rank))
    except StrategyConfigError as exc:
        return str(exc)
    return "no error"


def test_lightning_sync_batchnorm_is_refused(worlds) -> None:
    """Trainer(sync_batchnorm=True) fails at setup on every rank instead of being ignored."""
    for message in worlds.get(2).run(sync_batchnorm_check):
        assert message.startswith("Trainer(sync_batchnorm=True) is not supported"), message


# --------------------------------------------------------------------------- W = 4


@pytest.mark.parametrize("schedule", W4_SCHEDULES)
def test_statistics_match_one_device_w4(worlds, schedule: str) -> None:
    check_schedule(worlds.get(4).run(schedule_check, schedule), schedule)
