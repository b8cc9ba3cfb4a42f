"""Checkpoints under GeneralParallel: full and sharded, exact resume, resume across schedules.

Reference semantics are Lightning's own: a single-process Trainer that stops after 2 steps,
saves, and resumes with ``ckpt_path=`` for 2 more (Lightning restarts the DataLoader on a
mid-epoch resume, so this is compared with that, not with an uninterrupted run). The distributed
runs save under one schedule (and worker count) and resume under another; final weights and the
logged losses of the resumed steps must equal the reference's.

Between (pipeline, data parallel) layouts (``data_parallel_size``, replicated or sharded) the
checkpoints are saved at an epoch's end instead, so a chain of saves and resumes is compared
with one uninterrupted single-device run: W=2 -> 2 x 2 (both modes) -> 4 x 1, ddp and fslpp.
"""

from __future__ import annotations

import functools
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from dist_harness import RankError, WorkerContext
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
    """ModelCheckpoint(monitor="train_loss") inside fit: every rank must agree on the value.
    One late block's norm is frozen: a sharded save must hold it too (no rank wrote a frozen
    stage parameter, found by probing)."""
    import lightning.pytorch as pl

    model = make_lit_gpt(optimizer="adam", frozen=("model.blocks.2.ln1",))
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


# ---------------------------------------------------------------- (pipeline, data) layouts

# Checkpoints moving between (P, G) layouts (issue 32, item 8). An epoch here is EPOCH steps and
# every save falls on an epoch's end, so a resumed run reads the batches the uninterrupted run
# reads and must end at its weights (no DataLoader restart mid-epoch). Saves happen inside fit,
# while the pipeline runs, so they go through the owners (after fit every rank holds the
# gathered model again, and the writer no longer depends on the layout).
EPOCH = 2
SAVED_AT, RESUMED_AT, LAST = 2, 4, 6  # steps: the chain of saves and resumes below


class SaveAt(pl.Callback):
    """Saves checkpoints while the pipeline runs: ``{global step: [(state_dict_type, path)]}``
    (on one device, where the strategy has no state_dict_type, only ``"full"``)."""

    def __init__(self, saves: dict[int, list[tuple[str, str]]]) -> None:
        self.saves = saves

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        strategy = trainer.strategy
        for kind, path in self.saves.get(trainer.global_step, []):
            previous = getattr(strategy, "state_dict_type", "full")
            if kind != previous:
                strategy.state_dict_type = kind
            try:
                trainer.save_checkpoint(path)
            finally:
                if kind != previous:
                    strategy.state_dict_type = previous


class Held(pl.Callback):
    """What this rank holds of the module after the last step, before the run ends (and,
    unless the model was built without weights, gathers every stage from its first owner):
    each replica's own copy of its stages."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == trainer.max_steps:
            self.state = {k: v.detach().clone()
                          for k, v in trainer.lightning_module.state_dict().items()
                          if not v.is_meta and v.numel() > 0}


def _layout_fit(world: int, rank: int, strategy: Any, tmp: str, steps: int, ckpt: str | None,
                saves: dict[int, list[tuple[str, str]]], deferred: bool = False) -> Any:
    """Fit to ``steps`` (resuming from ``ckpt``) on EPOCH-step epochs, saving as ``saves``
    says; ``deferred``: the model is built without weights (the checkpoint gives them).
    Returns what the rank held after the last step (:class:`Held`)."""
    held = Held()
    fit = trainer(world, strategy, tmp, max_steps=steps, gradient_clip_val=0.5,
                  callbacks=[SaveAt(saves), held])
    if deferred:
        with fit.init_module(empty_init=True):
            model = LitGPT(optimizer="adam")
    else:
        model = make_lit_gpt(optimizer="adam")
    fit.fit(model, rank_loader(tokens(GLOBAL_BATCH * EPOCH), GLOBAL_BATCH, world, rank),
            ckpt_path=ckpt)
    return held.state


def layout_fit_on_worker(ctx: WorkerContext, options: dict, tmp: str, steps: int,
                         ckpt: str | None, saves: dict, deferred: bool = False) -> dict:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    return _layout_fit(ctx.world_size, ctx.rank, GeneralParallel(**options), tmp, steps, ckpt,
                       saves, deferred)


def assert_held(states: list[dict], want: dict, label: str) -> None:
    """What each rank holds equals ``want``'s entries, and the ranks together hold all."""
    for rank, state in enumerate(states):
        assert_same_state(state, {k: want[k] for k in state}, f"{label}, rank {rank}")
    assert set().union(*states) == set(want), label


@dataclass(frozen=True)
class Uninterrupted:
    """One device, LAST steps without a break: its checkpoints (full files, saved inside fit as
    the distributed runs save) by step, its final state and its logged losses."""

    checkpoints: dict[int, str]
    final: dict[str, torch.Tensor]
    log: list[tuple[int, float]]

    def checkpoint(self, step: int) -> dict:
        return torch.load(self.checkpoints[step], weights_only=False, map_location="cpu")

    def losses(self, tmp: str, first: int) -> None:
        """The losses ``tmp``'s run logged (steps ``first`` on) are the uninterrupted run's."""
        got = csv_metric(tmp, "train_loss")
        want = [(s, v) for s, v in self.log if s >= first and s < first + len(got)]
        assert got and [s for s, _ in got] == [s for s, _ in want], (got, want)
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-5)


@functools.lru_cache(maxsize=None)
def uninterrupted() -> Uninterrupted:
    tmp = tempfile.mkdtemp()
    checkpoints = {step: os.path.join(tmp, f"step{step}.ckpt") for step in (SAVED_AT, RESUMED_AT)}
    saves = {step: [("full", path)] for step, path in checkpoints.items()}
    final = _layout_fit(1, 0, "auto", tmp, LAST, None, saves)
    return Uninterrupted(checkpoints, final, csv_metric(tmp, "train_loss"))


def read_checkpoint(path: str) -> dict:
    """A full file or a sharded directory, as the dict Lightning restores."""
    from lightning_gsched.engine import checkpoint_sharded as sharded

    if os.path.isdir(path):
        return sharded.load(path)
    return torch.load(path, weights_only=False, map_location="cpu")


def assert_same_checkpoint(got: dict, want: dict, label: str) -> None:
    """Same step, weights, every parameter's Adam state (RTOL/ATOL: see LitGPT's eps) and LR
    scheduler as the single device's checkpoint."""
    assert got["global_step"] == want["global_step"], label
    assert_same_state(got["state_dict"], want["state_dict"], label)
    got_adam = got["optimizer_states"][0]["state"]
    want_adam = want["optimizer_states"][0]["state"]
    assert got_adam.keys() == want_adam.keys(), label
    for index in want_adam:
        assert got_adam[index].keys() == want_adam[index].keys(), label
        for key in want_adam[index]:
            torch.testing.assert_close(got_adam[index][key], want_adam[index][key],
                                       rtol=RTOL, atol=ATOL,
                                       msg=lambda m, i=index, k=key: f"{label}: {i}.{k}: {m}")
    assert got["lr_schedulers"] == want["lr_schedulers"], label


def writing_ranks(path: str) -> set[int]:
    """The ranks whose files in a sharded directory hold model tensors."""
    import torch.distributed.checkpoint as dcp

    storage = dcp.FileSystemReader(path).read_metadata().storage_data
    return {int(info.relative_path.split("_")[2]) for index, info in storage.items()
            if index.fqn.startswith("model.")}


def test_checkpoints_move_between_pipeline_and_data_parallel_layouts(worlds, tmp_path) -> None:
    """Full and sharded checkpoints (Adam, an LR schedule, clipping) saved under one (P, G)
    resume under another and end at the uninterrupted single device's weights:

    W=2 1f1b (P=2, G=1) saves at step 2 -> W=4 1f1b as 2 x 2 replicated resumes the full file,
    interleaved as 2 x 2 sharded (a model built without weights) the directory; both save at
    step 4 -> 1f1b on 4 workers (P=4, G=1) resumes the replicated run's file, ddp the sharded
    run's directory, fslpp (2 groups of a 2-deep loop) the replicated run's directory, to step
    6. Every saved checkpoint equals the single device's at its step, and every rank's copy of
    what it holds (each replica's own) the single device's weights at the end. A resume under
    a layout the workers cannot hold (G=3 of W=4) is a ScheduleConfigError on every rank.
    """
    ref = uninterrupted()
    paths = {name: str(tmp_path / name) for name in
             ("p2.ckpt", "p2.dir", "rep.ckpt", "rep.dir", "shard.ckpt", "shard.dir")}

    p2 = {"schedule": "1f1b"}
    rep = {"schedule": "1f1b", "data_parallel_size": 2}
    shard = {"schedule": "interleaved", "data_parallel_size": 2, "data_parallel": "shard"}
    worlds.get(2).run(layout_fit_on_worker, p2, str(tmp_path / "p2"), SAVED_AT, None,
                      {SAVED_AT: [("full", paths["p2.ckpt"]), ("sharded", paths["p2.dir"])]})
    four = worlds.get(4)
    runs = [  # (name, options, resumed from, deferred): each saves at RESUMED_AT
        ("rep", rep, "p2.ckpt", False), ("shard", shard, "p2.dir", True)]
    for name, options, source, deferred in runs:
        states = four.run(layout_fit_on_worker, options, str(tmp_path / name), RESUMED_AT,
                          paths[source], {RESUMED_AT: [("full", paths[f"{name}.ckpt"]),
                                                       ("sharded", paths[f"{name}.dir"])]},
                          deferred)
        assert_held(states, ref.checkpoint(RESUMED_AT)["state_dict"],
                    f"{name} resumed from {source}")
        ref.losses(str(tmp_path / name), SAVED_AT)
    for name in paths:
        step = SAVED_AT if name.startswith("p2") else RESUMED_AT
        assert_same_checkpoint(read_checkpoint(paths[name]), ref.checkpoint(step), name)
    # replicated stages are written once, by the first replica; sharded ones by their owners
    assert writing_ranks(paths["rep.dir"]) == {0, 2}
    assert writing_ranks(paths["shard.dir"]) == {0, 1, 2, 3}
    # a layout that cannot exist on these workers is named as such, on every rank
    errors = four.run(layout_fit_on_worker, {**rep, "data_parallel_size": 3},
                      str(tmp_path / "bad"), LAST, paths["rep.ckpt"], {}, expect_errors=True)
    for error in errors:
        assert isinstance(error, RankError) and error.type_name == "ScheduleConfigError"
        assert "data_parallel_size=3 does not divide the W=4 workers" in error.message
        assert "among [1, 2, 4]" in error.message
    for name, options, source in [("p4", {"schedule": "1f1b"}, "rep.ckpt"),
                                  ("ddp", {"schedule": "ddp"}, "shard.dir"),
                                  ("fslpp", {"schedule": "fslpp", "R": 2}, "rep.dir")]:
        states = four.run(layout_fit_on_worker, options, str(tmp_path / name), LAST,
                          paths[source], {})
        assert_held(states, ref.final, f"{name} resumed from {source}")
        ref.losses(str(tmp_path / name), RESUMED_AT)


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_model_checkpoint_during_fit_matches_single_device(worlds, state_dict_type: str,
                                                           tmp_path) -> None:
    want = fit_with_model_checkpoint(1, 0, "auto", str(tmp_path / "single"))
    options = {"schedule": "fslpp", "state_dict_type": state_dict_type}
    results = worlds.get(4).run(model_checkpoint_on_worker, options, str(tmp_path / "ours"))
    for r in results:  # same files, and the same best score on every rank
        assert r[:-1] == want[:-1]
        assert r[-1] == results[0][-1] == pytest.approx(want[-1], rel=1e-6)
    for name in want[:-1]:
        path = tmp_path / "ours" / "ckpt" / name
        assert path.is_dir() == (state_dict_type == "sharded")
        expected = torch.load(tmp_path / "single" / "ckpt" / name, weights_only=False)
        assert_same_checkpoint(read_checkpoint(str(path)), expected, name)
