"""``fabric.save`` streams a deferred model's full checkpoint to rank 0, never gathers it.

``GeneralParallelFabric(stream_checkpoint=...)`` (``"auto"``: for a model built without weights,
``fabric.init_module()``), as the Trainer strategy's (tests/test_checkpoint_stream.py): Fabric's
conversion of ``state`` returns placeholders for the model and optimizer, then every rank sends
its tensors one weight unit (one optimizer tensor) at a time and rank 0 writes each into the file
as it arrives (engine/checkpoint_files.py, runtime/fullstate.py). Checked at W=2 on a deferred
fsdp GPT (SGD with momentum), after 2 steps of one run:

* the streamed file loads with plain ``torch.load(weights_only=True)`` and equals, exactly, the
  file the same run writes with ``stream_checkpoint=False`` (model, optimizer, other entries);
* a user's CheckpointIO is handed the real checkpoint (the streamed tensors collected);
* ``fabric.load`` of the streamed file into a fresh deferred model, then step 3, ends at the
  weights of the uninterrupted run (test_fabric.resume_schedule).
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_harness import WorkerContext
from lightning_models import assert_same_state
from models import make_gpt
from test_checkpoint_stream import assert_equal_tree
from test_fabric import (
    LR,
    SAVED_AT,
    WORLD,
    global_batches,
    pipelined_fabric,
    resume_schedule,
    share,
    train,
)

pytestmark = pytest.mark.distributed
WORLD_TIMEOUT = 120.0  # seconds per check (conftest.worlds)


def save_three_ways(ctx: WorkerContext, streamed: str, gathered: str, users: str
                    ) -> dict[str, Any]:
    """A deferred fsdp run: 2 steps, the same state saved streamed ("auto"), gathered
    (``stream_checkpoint=False``) and through a user's CheckpointIO, then step 3."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class UsersIO(TorchCheckpointIO):
        """A user's CheckpointIO: the strategy hands it the real checkpoint."""

    fabric = pipelined_fabric(ctx, "fsdp")
    strategy = fabric.strategy
    with fabric.init_module():
        built = make_gpt(0)
    assert all(p.is_meta for p in built.parameters())
    model, optimizer = fabric.setup(
        built, torch.optim.SGD(built.parameters(), lr=LR, momentum=0.9))
    batches = [share(b, ctx.rank, ctx.world_size) for b in global_batches()]
    train(fabric, model, optimizer, batches[:SAVED_AT], pipelined=True)
    # the optimizer first: Fabric converts in the user's key order
    state = {"optimizer": optimizer, "model": model, "step": SAVED_AT}
    fabric.save(streamed, state)
    stats = strategy.checkpoint_stream_stats
    strategy.stream_checkpoint = False
    fabric.save(gathered, state)
    strategy.stream_checkpoint, io = "auto", strategy.checkpoint_io
    strategy.checkpoint_io = UsersIO()
    try:
        fabric.save(users, state)
    finally:
        strategy.checkpoint_io = io
    losses = train(fabric, model, optimizer, batches[SAVED_AT:], pipelined=True)
    named = dict(model.module.named_parameters())
    held = {n for n, p in named.items() if not p.is_meta and p.numel() > 0}
    return {"records": stats.records if stats is not None else None, "losses": losses,
            "held": held, "weights": {n: named[n].detach().clone() for n in held}}


def test_fabric_streams_a_deferred_checkpoint_and_resumes_from_it(worlds,
                                                                  tmp_path: Path) -> None:
    streamed, gathered = str(tmp_path / "streamed.ckpt"), str(tmp_path / "gathered.ckpt")
    users = str(tmp_path / "users_io.ckpt")
    world = worlds.get(WORLD)
    results = world.run(save_three_ways, streamed, gathered, users)
    assert results[0]["records"] > 0  # rank 0 wrote tensors as they arrived
    assert results[1]["records"] is None
    # written by two paths: torch.save's archive has .format_version, the streamed one not
    assert [_has_format_version(p) for p in (streamed, gathered, users)] == [False, True, True]

    want = torch.load(gathered, weights_only=True)
    got = torch.load(streamed, weights_only=True)
    assert set(got) == {"model", "optimizer", "step"} and got["step"] == SAVED_AT
    assert_equal_tree(got, want, "streamed")
    assert any(entry.get("momentum_buffer") is not None
               for entry in got["optimizer"]["state"].values())
    assert_equal_tree(torch.load(users, weights_only=True), want, "users_io")

    resumed = world.run(resume_schedule, "fsdp", streamed, False, True)
    for rank, (run, again) in enumerate(zip(results, resumed, strict=True)):
        label = f"resumed fsdp rank {rank}"
        assert again["step"] == SAVED_AT
        assert again["held"] == run["held"], label
        assert_same_state(again["weights"], run["weights"], label)
        assert again["losses"] == pytest.approx(run["losses"], rel=1e-5), label


def _has_format_version(path: str) -> bool:
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("/.format_version") for name in archive.namelist())


def test_stream_checkpoint_is_checked_at_construction() -> None:
    from lightning_gsched.errors import StrategyConfigError
    from lightning_gsched.fabric import GeneralParallelFabric

    with pytest.raises(StrategyConfigError, match="stream_checkpoint='yes'"):
        GeneralParallelFabric(stream_checkpoint="yes")
    assert GeneralParallelFabric(stream_checkpoint=False).stream_checkpoint is False
