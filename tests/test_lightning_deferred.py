"""Models larger than one rank: built without weights, each rank holds only its own stages.

``trainer.init_module()`` and ``configure_model()`` under ``GeneralParallel`` build the model
with its parameters on the meta device (buffers real); at the first batch each rank gives
storage to, and initialises, only the parameters of the stages it keeps, each module by its
``reset_parameters()`` under a seed made of the run's seed and the module's name
(runtime/materialize.py). Checked here against one device in the same test:

* the trained weights equal a single-process run started from ``initialize(model, seed)``
  (the same per-module seeded initialisation), under fsdp and 1f1b at W=2: so the values do not
  depend on W, schedule or S;
* no rank ever gives storage to a parameter it does not keep (non-owned parameters are on the
  meta device or empty after the run; ``gather_on_teardown="auto"`` does not gather);
* a module holding parameters without ``reset_parameters()`` is refused with the fix;
* ``fabric.init_module()`` under ``GeneralParallelFabric`` defers the same way;
* weights loaded inside the deferred build are refused instead of dropped.

Tolerance: the distributed gradients sum microbatches and ranks in another order than one
device (float32 summation order), the same ``assert_same_state`` bound as every equivalence
test (lightning_models).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from dist_harness import RankError, WorkerContext
from lightning_gsched.runtime.materialize import deferred_parameters, initialize
from lightning_models import (
    LitGPT,
    as_worker,
    assert_same_state,
    rank_loader,
    tokens,
    trainer,
)

pytestmark = pytest.mark.distributed
WORLD_TIMEOUT = 180.0  # seconds per check: whole Trainer fits

SEED = 1234
STEPS = 3
GLOBAL_BATCH = 8


class ConfiguredGPT(LitGPT):
    """LitGPT built in ``configure_model`` (Lightning's large-model hook), not ``__init__``."""

    def __init__(self) -> None:
        pl_init = super(LitGPT, self).__init__  # LightningModule.__init__ only
        pl_init()
        self.save_hyperparameters({"optimizer": "adam", "lr": 0.05, "layers": 3,
                                   "tie": "functional", "log_extra": False})
        self.model: Any = None

    def configure_model(self) -> None:
        if self.model is None:
            from models import TinyGPT

            self.model = TinyGPT(vocab=64, dim=32, heads=4, layers=3, block_size=16,
                                 tie="functional")


class WithoutReset(LitGPT):
    """A module holding a parameter of its own without reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx) * self.scale


class SaveAtTrainEnd(pl.Callback):
    """A full checkpoint while the pipeline still runs (after fit the weights stay sharded)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


def fit_deferred(ctx: WorkerContext, schedule: str, how: str, tmp: str = "") -> dict:
    from lightning_gsched import GeneralParallel
    from lightning_gsched.errors import StrategyConfigError

    as_worker(ctx.rank)
    torch.manual_seed(SEED)
    saved = f"{tmp}/end.ckpt"
    fit = trainer(ctx.world_size, GeneralParallel(schedule), max_steps=STEPS,
                  callbacks=[SaveAtTrainEnd(saved)] if tmp else [])
    if how == "init_module":
        with fit.init_module():
            model: Any = LitGPT(optimizer="adam")
    elif how == "configure_model":
        model = ConfiguredGPT()
    else:
        with fit.init_module():
            model = WithoutReset()
    assert all(p.is_meta for p in model.parameters())  # nothing materialised yet
    fit.fit(model, rank_loader(tokens(GLOBAL_BATCH * STEPS), GLOBAL_BATCH, ctx.world_size,
                               ctx.rank))
    kept = {n: p.detach().clone() for n, p in model.named_parameters()
            if not p.is_meta and p.numel() > 0}
    result: dict[str, Any] = {"kept": kept, "all": [n for n, _ in model.named_parameters()]}
    if tmp:  # the same module validated after fit: refused without a checkpoint, then from it
        val = rank_loader(tokens(GLOBAL_BATCH, seed=9), GLOBAL_BATCH, ctx.world_size, ctx.rank)
        try:
            fit.validate(model, val, verbose=False)
        except StrategyConfigError as exc:
            result["refused"] = str(exc)
        result["val"] = fit.validate(model, val, ckpt_path=saved, verbose=False)[0]["val_loss"]
    return result


def reference() -> dict[str, torch.Tensor]:
    """One device: the same deferred build, initialised by initialize(), trained by Lightning."""
    with deferred_parameters():
        model = LitGPT(optimizer="adam")
    initialize(model, SEED)
    fit = trainer(1, "auto", max_steps=STEPS)
    fit.fit(model, rank_loader(tokens(GLOBAL_BATCH * STEPS), GLOBAL_BATCH, 1, 0))
    return {n: p.detach().clone() for n, p in model.named_parameters()}



def reference_validation(want: dict[str, torch.Tensor]) -> float:
    """One device's validation loss of the trained reference weights."""
    with deferred_parameters():
        model = LitGPT(optimizer="adam")
    initialize(model, SEED)
    model.load_state_dict(want)
    val = rank_loader(tokens(GLOBAL_BATCH, seed=9), GLOBAL_BATCH, 1, 0)
    return float(trainer(1, "auto").validate(model, val, verbose=False)[0]["val_loss"])


@pytest.mark.parametrize("schedule,how", [("fsdp", "init_module"), ("1f1b", "configure_model")])
def test_deferred_model_trains_like_one_device_and_no_rank_holds_it_all(
        world, tmp_path, schedule: str, how: str) -> None:
    """Also (1f1b): after fit the module stays sharded, so validating it again without a
    checkpoint is refused naming ckpt_path, and with the checkpoint saved at the end of the
    run each rank restores its own stages: one device's validation loss (it was refused
    either way; found by probing). rel 1e-5: float32 summation order, as the weights."""
    want = reference()
    results = world.run(fit_deferred, schedule, how, str(tmp_path) if how == "configure_model"
                        else "")
    if how == "configure_model":
        expected = reference_validation(want)
        for got in results:
            assert "Pass ckpt_path=" in got["refused"], got["refused"]
            assert got["val"] == pytest.approx(expected, rel=1e-5), (got["val"], expected)
    seen: set[str] = set()
    for rank, got in enumerate(results):
        assert got["kept"], f"rank {rank} kept nothing"
        assert set(got["kept"]) != set(got["all"]), f"rank {rank} holds the whole model"
        assert_same_state(got["kept"], {n: want[n] for n in got["kept"]}, f"rank {rank}")
        seen |= set(got["kept"])
    assert seen == set(want)  # every parameter trained somewhere


def test_a_module_without_reset_parameters_is_refused(world) -> None:
    results = world.run(fit_deferred, "fsdp", "without_reset", expect_errors=True)
    for result in results:
        assert isinstance(result, RankError), result
        assert "has no reset_parameters()" in result.message, result.message
        assert "WithoutReset" in result.message


def test_initialize_does_not_depend_on_which_parameters_a_rank_keeps() -> None:
    """The values of a module's parameters are the same whether one rank initialises the whole
    model or each rank a part (the others get scratch storage for the RNG draws)."""
    from lightning_gsched.runtime.materialize import initialize_parameters

    with deferred_parameters():
        whole, part = LitGPT(), LitGPT()
    initialize(whole, SEED)
    names = [n for n, _ in part.named_parameters()]
    kept = names[len(names) // 2:]
    params = dict(part.named_parameters())
    initialize_parameters(part, [params[n] for n in kept], SEED, torch.device("cpu"))
    for name, p in part.named_parameters():
        if name in kept:
            assert torch.equal(p, dict(whole.named_parameters())[name]), name
        else:
            assert p.is_meta, name


def test_loading_weights_while_deferred_is_refused() -> None:
    """Weights loaded inside the deferred build would be dropped: refused, with the fix."""
    from lightning_gsched.runtime.materialize import DeferredLoadError

    weights = LitGPT().state_dict()
    with pytest.raises(DeferredLoadError, match="empty_init=False"):
        with deferred_parameters():
            LitGPT().load_state_dict(weights)
    with pytest.raises(DeferredLoadError, match="'weight' of Linear"):
        with deferred_parameters():
            layer = torch.nn.Linear(2, 2)
            layer.weight = torch.nn.Parameter(torch.ones(2, 2))
    with deferred_parameters():  # a tie (a meta parameter over a meta one) is construction
        layers = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
        layers[1].weight = layers[0].weight
    assert layers[1].weight is layers[0].weight and layers[0].weight.is_meta


def fabric_deferred(ctx: WorkerContext) -> dict[str, torch.Tensor]:
    """A Fabric loop over a model built by ``fabric.init_module()`` under fsdp."""
    from lightning.fabric import Fabric

    from lightning_gsched.fabric import GeneralParallelFabric
    from models import PythonMaskGPT
    from test_fabric import compute_loss, global_batches, share

    as_worker(ctx.rank)
    torch.manual_seed(SEED)
    fabric = Fabric(accelerator="cpu", devices=ctx.world_size,
                    strategy=GeneralParallelFabric("fsdp"))
    fabric.launch()
    with fabric.init_module():
        model = PythonMaskGPT(vocab=64, dim=32, heads=4, layers=3, block_size=16)
    assert all(p.is_meta for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    for batch in global_batches():
        optimizer.zero_grad()
        fabric.strategy.step(model, share(batch, ctx.rank, ctx.world_size), compute_loss)
        optimizer.step()
    # sized on meta tensors, the split's constants (the mask, the positions) moved there too
    memory = fabric.strategy.engine.memory
    assert memory.predicted is not None, memory.unavailable
    return {n: p.detach().clone() for n, p in model.module.named_parameters()
            if not p.is_meta and p.numel() > 0}


def test_fabric_init_module_is_deferred_too(world) -> None:
    """Also: a model traced with static shapes whose forward builds its mask and positions in
    Python (PythonMaskGPT, as transformers' models do) trains without weights at the build (it
    was refused: traced on meta, the split's mask had no values)."""
    from models import PythonMaskGPT
    from test_fabric import compute_loss, global_batches

    with deferred_parameters():
        model = PythonMaskGPT(vocab=64, dim=32, heads=4, layers=3, block_size=16)
    initialize(model, SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for batch in global_batches():
        optimizer.zero_grad()
        compute_loss(model, batch).backward()
        optimizer.step()
    want = {n: p.detach() for n, p in model.named_parameters()}
    for rank, got in enumerate(world.run(fabric_deferred)):
        assert got and set(got) != set(want), f"rank {rank}"
        assert_same_state(got, {n: want[n] for n in got}, f"rank {rank}")

