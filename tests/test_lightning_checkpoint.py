"""Checkpoints under GeneralParallel: full and sharded, exact resume, resume across schedules.

Reference semantics are Lightning's own: a single-process Trainer that stops after 2 steps,
saves, and resumes with ``ckpt_path=`` for 2 more (Lightning restarts the DataLoader on a
mid-epoch resume, so this is compared with that, not with an uninterrupted run). The distributed
runs save under one schedule (and worker count) and resume under another; final weights and the
logged losses of the resumed steps must equal the reference's.
"""

from __future__ import annotations

import functools
import os
import tempfile
from typing import Any

import pytest
import torch

from dist_harness import WorkerContext
from lightning_models import (
    LitGPT,
    as_worker,
    assert_same_state,
    csv_metric,
    make_lit_gpt,
    rank_loader,
    state_of,
    tokens,
    trainer,
)

pytestmark = pytest.mark.distributed

GLOBAL_BATCH, FIRST, TOTAL = 8, 2, 4
RTOL, ATOL = 1e-5, 1e-6  # Adam state comparison below

WORLD_TIMEOUT = 300.0  # seconds per check: whole Trainer fits (conftest.worlds)


def _fit(world: int, rank: int, strategy: Any, tmp: str, steps: int, ckpt: str | None) -> Any:
    model = make_lit_gpt(optimizer="adam")
    data = tokens(GLOBAL_BATCH * 6)
    fit = trainer(world, strategy, tmp, max_steps=steps, gradient_clip_val=0.5)
    fit.fit(model, rank_loader(data, GLOBAL_BATCH, world, rank), ckpt_path=ckpt)
    return fit, model


def save_on_worker(ctx: WorkerContext, options: dict, tmp: str, path: str) -> dict:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    fit, model = _fit(ctx.world_size, ctx.rank, GeneralParallel(**options), tmp, FIRST, None)
    fit.save_checkpoint(path)
    return state_of(model)


def resume_on_worker(ctx: WorkerContext, options: dict, tmp: str, path: str) -> dict:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    _, model = _fit(ctx.world_size, ctx.rank, GeneralParallel(**options), tmp, TOTAL, path)
    return state_of(model)


def fit_with_model_checkpoint(world: int, rank: int, strategy: Any, tmp: str) -> list:
    """ModelCheckpoint(monitor="train_loss") inside fit: every rank must agree on the value."""
    import lightning.pytorch as pl

    model = make_lit_gpt(optimizer="adam")
    data = tokens(GLOBAL_BATCH * 6)
    saver = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(tmp, "ckpt"), monitor="train_loss",
                                         every_n_train_steps=1, save_top_k=2)
    fit = trainer(world, strategy, tmp, max_steps=3, enable_checkpointing=True,
                  callbacks=[saver])
    fit.fit(model, rank_loader(data, GLOBAL_BATCH, world, rank))
    return sorted(os.listdir(os.path.join(tmp, "ckpt"))) + [float(saver.best_model_score)]


def model_checkpoint_on_worker(ctx: WorkerContext, options: dict, tmp: str) -> list:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    return fit_with_model_checkpoint(ctx.world_size, ctx.rank, GeneralParallel(**options), tmp)


@functools.lru_cache(maxsize=None)
def reference() -> tuple[dict, dict, list]:
    """(state after FIRST steps, state after resuming to TOTAL, logged losses of the resume)."""
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "first.ckpt")
    fit, model = _fit(1, 0, "auto", os.path.join(tmp, "a"), FIRST, None)
    fit.save_checkpoint(path)
    first = state_of(model)
    _, model = _fit(1, 0, "auto", os.path.join(tmp, "b"), TOTAL, path)
    return first, state_of(model), csv_metric(os.path.join(tmp, "b"), "train_loss")


@pytest.mark.parametrize(
    "saved, resumed",
    [({"schedule": "fslpp"}, {"schedule": "fslpp"}),
     ({"schedule": "zbv"}, {"schedule": "1f1b"}),
     ({"schedule": "fsdp", "state_dict_type": "sharded"}, {"schedule": "1f1b"}),
     ({"schedule": "interleaved", "state_dict_type": "sharded"},
      {"schedule": "lpp", "state_dict_type": "sharded"})],
    ids=["fslpp-fslpp", "zbv-1f1b", "fsdp_sharded-1f1b", "interleaved_sharded-lpp_sharded"],
)
def test_resume_is_exact_across_schedules(worlds, saved: dict, resumed: dict, tmp_path) -> None:
    first, final, resumed_log = reference()
    world = worlds.get(2)
    suffix = "dir" if saved.get("state_dict_type") == "sharded" else "ckpt"
    path = str(tmp_path / f"first.{suffix}")
    states = world.run(save_on_worker, saved, str(tmp_path / "a"), path)
    for rank, state in enumerate(states):
        assert_same_state(state, first, f"after {FIRST} steps, rank {rank}")
    assert os.path.isdir(path) == (suffix == "dir")
    states = world.run(resume_on_worker, resumed, str(tmp_path / "b"), path)
    for rank, state in enumerate(states):
        assert_same_state(state, final, f"resumed, rank {rank}")
    got_log = csv_metric(str(tmp_path / "b"), "train_loss")
    assert [s for s, _ in got_log] == [s for s, _ in resumed_log]
    assert [v for _, v in got_log] == pytest.approx([v for _, v in resumed_log], rel=1e-5)


def test_full_checkpoint_loads_in_one_process(worlds, tmp_path) -> None:
    first, _, _ = reference()
    world = worlds.get(2)
    path = str(tmp_path / "first.ckpt")
    world.run(save_on_worker, {"schedule": "fsdp"}, str(tmp_path / "a"), path)
    loaded = LitGPT.load_from_checkpoint(path, map_location="cpu")
    assert_same_state(state_of(loaded), first, "load_from_checkpoint")
    raw = torch.load(path, weights_only=False, map_location="cpu")
    n_params = sum(1 for _ in loaded.parameters())
    assert len(raw["optimizer_states"][0]["state"]) == n_params  # every parameter's Adam state


def test_resume_on_more_workers(worlds, tmp_path) -> None:
    _, final, _ = reference()
    path = str(tmp_path / "first.ckpt")
    worlds.get(2).run(save_on_worker, {"schedule": "gpipe"}, str(tmp_path / "a"), path)
    states = worlds.get(4).run(resume_on_worker, {"schedule": "fslpp", "R": 2},
                               str(tmp_path / "b"), path)
    for rank, state in enumerate(states):
        assert_same_state(state, final, f"resumed on 4 workers, rank {rank}")


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_model_checkpoint_during_fit_matches_single_device(worlds, state_dict_type: str,
                                                           tmp_path) -> None:
    from lightning_gsched.engine import sharded

    want = fit_with_model_checkpoint(1, 0, "auto", str(tmp_path / "single"))
    options = {"schedule": "fslpp", "state_dict_type": state_dict_type}
    results = worlds.get(4).run(model_checkpoint_on_worker, options, str(tmp_path / "ours"))
    for r in results:  # same files, and the same best score on every rank
        assert r[:-1] == want[:-1]
        assert r[-1] == results[0][-1] == pytest.approx(want[-1], rel=1e-6)
    for name in want[:-1]:
        expected = torch.load(tmp_path / "single" / "ckpt" / name, weights_only=False)
        path = tmp_path / "ours" / "ckpt" / name
        assert path.is_dir() == (state_dict_type == "sharded")
        got = sharded.load(path) if path.is_dir() else torch.load(path, weights_only=False)
        assert got["global_step"] == expected["global_step"]
        assert_same_state(got["state_dict"], expected["state_dict"], name)
        got_adam = got["optimizer_states"][0]["state"]
        want_adam = expected["optimizer_states"][0]["state"]
        assert got_adam.keys() == want_adam.keys()
        for index in want_adam:
            for key in want_adam[index]:
                torch.testing.assert_close(got_adam[index][key], want_adam[index][key],
                                           rtol=RTOL, atol=ATOL)
