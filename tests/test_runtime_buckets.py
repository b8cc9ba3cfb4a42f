"""Bucketed all-reduce started during the last backward: same gradients, really overlapped."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import models
from dist_harness import WorkerContext
from lightning_gsched.partition import partition
from lightning_gsched.runtime import ProgramExecutor, buckets
from lightning_gsched.runtime.buckets import bucket_ranges
from lightning_gsched.schedule import plan
from tie_helpers import held_parameters, with_ties

pytestmark = pytest.mark.distributed
VOCAB = 64


def test_bucket_ranges_cover_every_parameter_once_last_first():
    sizes = [10, 300, 5, 200, 7]
    offsets = [0, 16, 320, 336, 544]
    got = bucket_ranges(sizes, offsets, element_size=4, cap=800)
    members = [i for _, _, m in got for i in m]
    assert sorted(members) == list(range(5)) and members[0] == 4  # backward order: last first
    for start, end, m in got:
        assert start == min(offsets[i] for i in m) and end == max(offsets[i] + sizes[i] for i in m)
        closed_early = sum(sizes[i] * 4 for i in m[:-1])
        assert closed_early < 800  # a bucket closes at the first parameter that reaches the cap
    assert len(got) == 3


def overlap_check(ctx: WorkerContext, schedule: str, cap: int, steps: int) -> dict[str, Any]:
    buckets.BUCKET_BYTES = cap
    p = plan(schedule, workers=ctx.world_size)
    model = models.make_gpt(seed=0, vocab=VOCAB)
    reference = models.make_gpt(seed=0, vocab=VOCAB)
    gen = torch.Generator().manual_seed(5)
    batch = {b: (torch.randint(0, VOCAB, (2, 8), generator=gen),
                 torch.randint(0, VOCAB, (2, 8), generator=gen)) for b in range(p.micro)}
    part = partition(model, p.stages, example_args=(batch[0][0],))
    p = with_ties(p, part)
    ex = ProgramExecutor(part.stages, p.programs, timeout=60)

    def loss_fn(output: Any, b: int) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, VOCAB), batch[b][1].reshape(-1))

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    bad = []
    names = {id(q): n for n, q in model.named_parameters()}
    ref = dict(reference.named_parameters())
    owned = held_parameters(ex)
    for step in range(steps):
        opt.zero_grad()
        ex.record_compute_times(step == steps - 1)  # the in-run profile of the last step
        result = ex.step({b: ((x,), {}) for b, (x, _) in batch.items()}, loss_fn)
        ref_opt.zero_grad()
        for x, y in batch.values():
            (F.cross_entropy(reference(x).reshape(-1, VOCAB), y.reshape(-1)) / p.micro).backward()
        for q in owned:
            if not torch.allclose(q.grad, ref[names[id(q)]].grad, rtol=1e-5, atol=1e-6):
                bad.append(f"step {step} {names[id(q)]}")
        opt.step()
        ref_opt.step()
    from lightning_gsched.schedule import Op

    wanted: dict = {}
    for a in ex.program:
        if a.op in (Op.F, Op.B):
            key = (a.op.value, a.stage)
            wanted[key] = wanted.get(key, 0) + 1
    recorded = {k: len(v) for k, v in ex.compute_times().items()}
    positive = all(t > 0 for v in ex.compute_times().values() for t in v)
    early = sum(g.started_during_backward for _, plan_ in ex._overlap.values() for g in plan_.values())
    planned = {k: getattr(p.metrics.per_worker[ctx.rank], k) for k in result.counters.PLANNED}
    out = {"bad": bad, "early": early, "profile_ok": recorded == wanted and positive, "counters_match": result.counters.planned() == planned,
           "hooks_left": sum(len(q._post_accumulate_grad_hooks or {}) for q in model.parameters())}
    ex.close()
    return out


@pytest.mark.parametrize("schedule,W", [("ddp", 2), ("lpp", 4)])
def test_bucketed_all_reduce_equals_single_process(worlds, schedule, W):
    results = worlds.get(W).run(overlap_check, schedule, 2048, 3)
    for rank, r in enumerate(results):
        assert not r["bad"], f"rank {rank}: {r['bad']}"
        assert r["counters_match"]
        assert r["hooks_left"] == 0
        assert r["profile_ok"]  # one duration per F/B of the profiled step, keyed by stage
    # with 2 KiB buckets some reductions start before the backward has finished
    assert all(r["early"] > 0 for r in results)
