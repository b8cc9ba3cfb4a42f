"""Resuming a model built without weights from a checkpoint: each rank restores only its own.

Lightning restores a checkpoint before the first batch, while a deferred model's parameters are
still on the meta device (a copy into them is a no-op), so the strategy applies the checkpoint at
the build, to the parameters each rank keeps (the checkpoint service's DeferredRestore,
engine/checkpoint_sharded.py). Checked at W=2, against Lightning's own single-process resume (fit 2 steps, save, resume for 2 more) in the same
test:

* a sharded checkpoint (torch.distributed.checkpoint) saved under fsdp resumes under 1f1b into a
  deferred model, and each rank's ``dcp.load`` asks only for its kept parameters, their
  optimizer state and the buffers;
* a full checkpoint resumes into a deferred model under fsdp, memory-mapped on every rank
  (``torch.load(mmap=True)``: each rank reads the pages of what it applies, its kept
  parameters and their optimizer state, not the whole file);
* the trained weights (and SGD momentum, through them) equal the reference's
  (``assert_same_state``), also when ``init_weights`` names other weights (the checkpoint wins);
* the model holds a module without ``reset_parameters()`` (as transformers' norms are): the
  checkpoint fills its parameter, so nothing is drawn for it (it was refused, asking for a
  ``reset_parameters()`` the restore never needed; found by probing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dist_harness import WorkerContext
from lightning_models import as_worker, assert_same_state, rank_loader, trainer
from test_lightning_pretrained import DIM, LitNet, save

pytestmark = pytest.mark.distributed
WORLD_TIMEOUT = 180.0  # seconds per check: whole Trainer fits

SEED = 11
GLOBAL_BATCH, FIRST, TOTAL = 8, 2, 4


class Gain(nn.Module):
    """A parameter of its own and no ``reset_parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Parameter(torch.ones(1))


class LitGainNet(LitNet):
    def __init__(self) -> None:
        super().__init__()
        self.gain = Gain()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x) * self.gain.value


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(GLOBAL_BATCH * 6, DIM, generator=g)
    return x, x.sum(-1, keepdim=True).cos()


def save_on_worker(ctx: WorkerContext, options: dict, path: str) -> None:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    torch.manual_seed(SEED)
    model = LitGainNet()  # built with weights
    fit = trainer(ctx.world_size, GeneralParallel(**options), max_steps=FIRST)
    fit.fit(model, rank_loader(data(), GLOBAL_BATCH, ctx.world_size, ctx.rank))
    fit.save_checkpoint(path)


def resume_deferred_on_worker(ctx: WorkerContext, options: dict, path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    torch.manual_seed(SEED + 1)  # initialisation must not matter: the checkpoint wins
    read: list[str] = []
    original = dcp.load

    def counted(state_dict: dict, *args: Any, **kwargs: Any) -> Any:
        read.extend(state_dict)
        return original(state_dict, *args, **kwargs)

    loads: list[bool] = []
    torch_load = torch.load

    def mapped(f: Any, *args: Any, **kwargs: Any) -> Any:
        if str(f) == path:
            loads.append(bool(kwargs.get("mmap")))
        return torch_load(f, *args, **kwargs)

    dcp.load = counted
    torch.load = mapped
    try:
        fit = trainer(ctx.world_size, GeneralParallel(**options), max_steps=TOTAL)
        with fit.init_module():
            model = LitGainNet()
        assert all(p.is_meta for p in model.parameters())
        fit.fit(model, rank_loader(data(), GLOBAL_BATCH, ctx.world_size, ctx.rank),
                ckpt_path=path)
    finally:
        dcp.load = original
        torch.load = torch_load
    kept = {n: p.detach().clone() for n, p in model.named_parameters()
            if not p.is_meta and p.numel() > 0}
    return {"kept": kept, "read": read, "all": [n for n, _ in model.named_parameters()],
            "step": fit.global_step, "mapped": loads}


def reference(tmp: Path) -> dict[str, torch.Tensor]:
    """Lightning's single-process resume: 2 steps, save, 2 more from the checkpoint."""
    torch.manual_seed(SEED)
    model = LitGainNet()
    fit = trainer(1, "auto", max_steps=FIRST)
    fit.fit(model, rank_loader(data(), GLOBAL_BATCH, 1, 0))
    fit.save_checkpoint(tmp / "reference.ckpt")
    resumed = LitGainNet()
    fit = trainer(1, "auto", max_steps=TOTAL)
    fit.fit(resumed, rank_loader(data(), GLOBAL_BATCH, 1, 0), ckpt_path=tmp / "reference.ckpt")
    return {n: p.detach().clone() for n, p in resumed.named_parameters()}



@pytest.mark.parametrize("saved,resumed", [
    ({"schedule": "fsdp", "state_dict_type": "sharded"},
     {"schedule": "1f1b", "state_dict_type": "sharded"}),
    ({"schedule": "fsdp"}, {"schedule": "fsdp"}),
], ids=["sharded-fsdp-1f1b", "full-fsdp-fsdp"])
def test_a_deferred_model_resumes_reading_only_its_own(world, tmp_path: Path, saved: dict,
                                                       resumed: dict) -> None:
    want = reference(tmp_path)
    sharded = saved.get("state_dict_type") == "sharded"
    path = str(tmp_path / ("dir" if sharded else "full.ckpt"))
    world.run(save_on_worker, saved, path)
    if sharded:  # a resumed checkpoint wins over pretrained weights (other values)
        pretrained, prefix, _ = save(tmp_path, "single")
        resumed = {**resumed, "init_weights": pretrained, "init_weights_prefix": prefix}
    results = world.run(resume_deferred_on_worker, resumed, path)
    buffers = {n for n, _ in LitGainNet().named_buffers()}
    seen: set[str] = set()
    for rank, got in enumerate(results):
        assert got["step"] == TOTAL
        kept = set(got["kept"])
        assert kept and kept != set(got["all"]), f"rank {rank} keeps {sorted(kept)}"
        assert_same_state(got["kept"], {n: want[n] for n in kept}, f"rank {rank}")
        if sharded:  # the tensors this rank asked the directory for
            model_keys = {k[len("model."):] for k in got["read"] if k.startswith("model.")}
            assert model_keys == kept | buffers, f"rank {rank} read {sorted(model_keys)}"
            optim = {k.split(".", 2)[2].rsplit(".", 1)[0] for k in got["read"]
                     if k.startswith("optim.")}
            assert optim == kept, f"rank {rank} read optimizer state of {sorted(optim)}"
        else:
            assert got["read"] == []
            assert got["mapped"] == [True], f"rank {rank} read the full checkpoint {got['mapped']}"
        seen |= kept
    assert seen == set(want)


def test_a_checkpoint_without_a_kept_parameter_is_refused_naming_it() -> None:
    from lightning_gsched.engine.checkpoint_sharded import (
        DeferredRestore,
        DeferredRestoreError,
    )

    model = LitNet()
    state = {k: v for k, v in model.state_dict().items() if k != "model.out.bias"}
    with pytest.raises(DeferredRestoreError, match="'model.out.bias' is not in the checkpoint"):
        DeferredRestore(state_dict=state).apply(model, list(model.parameters()), [])
    model_keys = {k for k in model.state_dict() if "shift" not in k}
    with pytest.raises(DeferredRestoreError, match="buffer 'model.blocks.0.shift'"):
        DeferredRestore(state_dict={k: model.state_dict()[k] for k in model_keys}).apply(
            model, list(model.parameters()), [])
