"""Checkpoints under faults: an interrupted save leaves nothing behind, a bad ckpt_path fails.

An interrupted save (the writer raises midway, as a full disk or a kill between write and
rename would leave it, or, for a sharded save, rank 0 fails to put the written directory in
place: every rank must stop, the others with an error naming rank 0, not wait in a barrier)
must leave the previous checkpoint under that name intact, and no
temporary file, neither next to the checkpoint nor in the system temporary folder (each worker
points ``tempfile.tempdir`` at a folder of its own, which must stay empty). A truncated file,
another model's checkpoint, or a sharded directory without its metadata given to
``trainer.fit(ckpt_path=...)`` must raise the same ``CheckpointError`` on both ranks, naming
the file and what is wrong (the harness's timeout bounds the run: a hang fails the test).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

from dist_harness import RankError, WorkerContext
from lightning_models import (
    as_worker,
    assert_same_state,
    make_lit_gpt,
    rank_loader,
    tokens,
    trainer,
)

pytestmark = pytest.mark.distributed

GLOBAL_BATCH, STEPS = 8, 2
WORLD_TIMEOUT = 300.0  # seconds per check: whole Trainer fits (conftest.worlds)


def _private_tempdir(folder: str) -> None:
    """Point this process's system temporary folder at ``folder`` (must stay empty)."""
    os.makedirs(folder, exist_ok=True)
    tempfile.tempdir = folder


def _files_in(folder: Any) -> list[str]:
    """What lies in a worker's temporary folder, less multiprocessing's own ``pymp-*`` folder
    (its queues' sockets: the harness's, created there once the folder was redirected)."""
    return sorted(name for name in os.listdir(folder) if not name.startswith("pymp-"))


def _fit(ctx: WorkerContext, options: dict, tmp: str, ckpt: str | None = None) -> Any:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    model = make_lit_gpt(optimizer="adam")
    fit = trainer(ctx.world_size, GeneralParallel(step_timeout=60, **options), tmp,
                  max_steps=STEPS)
    fit.fit(model, rank_loader(tokens(GLOBAL_BATCH * 4), GLOBAL_BATCH, ctx.world_size, ctx.rank),
            ckpt_path=ckpt)
    return fit, model


def interrupted_save_on_worker(ctx: WorkerContext, options: dict, tmp: str, path: str) -> dict:
    """Save a good checkpoint, then a second save to the same path whose writer fails midway.

    Returns this rank's model state (after the good save), what the checkpoint's directory held
    while the failed write was under way, and the error it raised."""
    from lightning_gsched.engine import checkpoint_files as ckpt_files
    from lightning_gsched.engine import checkpoint_sharded as sharded

    _private_tempdir(os.path.join(tmp, f"systmp{ctx.rank}"))
    fit, model = _fit(ctx, options, tmp)
    fit.save_checkpoint(path)
    seen: list[str] = []
    directory = os.path.dirname(path)

    def torch_save_fails(obj: Any, f: Any) -> None:  # full: rank 0 writes the file
        f.write(b"PK\x03\x04 half a checkpoint")
        seen.extend(sorted(os.listdir(directory)))
        raise OSError("simulated: no space left on device")

    def dcp_save_fails(state: dict, checkpoint_id: str) -> None:  # sharded: every rank writes
        with open(os.path.join(checkpoint_id, f"__{ctx.rank}_0.distcp"), "wb") as f:
            f.write(b"half a shard")
        seen.extend(sorted(os.listdir(directory)))
        torch.distributed.barrier()  # as dcp.save: a write failure is raised on every rank
        raise OSError("simulated: no space left on device")

    real_torch_save, real_dcp_save = ckpt_files.torch.save, sharded.dcp.save
    ckpt_files.torch.save = torch_save_fails  # type: ignore[assignment]
    sharded.dcp.save = dcp_save_fails  # type: ignore[assignment]
    error = None
    try:
        checkpoint = fit._checkpoint_connector.dump_checkpoint(weights_only=False)
        fit.strategy.save_checkpoint(checkpoint, path)  # no barrier: rank 0 alone fails (full)
    except OSError as exc:
        error = str(exc)
    finally:
        ckpt_files.torch.save, sharded.dcp.save = real_torch_save, real_dcp_save
    outside = None
    if options["state_dict_type"] == "sharded":  # then a failure outside the writer, rank 0
        outside = _save_failing_outside_the_writer(ctx, fit, path)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "seen": seen, "error": error, "outside": outside}


def _save_failing_outside_the_writer(ctx: WorkerContext, fit: Any, path: str) -> tuple:
    """A sharded save whose shards are written but whose swap into place fails on rank 0
    (the peers used to wait for it in a barrier of the default group, 30 minutes): how each
    rank's save ended, (error type, message)."""
    from lightning_gsched.engine import checkpoint_files as ckpt_files

    def refused(staging: str, target: str) -> None:
        raise OSError("simulated: rename refused")

    real = ckpt_files.put_in_place
    if ctx.rank == 0:
        ckpt_files.put_in_place = refused  # type: ignore[assignment]
    try:
        checkpoint = fit._checkpoint_connector.dump_checkpoint(weights_only=False)
        fit.strategy.save_checkpoint(checkpoint, path)
    except OSError as exc:
        return type(exc).__name__, str(exc)
    finally:
        ckpt_files.put_in_place = real  # type: ignore[assignment]
    return None, None


def peer_never_saves_on_worker(ctx: WorkerContext, tmp: str, path: str) -> Any:
    """A sharded save, then a load, that rank 1 never starts (as when its
    ``on_save_checkpoint`` raised, or it died before a resume): rank 0's save and load, with
    step_timeout 3 s; what each raised (rank 1: None)."""
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    model = make_lit_gpt()
    fit = trainer(ctx.world_size, GeneralParallel("1f1b", step_timeout=3,
                                                  state_dict_type="sharded"), tmp, max_steps=1)
    fit.fit(model, rank_loader(tokens(GLOBAL_BATCH), GLOBAL_BATCH, ctx.world_size, ctx.rank))
    if ctx.rank != 0:
        return None
    outcomes: list[Any] = []
    checkpoint = fit._checkpoint_connector.dump_checkpoint(weights_only=False)
    for attempt in (lambda: fit.strategy.save_checkpoint(checkpoint, path),
                    lambda: fit.strategy.load_checkpoint(tmp)):
        try:
            attempt()
            outcomes.append("done")
        except Exception as exc:  # noqa: BLE001 - the test reads it
            outcomes.append((type(exc).__name__, str(exc)))
    return outcomes


def test_a_save_or_load_a_peer_never_starts_fails_naming_it(worlds, tmp_path) -> None:
    """Rank 0 ends within step_timeout with a CheckpointWriteError (the save) and a
    CheckpointError (the load) that say a peer never started it (both were torch's
    DistStoreError "wait timeout ... keys: /default_pg/..." after the same wait), and nothing
    is written under the save's name."""
    path = tmp_path / "ckpt" / "last.ckpt"
    try:
        results = worlds.get(2).run(peer_never_saves_on_worker, str(tmp_path), str(path))
    finally:
        worlds.discard(2)  # rank 0 made groups rank 1 did not: their groups are out of step
    assert results[1] is None
    (saved, message), (loaded, load_message) = results[0]
    assert saved == "CheckpointWriteError", results[0]
    assert "rank 0 waited 3 s (step_timeout) for every rank to start the save" in message
    assert "a peer never did" in message and "previous checkpoint" in message
    assert not path.exists()
    assert loaded == "CheckpointError", results[0]
    assert f"loading {tmp_path}: rank 0 waited 3 s (step_timeout) for every rank to start " \
           "loading it, and a peer never did" in load_message


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_interrupted_save_leaves_the_previous_checkpoint_and_no_temporary_file(
        worlds, state_dict_type: str, tmp_path) -> None:
    from lightning_gsched.engine import checkpoint_sharded as sharded

    directory = tmp_path / "ckpt"
    path = directory / "last.ckpt"
    options = {"schedule": "fsdp", "state_dict_type": state_dict_type}
    results = worlds.get(2).run(interrupted_save_on_worker, options, str(tmp_path), str(path))
    writers = [0] if state_dict_type == "full" else [0, 1]
    for rank in writers:  # the failed write went to a temporary name in the same directory
        assert results[rank]["error"] == "simulated: no space left on device"
        partial = [n for n in results[rank]["seen"] if n.startswith(".last.ckpt.")]
        assert partial and all(n.endswith(".partial") for n in partial), results[rank]["seen"]
    if state_dict_type == "sharded":  # rank 0 failed after the shards: every rank stopped
        assert results[0]["outside"] == ("OSError", "simulated: rename refused")
        kind, message = results[1]["outside"]
        assert kind == "CheckpointWriteError", message
        assert f"the sharded save of {path} failed on rank 0 while putting the directory in " \
               "place (OSError: simulated: rename refused)" in message
    assert sorted(os.listdir(directory)) == ["last.ckpt"]  # nothing else left
    for rank in range(2):
        assert _files_in(tmp_path / f"systmp{rank}") == []
    # the previous checkpoint is whole: it holds the model every rank had when it was saved
    loaded = (sharded.load(path) if state_dict_type == "sharded"
              else torch.load(path, weights_only=False, map_location="cpu"))
    assert path.is_dir() == (state_dict_type == "sharded")
    assert loaded["global_step"] == STEPS
    for rank in range(2):
        assert_same_state(loaded["state_dict"], results[rank]["state"], f"rank {rank}",
                          rtol=0, atol=0)


def test_atomic_save_in_one_process_leaves_no_temporary_file(tmp_path, monkeypatch) -> None:
    from lightning_gsched.engine import checkpoint_files as ckpt_files

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "systmp"))
    os.makedirs(tmp_path / "systmp")
    target = tmp_path / "a" / "model.ckpt"
    ckpt_files.atomic_save({"v": torch.arange(3)}, target)
    (target.parent / ".model.ckpt.999-dead.partial").write_bytes(b"left by a killed save")

    def fails_after_write(obj: Any, f: Any) -> None:
        f.write(b"partial")
        raise KeyboardInterrupt  # as an interrupt in the middle of the write

    monkeypatch.setattr(ckpt_files.torch, "save", fails_after_write)
    with pytest.raises(KeyboardInterrupt):
        ckpt_files.atomic_save({"v": torch.zeros(3)}, target)
    monkeypatch.undo()
    assert sorted(os.listdir(target.parent)) == ["model.ckpt"]  # the stale one removed too
    assert os.listdir(tmp_path / "systmp") == []
    assert torch.equal(torch.load(target)["v"], torch.arange(3))


def test_a_checkpoint_replaces_an_older_one_of_the_other_kind(tmp_path) -> None:
    """A run resumed with another ``state_dict_type`` in the same ModelCheckpoint folder saves
    ``last.ckpt`` over the other kind (found by probing: a full save over a sharded directory
    died with a bare IsADirectoryError, a sharded save over a file was refused), as Lightning's
    FSDPStrategy replaces it; nothing of the old entry or the staging is left."""
    from lightning_gsched.engine import checkpoint_files as ckpt_files

    target = tmp_path / "last.ckpt"
    target.mkdir()  # an older sharded checkpoint: its shards and DCP's metadata
    (target / "__0_0.distcp").write_bytes(b"shard")
    (target / ".metadata").write_bytes(b"metadata")
    ckpt_files.atomic_save({"v": torch.arange(3)}, target)
    assert target.is_file() and torch.equal(torch.load(target)["v"], torch.arange(3))
    staging = tmp_path / ".last.ckpt.partial"  # a sharded save's fully written directory
    staging.mkdir()
    (staging / "meta").write_bytes(b"new")
    ckpt_files.put_in_place(str(staging), str(target))
    assert target.is_dir() and (target / "meta").read_bytes() == b"new"
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_a_directory_that_is_not_a_checkpoint_is_never_replaced(tmp_path) -> None:
    """A save (full, streamed, sharded, or ``gsched consolidate``) whose path is a user's folder
    replaced the folder and everything in it (found by probing: ``gsched consolidate DIR .``
    deleted the working directory). Every save refuses it, before writing, and leaves it whole;
    an empty folder is still replaced."""
    from lightning_gsched.engine import checkpoint_files as ckpt_files
    from lightning_gsched.errors import CheckpointWriteError

    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep")
    with pytest.raises(CheckpointWriteError, match=r"'.*results': it is a directory that holds "
                                                   r"files and is not a sharded checkpoint"):
        ckpt_files.atomic_save({"v": torch.arange(3)}, folder)
    staging = tmp_path / ".results.partial"  # what a sharded save would put in place
    staging.mkdir()
    with pytest.raises(CheckpointWriteError, match="not a sharded checkpoint"):
        ckpt_files.put_in_place(str(staging), str(folder))
    assert (folder / "notes.txt").read_text() == "keep"
    assert sorted(os.listdir(tmp_path)) == [".results.partial", "results"]
    empty = tmp_path / "empty"
    empty.mkdir()
    ckpt_files.atomic_save({"v": torch.arange(3)}, empty)
    assert empty.is_file()


# ------------------------------------------------------------------ bad ckpt_path

def save_then_spoil_on_worker(ctx: WorkerContext, options: dict, tmp: str, path: str,
                              spoil: str) -> None:
    """Write a good checkpoint (W=2), then make it bad the way ``spoil`` says (rank 0)."""
    from lightning_gsched.engine.checkpoint_sharded import META

    fit, _ = _fit(ctx, options, tmp)
    fit.save_checkpoint(path)
    fit.strategy.barrier("saved")
    if ctx.rank == 0:
        if spoil == "truncate":
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                f.truncate(size // 2)
        elif spoil == "foreign":
            torch.save({"state_dict": nn.Linear(4, 4).state_dict(), "epoch": 0,
                        "global_step": STEPS, "optimizer_states": [], "lr_schedulers": [],
                        "pytorch-lightning_version": "2.6.0"}, path)
        elif spoil == "no-metadata":
            os.remove(os.path.join(path, META))
        elif spoil == "truncate-shard":
            shard = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0]
            with open(os.path.join(path, shard), "r+b") as f:
                f.truncate(os.path.getsize(os.path.join(path, shard)) // 2)
    fit.strategy.barrier("spoiled")


def resume_on_worker(ctx: WorkerContext, options: dict, tmp: str, path: str) -> str:
    _fit(ctx, options, tmp, ckpt=path)
    return "resumed"


@pytest.mark.parametrize(
    "state_dict_type, spoil, phrases",
    [("full", "truncate", ["is truncated or not a checkpoint", "reading the file failed",
                           "resume from an earlier checkpoint"]),
     ("full", "foreign", ["does not hold this model's parameters", "missing",
                          "Pass a checkpoint of LitGPT"]),
     ("sharded", "no-metadata", ["is a directory without gsched_meta.pt",
                                 "save never finished"]),
     ("sharded", "truncate-shard", ["is truncated or not a checkpoint",
                                    "reading a shard of the sharded checkpoint failed"]),
     ("full", "missing", ["does not exist"])],
)
def test_bad_ckpt_path_fails_on_every_rank(worlds, state_dict_type: str, spoil: str,
                                           phrases: list[str], tmp_path) -> None:
    world = worlds.get(2)
    path = str(tmp_path / ("first.dir" if state_dict_type == "sharded" else "first.ckpt"))
    options = {"schedule": "1f1b", "state_dict_type": state_dict_type}
    if spoil == "missing":
        path = str(tmp_path / "never_saved.ckpt")
    else:
        world.run(save_then_spoil_on_worker, options, str(tmp_path / "a"), path, spoil)
    results = world.run(resume_on_worker, options, str(tmp_path / "b"), path,
                        expect_errors=True)
    for rank, result in enumerate(results):
        assert isinstance(result, RankError), (rank, result)
        assert result.type_name == "CheckpointError", (rank, result.type_name, result.message)
        assert path in result.message, result.message
        for phrase in phrases:
            assert phrase in result.message, (phrase, result.message)
    assert results[0].message == results[1].message  # the same report on every rank


def resume_from_own_path_on_worker(ctx: WorkerContext, options: dict, tmp: str,
                                   paths: list[str]) -> str:
    """Each rank resumes from ``paths[rank]`` (a path that is not on every rank's disk)."""
    _fit(ctx, options, tmp, ckpt=paths[ctx.rank])
    return "resumed"


def test_checkpoint_readable_on_one_rank_only_fails_on_every_rank(worlds, tmp_path) -> None:
    world = worlds.get(2)
    good = str(tmp_path / "first.ckpt")
    options = {"schedule": "1f1b"}
    world.run(save_then_spoil_on_worker, options, str(tmp_path / "a"), good, "none")
    absent = str(tmp_path / "elsewhere" / "first.ckpt")  # as if rank 1's disk lacked it
    results = world.run(resume_from_own_path_on_worker, options, str(tmp_path / "b"),
                        [good, absent], expect_errors=True)
    for rank, result in enumerate(results):
        assert isinstance(result, RankError), (rank, result)
        assert result.type_name == "CheckpointError", (rank, result.type_name, result.message)
        assert f"ckpt_path {absent} does not exist" in result.message, result.message
        assert "found by rank(s) [1]" in result.message, result.message
        assert "file system every rank shares" in result.message, result.message


def fabric_checkpoint_faults_on_worker(ctx: WorkerContext, tmp: str) -> dict:
    """One Fabric run (1f1b, a step): ``fabric.save`` into a folder; ``fabric.load`` of a
    missing, a truncated and another model's file; then the save over the same name with
    rank 0's writer failing midway. What each left and raised."""
    from lightning.fabric import Fabric

    from lightning_gsched.errors import CheckpointError, RuntimeFault
    from lightning_gsched.fabric import GeneralParallelFabric
    from models import make_gpt

    as_worker(ctx.rank)
    _private_tempdir(os.path.join(tmp, f"tmp{ctx.rank}"))
    fabric = Fabric(accelerator="cpu", devices=ctx.world_size,
                    strategy=GeneralParallelFabric("1f1b", step_timeout=60))
    fabric.launch()
    model, optimizer = fabric.setup(make_gpt(0), torch.optim.SGD(make_gpt(0).parameters(),
                                                                  lr=0.05))
    batch = tokens(GLOBAL_BATCH)
    rows = GLOBAL_BATCH // ctx.world_size
    mine = batch[ctx.rank * rows:(ctx.rank + 1) * rows]

    def loss_fn(m: Any, b: torch.Tensor) -> torch.Tensor:
        logits = m(b[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                           b[:, 1:].reshape(-1))

    fabric.strategy.step(model, mine, loss_fn)
    optimizer.step()
    folder = os.path.join(tmp, "ckpt")
    path = os.path.join(folder, "run.ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    saved = sorted(os.listdir(folder))
    fabric.barrier()  # every rank listed the folder before rank 0 adds the bad files to it
    real_save = torch.save
    if ctx.rank == 0:
        with open(path, "rb") as f:
            head = f.read(1000)
        with open(os.path.join(folder, "truncated.ckpt"), "wb") as f:
            f.write(head)
        real_save({"model": nn.Linear(3, 4).state_dict()},
                  os.path.join(folder, "foreign.ckpt"))
    fabric.barrier()
    errors = {}
    for name in ("missing.ckpt", "truncated.ckpt", "foreign.ckpt"):
        try:
            fabric.load(os.path.join(folder, name), {"model": model, "optimizer": optimizer})
            errors[name] = "loaded"
        except CheckpointError as exc:
            errors[name] = str(exc)
    # last, the same save again with rank 0's writer failing midway (a full disk): a failed
    # save ends the job on every rank (rank 0 with its error, the others with a RuntimeFault
    # naming it), so nothing collective follows
    interrupted = None

    def failing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if hasattr(f, "write"):
            f.write(b"partial")
        raise OSError("No space left on device (injected)")

    if ctx.rank == 0:
        torch.save = failing_save  # type: ignore[assignment]
    try:
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
    except (OSError, RuntimeFault) as exc:
        interrupted = f"{type(exc).__name__}: {exc}"
    finally:
        torch.save = real_save  # type: ignore[assignment]
    after = sorted(name for name in os.listdir(folder)
                   if name not in ("truncated.ckpt", "foreign.ckpt"))
    step = torch.load(path, map_location="cpu", weights_only=False)["step"]
    fabric.strategy.finish()  # this rank's share of the run's resources, without collectives
    return {"saved": saved, "after": after, "interrupted": interrupted, "step": step,
            "errors": errors, "tmp": _files_in(os.path.join(tmp, f"tmp{ctx.rank}"))}


def test_fabric_save_is_atomic_and_a_bad_fabric_load_names_the_file(worlds, tmp_path) -> None:
    results = worlds.get(2).run(fabric_checkpoint_faults_on_worker, str(tmp_path))
    for rank, got in enumerate(results):
        assert got["saved"] == ["run.ckpt"], (rank, got)  # nothing but the checkpoint
        assert got["tmp"] == [], (rank, got)  # nothing staged in the system temporary folder
        assert got["step"] == 1, (rank, got)  # the interrupted save left the previous file
        errors = got["errors"]
        assert "missing.ckpt does not exist" in errors["missing.ckpt"], errors
        assert "truncated.ckpt is truncated or not a checkpoint" in errors["truncated.ckpt"], \
            errors
        assert "foreign.ckpt (under 'model') does not hold this model's parameters" in \
            errors["foreign.ckpt"], errors
    writer, peer = results
    assert (writer["interrupted"] or "").startswith("OSError: No space left"), writer
    assert writer["after"] == ["run.ckpt"], writer  # the failed save's temporary file removed
    assert (peer["interrupted"] or "").startswith("RuntimeFault: rank 1 "), peer
    assert "rank 0 failed in fabric.save" in peer["interrupted"], peer
