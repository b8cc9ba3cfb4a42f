"""The transport: described steps, bare-tensor (fast) steps, and a shape that changes anyway.

Every message's spec is exchanged on the first step of a (programs, step signature) pair and
remembered by both ends; later steps with that signature send bare tensors into receives posted
at the remembered shapes (``lightning_gsched.runtime.transport``). These checks run real steps
and compare each with a single-process reference computed in the same worker, so a tensor
landing in the wrong buffer, a spec read from the wrong step or a lost aliasing would show. The
gradients are compared with rtol 1e-5: both sides run the same float32 kernels on the same
values, and only the order of the microbatch sums can differ.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import models
from dist_harness import WorkerContext
from lightning_gsched.errors import MessageShapeError, RuntimeFault
from lightning_gsched.partition import partition
from lightning_gsched.runtime import ProgramExecutor
from lightning_gsched.schedule import plan
from tie_helpers import held_parameters, with_ties

pytestmark = pytest.mark.distributed
VOCAB = 64


def batch_of(rows: int, micro: int, seed: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {b: (torch.randint(0, VOCAB, (rows, 8), generator=gen),
                torch.randint(0, VOCAB, (rows, 8), generator=gen)) for b in range(micro)}


def loss_against(
    batch: dict[int, tuple[torch.Tensor, torch.Tensor]],
) -> Callable[[Any, int], torch.Tensor]:
    """The step's ``loss_fn`` for one batch (bound here, not to the caller's loop variable)."""

    def loss_fn(output: Any, b: int) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, VOCAB), batch[b][1].reshape(-1))

    return loss_fn


def changing_shapes_check(ctx: WorkerContext, schedule: str, rows_per_step: list[int]) -> dict[str, Any]:
    p = plan(schedule, workers=ctx.world_size)
    model = models.make_gpt(seed=0, vocab=VOCAB)
    reference = models.make_gpt(seed=0, vocab=VOCAB)
    example = batch_of(rows_per_step[0], p.micro, 0)[0][0]
    part = partition(model, p.stages, example_args=(example,))
    p = with_ties(p, part)
    ex = ProgramExecutor(part.stages, p.programs, timeout=60)
    names = {id(param): name for name, param in model.named_parameters()}
    ref_params = dict(reference.named_parameters())
    owned = held_parameters(ex)
    bad, described, fast, received = [], [], [], []
    for step, rows in enumerate(rows_per_step):
        batch = batch_of(rows, p.micro, seed=step + 1)
        result = ex.step({b: ((x,), {}) for b, (x, _) in batch.items()}, loss_against(batch))
        fast.append(ex.transport.fast)
        described.append(ex.transport.described_messages)
        received.append(result.counters.bytes_received)
        reference.zero_grad()
        for b, (x, y) in batch.items():
            loss = F.cross_entropy(reference(x).reshape(-1, VOCAB), y.reshape(-1))
            (loss / p.micro).backward()
            if b in result.losses and abs(float(result.losses[b]) - loss.item()) > 1e-5:
                bad.append(f"step {step} loss b{b}")
        for param in owned:
            name = names[id(param)]
            if not torch.allclose(param.grad, ref_params[name].grad, rtol=1e-5, atol=1e-6):
                bad.append(f"step {step} grad {name}")
    ex.close()
    return {"bad": bad, "described": described, "fast": fast, "received": received}


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved"])
def test_shapes_changing_between_steps_stay_exact(worlds, schedule):
    rows = [2, 2, 1, 1, 3, 2]
    results = worlds.get(2).run(changing_shapes_check, schedule, rows)
    for rank, r in enumerate(results):
        assert not r["bad"], f"rank {rank}: {r['bad']}"
        # a new batch shape is described once; a shape seen before (step 5 = step 0) is not
        assert r["fast"] == [False, True, False, True, False, True], (rank, r["fast"])
        described = r["described"]
        assert described[0] > 0 and described[1] == described[0]
        assert described[2] > described[1] and described[3] == described[2]
        assert described[4] > described[3] and described[5] == described[4]
        # fast steps carry the tensors' bytes only: the same rows, the same bytes (0 and 5),
        # and fewer than the described step of the same shape (header and spec)
        received = r["received"]
        assert received[5] == received[1] and received[3] < received[1] < received[4]
        assert received[0] > received[1] and received[2] > received[3]


# --------------------------------------------------------------------------- data-dependent shapes


class Trim(nn.Module):
    """Stage 0: keeps the rows whose first input is positive (a data-dependent shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))[x[:, 0] > 0]


def trim_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Trim(), nn.Linear(4, 3))


def trim_batches() -> list[dict[int, torch.Tensor]]:
    """Three steps of two 4-row microbatches; microbatch 1 keeps 2, then 3, then 1 rows."""
    gen = torch.Generator().manual_seed(5)
    steps = []
    for kept in ([3, 2], [3, 3], [3, 1]):
        step = {}
        for b, k in enumerate(kept):
            x = torch.randn(4, 4, generator=gen)
            x[:, 0] = torch.tensor([1.0] * k + [-1.0] * (4 - k))
            step[b] = x
        steps.append(step)
    return steps


def trim_check(ctx: WorkerContext, transport: str) -> dict[str, Any]:
    p = plan("gpipe", workers=ctx.world_size, microbatches=2)
    stages = list(trim_model())
    reference = trim_model()
    ex = ProgramExecutor(stages, p.programs, timeout=20, transport=transport)
    outcome: dict[str, Any] = {"steps": 0, "bad": []}
    try:
        for xs in trim_batches():
            result = ex.step({b: ((x,), {}) for b, x in xs.items()},
                             lambda out, b: out.square().mean())
            reference.zero_grad()
            for x in xs.values():
                (reference(x).square().mean() / len(xs)).backward()
            mine = [q for s in ex.owned for q in stages[s].parameters()]
            ref = [q for s in ex.owned for q in reference[s].parameters()]
            for got, want in zip(mine, ref, strict=True):
                if not torch.allclose(got.grad, want.grad, rtol=1e-5, atol=1e-7):
                    outcome["bad"].append(outcome["steps"])
            outcome["losses"] = sorted(result.losses)
            outcome["steps"] += 1
    except RuntimeFault as fault:
        outcome.update(error=str(fault), type=type(fault).__name__)
    ex.close()
    return outcome


def test_a_data_dependent_shape_ends_every_rank_with_the_named_error(worlds):
    """Step 1 repeats step 0's signature (same input shapes) but stage 0's output for b1 has 3
    rows instead of 2: rank 0 (the sender) raises MessageShapeError naming the action, the old
    and new shapes and the fix; rank 1, waiting for that tensor, ends quoting it."""
    results = worlds.get(2).run(trim_check, "auto")
    sender, receiver = results
    assert sender["steps"] == 1 and receiver["steps"] == 1, results
    assert sender["type"] == MessageShapeError.__name__, sender
    assert sender["error"].startswith("rank 0 failed at 'SEND_ACT s0 b1 ->1'"), sender["error"]
    assert "[(2, 4) float32]" in sender["error"] and "[(3, 4) float32]" in sender["error"]
    assert 'transport="described"' in sender["error"]
    assert receiver["type"] == "RuntimeFault", receiver
    assert "First failure reported in the job: rank 0 failed at 'SEND_ACT s0 b1 ->1'" in (
        receiver["error"]), receiver["error"]


def test_the_described_transport_runs_data_dependent_shapes(worlds):
    results = worlds.get(2).run(trim_check, "described")
    for r in results:
        assert "error" not in r, r
        assert r["steps"] == 3 and not r["bad"], r
    assert results[1]["losses"] == [0, 1]


def _transport_threads() -> int:
    """This process's gloo transport threads (one per gloo device, each waking every 10 ms)."""
    import os

    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("gloo_tcp_loop")


def shared_device_check(ctx: WorkerContext) -> dict[str, Any]:
    """The engine's two kinds of internal groups (one following the default backend, one for
    host objects) and the strategies' device mesh made, used and timed out."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_gsched.engine.mesh import pipeline_data_mesh
    from lightning_gsched.runtime import gloo_group, new_group
    from lightning_gsched.runtime.gloo_groups import BACKEND

    out: dict[str, Any] = {"before": _transport_threads()}
    span = timedelta(seconds=60)
    world, host = new_group(timeout=span), gloo_group(timeout=span)
    mesh = pipeline_data_mesh("cpu", ctx.world_size, 1)
    out["after"] = _transport_threads()
    out["backends"] = [dist.get_backend(world), dist.get_backend(host)]
    out["mesh_backend"] = dist.get_backend(mesh["data_parallel"].get_group())
    total = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(total, group=world)
    alone = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(alone, group=mesh["data_parallel"].get_group())
    message = torch.zeros(3)
    if ctx.rank == 0:
        dist.send(torch.arange(3.0), 1, group=world, tag=5)
    else:
        dist.recv(message, 0, group=world, tag=5)
    objects: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(objects, f"rank {ctx.rank}", group=host)
    out.update(total=total.item(), alone=alone.item(), message=message.tolist(), objects=objects)
    # a group's own timeout bounds its waits: rank 1 never joins, rank 0's wait ends
    short = new_group(timeout=timedelta(seconds=1))
    if ctx.rank == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=short)
            out["timed_out_after"] = None
        except RuntimeError:
            out["timed_out_after"] = time.monotonic() - start
    dist.barrier(group=world)
    for group in (short, world, host, mesh["data_parallel"].get_group()):
        dist.destroy_process_group(group)
    out["expected_backend"] = BACKEND
    return out


def test_the_engines_groups_share_the_default_groups_transport_thread(worlds):
    """The engine's groups on a CPU gloo job, the device mesh's included, are gloo groups on
    the default group's device (``runtime/gloo_groups.py``): they add no transport thread, and
    each still carries its own messages, tags and timeout (the mesh's one-rank group too). The
    strategies' means over them: test_lightning_equivalence (``means_over``)."""
    for rank, out in enumerate(worlds.get(2).run(shared_device_check)):
        assert out["before"] >= 1, out  # the default group's: the count is not vacuous
        assert out["after"] == out["before"], out
        assert out["backends"] == [out["expected_backend"]] * 2, out
        assert out["mesh_backend"] == out["expected_backend"], out
        assert out["total"] == 3.0 and out["alone"] == rank + 1.0, out
        assert out["objects"] == ["rank 0", "rank 1"], out
        if rank == 1:
            assert out["message"] == [0.0, 1.0, 2.0], out
        else:
            assert out["timed_out_after"] is not None and out["timed_out_after"] < 30, out
