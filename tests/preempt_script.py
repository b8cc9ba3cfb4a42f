"""A Lightning job that signals or fails itself at a chosen point: the fault tests' subject.

Run as ``python preempt_script.py OUT_DIR SCHEDULE WORLD FAULT RANK STEP WHERE [STATE_DICT_TYPE]``
(``full``, the default, or ``sharded``); Lightning's
script launcher re-runs it for the other ranks (as a user's ``python train.py`` with
``devices=W``). At training step STEP (the optimizer steps done so far) rank RANK, at WHERE
(``batch_start``, ``capture``: inside training_step before ``self(...)``, ``loss``: after it,
``validation``: inside validation_step after ``self(...)`` (at STEP 0: in the sanity check,
whose first batch builds the pipeline by running the whole step on every rank),
``validation_capture``: before ``self(...)``, ``save``: in on_save_checkpoint,
``batch_end``: in a callback's on_train_batch_end, ``data``: in the dataloader, ``setup``: in
the module's setup hook, before the strategy's setup), does FAULT:
``sigterm`` / ``sigusr1`` (to itself), ``sigterm-launcher`` (to rank 0, the launcher), ``raise``
(a ValueError) or ``none``. Every rank writes ``OUT_DIR/rank<r>.json``: how its ``fit`` ended,
the step it stopped at, and whether it did the fault (``injected``: the chosen point was
reached); rank 0 of a finished run saves its
weights in ``OUT_DIR/final.pt``. A ``ModelCheckpoint(save_last=True,
save_on_exception=True, every_n_train_steps=2)`` writes into ``OUT_DIR/ckpt``;
``RESUME=1`` fits again from ``ckpt_path="last"``, as does a restart under torchrun
(``TORCHELASTIC_RESTART_COUNT`` > 0), which also injects nothing: FAULT ``kill9`` (SIGKILL to
itself) then runs once, on torchrun's first attempt.

WHERE ``test:<point>`` or ``predict:<point>`` runs ``trainer.test`` / ``trainer.predict`` instead
of ``fit`` (a fresh model; the pipeline is built at the first batch, whose probe runs the whole
step on every rank), with STEP the batch index and the points ``loss`` (in test_step /
predict_step after ``self(...)``), ``capture`` (before it), ``batch_end`` (a callback's
on_test_batch_end / on_predict_batch_end) and ``data`` (the dataloader). The result files then
carry ``outcome`` of that call. Each result also has ``ended`` (``time.time()`` when the rank's
call returned) and the faulty rank's ``injected_at``: the tests report the time to end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # the tests' helpers; this checkout's package

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from lightning_models import LitGPT, rank_loader, tokens  # noqa: E402
from models import seeded  # noqa: E402

STEPS = 6
GLOBAL_BATCH = 12 if int(sys.argv[3]) == 3 else 8  # rows split evenly over W and B = 2W


def config() -> dict[str, Any]:
    out, schedule, world, fault, rank, step, where = sys.argv[1:8]
    state_dict_type = sys.argv[8] if len(sys.argv) > 8 else "full"
    mode, point = where.split(":", 1) if ":" in where else ("fit", where)
    return dict(out=out, schedule=schedule, world=int(world), fault=fault, rank=int(rank),
                step=int(step), where=point, mode=mode, state_dict_type=state_dict_type)


CONFIG = config()
# a resumed run (by hand, or torchrun's restart of the group) injects nothing
RESUMING = bool(os.environ.get("RESUME")) or int(os.environ.get("TORCHELASTIC_RESTART_COUNT",
                                                                "0")) > 0


def inject(where: str, trainer: pl.Trainer, index: int | None = None) -> None:
    """Do the fault if this is the chosen rank, step (``index``: a test/predict batch index)
    and place (once per process)."""
    c = CONFIG
    at = trainer.global_step if index is None else index
    if (c["where"] != where or trainer.global_rank != c["rank"] or at != c["step"]
            or RESUMING or getattr(inject, "done", False)):
        return
    inject.done = True  # type: ignore[attr-defined]
    inject.at = time.time()  # type: ignore[attr-defined]
    fault = c["fault"]
    if fault == "raise":
        raise ValueError(f"injected failure in {where} on rank {trainer.global_rank}")
    if fault == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif fault == "sigusr1":
        os.kill(os.getpid(), signal.SIGUSR1)
    elif fault == "kill9":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "sigterm-launcher":
        os.kill(int(os.environ.get("GSCHED_TEST_LAUNCHER", os.getpid())), signal.SIGTERM)


class Faulty(LitGPT):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inject("capture", self.trainer)
        (t,) = batch
        logits = self(t[:, :-1])
        inject("loss", self.trainer)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                 t[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        inject("validation_capture", self.trainer)
        (t,) = batch
        logits = self(t[:, :-1])
        inject("validation", self.trainer)
        self.log("val_loss", logits.float().mean())

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        inject("capture", self.trainer, batch_idx)
        (t,) = batch
        logits = self(t[:, :-1])
        inject("loss", self.trainer, batch_idx)
        self.log("test_loss", logits.float().mean())

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        inject("capture", self.trainer, batch_idx)
        (t,) = batch
        logits = self(t[:, :-1])
        inject("loss", self.trainer, batch_idx)
        return logits

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        inject("save", self.trainer)

    def setup(self, stage: str) -> None:  # Lightning runs it between two barriers
        inject("setup", self.trainer)


class Injector(pl.Callback):
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        inject("batch_start", trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        inject("batch_end", trainer)

    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        inject("batch_end", trainer, batch_idx)

    def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any,
                             batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        inject("batch_end", trainer, batch_idx)


class FaultyLoader(torch.utils.data.DataLoader):
    """The training data, resumable mid-epoch (Lightning's ``state_dict``/``load_state_dict``
    protocol): Lightning 2.6 restarts a plain DataLoader from its first batch on a resume
    mid-epoch, so a resumed run would see other batches than an uninterrupted one."""

    skip = 0

    def state_dict(self) -> dict[str, int]:
        # one batch per optimizer step (no accumulation): the batches this epoch has consumed
        # are global_step mod len(self), whatever Lightning's fetcher has prefetched
        return {"position": self.trainer.global_step % len(self)}  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = state["position"]

    def __iter__(self) -> Any:
        skip, self.skip = self.skip, 0
        for index, batch in enumerate(super().__iter__()):
            if index < skip:
                continue
            trainer = getattr(self, "trainer", None)
            if trainer is not None:
                inject("data", trainer, None if CONFIG["mode"] == "fit" else index)
            yield batch


def main() -> None:
    from lightning_gsched import GeneralParallel

    c = CONFIG
    os.environ.setdefault("GSCHED_TEST_LAUNCHER", str(os.getpid()))  # inherited by children
    torch.set_num_threads(1)
    # "1f1b+tp2": the schedule over tensor-parallel workers of two ranks each; "1f1b+dp2":
    # two data-parallel replicas of the pipeline
    schedule, _, layout = c["schedule"].partition("+")
    T = int(layout[2:]) if layout.startswith("tp") else 1
    G = int(layout[2:]) if layout.startswith("dp") else 1
    model = seeded(0, lambda: Faulty(optimizer="adam", shardable=T > 1))
    tensor_parallel = {} if T == 1 else {"tensor_parallel_size": T, "tensor_parallel_plan": {
        f"model.blocks.*.{name}": style for name, style in (
            ("attn.q", "colwise"), ("attn.k", "colwise"), ("attn.v", "colwise"),
            ("attn.proj", "rowwise"), ("mlp.0", "colwise"), ("mlp.2", "rowwise"))}}
    saver = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(c["out"], "ckpt"), save_last=True,
                                         save_on_exception=True, every_n_train_steps=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=c["world"],
        strategy=GeneralParallel(schedule, step_timeout=30, data_parallel_size=G,
                                 state_dict_type=c["state_dict_type"], **tensor_parallel),
        logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1 if c["step"] == 0 and c["where"] == "validation" else 0,
        use_distributed_sampler=False, max_steps=STEPS, val_check_interval=2,
        limit_val_batches=1, callbacks=[Injector(), saver],
    )
    rank = trainer.global_rank
    with open(os.path.join(c["out"], f"pid{rank}"), "w") as handle:
        handle.write(str(os.getpid()))
    data = tokens(GLOBAL_BATCH * STEPS)
    train = rank_loader(data, GLOBAL_BATCH, c["world"] // T, rank // T)  # a worker's share
    loader = FaultyLoader(train.dataset, batch_size=train.batch_size, shuffle=False)
    # on the class: Lightning re-creates a predict loader (batch-index tracking) from its
    # constructor's arguments, which would drop an instance attribute
    FaultyLoader.trainer = trainer  # type: ignore[attr-defined]
    result: dict[str, Any] = {"rank": rank}
    try:
        if c["mode"] == "test":
            trainer.test(model, loader)
        elif c["mode"] == "predict":
            trainer.predict(model, loader)
        else:
            trainer.fit(model, loader, rank_loader(data, GLOBAL_BATCH, c["world"] // T, rank // T),
                        ckpt_path="last" if RESUMING else None)
        result["outcome"] = "finished"
    except BaseException as exc:  # noqa: BLE001 - the test reads how each rank ended
        result["outcome"] = type(exc).__name__
        result["message"] = str(exc)
        result["traceback"] = traceback.format_exc()
    if rank == 0:  # a script that does more after fit (the launcher must not be cut off)
        time.sleep(float(os.environ.get("GSCHED_TEST_RANK0_AFTER", "0")))
    result["ended"] = time.time()
    result["attempt"] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    result["step"] = trainer.global_step
    result["injected"] = getattr(inject, "done", False)
    result["injected_at"] = getattr(inject, "at", None)
    if result["outcome"] == "finished" and rank == 0 and c["mode"] == "fit":
        torch.save(model.state_dict(), os.path.join(c["out"], "final.pt"))
    # whole or absent: the test reads a result as soon as its file exists (launched_jobs.py)
    path = os.path.join(c["out"], f"rank{rank}.json")
    with open(path + ".tmp", "w") as handle:
        json.dump(result, handle)
    os.replace(path + ".tmp", path)
    sys.stdout.flush()
    # skip interpreter teardown (gloo threads); the result is written. A failed rank exits 1,
    # which is what makes torchrun restart the group
    os._exit(0 if result["outcome"] == "finished" else 1)


if __name__ == "__main__":
    main()
