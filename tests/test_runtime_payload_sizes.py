"""Payload receives posted early at the size of the last step, and what happens when it changes.

From the second step of the same programs on, the runtime posts every activation / gradient
payload receive together with its header, at the size the same message had last step (see
``lightning_gsched.runtime.transport``). These checks run real steps whose microbatch shapes
change between steps and compare every step with a single-process reference computed on the
same rank, so a payload landing in the wrong buffer or on the wrong channel would show.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import models
from dist_harness import WorkerContext
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
    bad, late = [], []
    for step, rows in enumerate(rows_per_step):
        batch = batch_of(rows, p.micro, seed=step + 1)
        result = ex.step({b: ((x,), {}) for b, (x, _) in batch.items()}, loss_against(batch))
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
        late.append(ex.transport.late_payloads)
    ex.close()
    return {"bad": bad, "late": late}


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved"])
def test_shapes_changing_between_steps_stay_exact(worlds, schedule):
    rows = [2, 2, 1, 1, 3, 2]
    results = worlds.get(2).run(changing_shapes_check, schedule, rows)
    for rank, r in enumerate(results):
        assert not r["bad"], f"rank {rank}: {r['bad']}"
        late = r["late"]
        # first step: nothing expected yet; second: same shapes, every payload as expected
        assert late[0] == 0 and late[1] == 0
        # a shape change sends (and receives) each payload late once, then expectations adapt
        assert late[2] > 0 and late[3] == late[2]
        assert late[4] > late[3] and late[5] > late[4]
