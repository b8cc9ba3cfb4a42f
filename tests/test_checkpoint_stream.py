"""A full checkpoint streamed to rank 0 stage by stage and written as it arrives, never gathered.

``GeneralParallel(stream_checkpoint=...)`` (``"auto"``: for a model built without weights):
rank 0 describes the checkpoint with placeholders, then receives one weight unit's buffer (or
one optimizer tensor) at a time and writes it into the ``.ckpt`` zip (engine/checkpoint_files.py,
runtime/fullstate.py). Checked at W=2 on a deferred tied GPT (fsdp, Adam):

* the streamed file loads with plain ``torch.load`` (``weights_only``, ``mmap``) and equals,
  exactly, the file the gathered path writes at the same step (state dict and optimizer
  states); ``save_checkpoint(weights_only=True)`` streams too; ``on_save_checkpoint`` hooks see
  placeholders;
* resuming a deferred model from the streamed file ends at the weights of the uninterrupted run;
* rank 0 held at most one weight unit's bytes at once for the transfer, of a model of several;
* a user's CheckpointIO is handed the real checkpoint (the streamed tensors collected);
* a checkpoint rank 0 cannot write raises ``CheckpointWriteError`` naming the file on rank 0,
  and no rank hangs (the harness's timeout bounds the run).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_harness import RankError, WorkerContext
from lightning_models import LitGPT, as_worker, assert_same_state, rank_loader, tokens, trainer

pytestmark = pytest.mark.distributed
WORLD_TIMEOUT = 180.0  # seconds per check: whole Trainer fits (conftest.worlds)

GLOBAL_BATCH, FIRST, TOTAL = 8, 2, 4  # one epoch is FIRST steps: resuming starts an epoch


def saving_callback(saves: dict[int, list[tuple]], seen: dict) -> Any:
    """Saves ``(path, stream_checkpoint, weights_only[, custom CheckpointIO])`` after the listed
    global steps."""
    import lightning.pytorch as pl
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class UsersIO(TorchCheckpointIO):
        """A user's CheckpointIO: the strategy hands it the real checkpoint."""

    class Save(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            strategy = trainer.strategy
            for path, stream, weights_only, *users_io in saves.get(trainer.global_step, []):
                wanted, io = strategy.stream_checkpoint, strategy.checkpoint_io
                strategy.stream_checkpoint = stream
                if users_io:
                    strategy.checkpoint_io = UsersIO()
                try:
                    trainer.save_checkpoint(path, weights_only=weights_only)
                finally:
                    strategy.stream_checkpoint, strategy.checkpoint_io = wanted, io
                if strategy.checkpoint_stream_stats is not None:
                    seen.setdefault("peaks", []).append(
                        strategy.checkpoint_stream_stats.peak_bytes)
                    strategy.checkpoint_stream_stats = None
            runtime = strategy.engine.runtime if strategy.engine is not None else None
            if runtime is not None and "units" not in seen:
                memory = runtime.memory()
                seen["units"] = [*memory.stage_bytes, *memory.tie_bytes.values()]

        def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict) -> None:
            if trainer.is_global_zero:  # other ranks' state dicts are empty
                    seen.setdefault("values", []).append(
                    type(checkpoint["state_dict"]["model.wte.weight"]).__name__)

    return Save()


def fit_on_worker(ctx: WorkerContext, saves: dict, ckpt_path: str | None = None,
                  steps: int = TOTAL) -> dict:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    torch.manual_seed(0)
    seen: dict = {}
    fit = trainer(ctx.world_size, GeneralParallel("fsdp", stages=4), max_steps=steps,
                  callbacks=[saving_callback(saves, seen)])
    with fit.init_module():
        model = LitGPT(optimizer="adam", tie="module")
    assert all(p.is_meta for p in model.parameters())
    fit.fit(model, rank_loader(tokens(GLOBAL_BATCH * FIRST), GLOBAL_BATCH, ctx.world_size,
                               ctx.rank), ckpt_path=ckpt_path)
    return seen


def assert_equal_tree(got: Any, want: Any, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got)}"
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), f"{where} differs"
    elif isinstance(want, dict):
        assert set(got) == set(want), f"{where}: {sorted(got)} != {sorted(want)}"
        for key in want:
            assert_equal_tree(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_equal_tree(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def test_streamed_checkpoint_equals_the_gathered_one_and_resumes(world, tmp_path: Path) -> None:
    streamed, gathered = str(tmp_path / "streamed.ckpt"), str(tmp_path / "gathered.ckpt")
    weights, users = str(tmp_path / "weights.ckpt"), str(tmp_path / "users_io.ckpt")
    final_a, final_b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    saves = {FIRST: [(streamed, "auto", False), (gathered, False, False),
                     (weights, True, True), (users, True, False, True)],
             TOTAL: [(final_a, True, False)]}
    results = world.run(fit_on_worker, saves)
    seen = results[0]

    # a plain torch.save archive: every loader reads it, equal to the gathered file
    want = torch.load(gathered, weights_only=True)
    for kwargs in ({}, {"weights_only": True}, {"mmap": True}, {"mmap": True,
                                                                  "weights_only": True}):
        got = torch.load(streamed, **kwargs)
        assert_equal_tree(got["state_dict"], want["state_dict"], f"state_dict {kwargs}")
        assert_equal_tree(got["optimizer_states"], want["optimizer_states"],
                          f"optimizer_states {kwargs}")
        assert got["global_step"] == want["global_step"] == FIRST
    got = torch.load(streamed, weights_only=True)
    tied = got["state_dict"]
    assert tied["model.wte.weight"] is tied["model.head.weight"]  # one record
    assert any(entry.get("exp_avg") is not None
               for entry in got["optimizer_states"][0]["state"].values())
    only = torch.load(weights, weights_only=True)
    assert "optimizer_states" not in only
    assert_equal_tree(only["state_dict"], want["state_dict"], "weights_only state_dict")
    # a user's CheckpointIO gets the streamed tensors collected into a real checkpoint
    assert_equal_tree(torch.load(users, weights_only=True)["optimizer_states"],
                      want["optimizer_states"], "users_io optimizer_states")
    assert_equal_tree(torch.load(users, weights_only=True)["state_dict"], want["state_dict"],
                      "users_io state_dict")
    # hooks see placeholders when streaming ("auto" on a deferred model), tensors when not
    assert seen["values"][:3] == ["StreamedTensor", "Tensor", "StreamedTensor"], seen["values"]

    # rank 0 held at most one weight unit at once, of a model of several
    units = seen["units"]
    assert len(units) >= 3, units
    assert seen["peaks"] and max(seen["peaks"]) <= max(units), (seen["peaks"], units)
    assert max(seen["peaks"]) < sum(units) / 2, (seen["peaks"], units)

    # resuming from the streamed file ends where the uninterrupted run did
    world.run(fit_on_worker, {TOTAL: [(final_b, True, False)]}, streamed)
    a, b = torch.load(final_a, weights_only=True), torch.load(final_b, weights_only=True)
    assert b["global_step"] == TOTAL
    assert_same_state(b["state_dict"], a["state_dict"], "resumed from the streamed checkpoint")


def test_an_unwritable_checkpoint_fails_on_rank_0_naming_it_and_nothing_hangs(
        world, tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    path = str(blocker / "x.ckpt")
    results = world.run(fit_on_worker, {1: [(path, True, False)]}, None, 1, expect_errors=True)
    error = results[0]
    assert isinstance(error, RankError), error
    assert error.type_name == "CheckpointWriteError", error
    assert path in error.message, error.message
    assert not os.path.exists(path)
