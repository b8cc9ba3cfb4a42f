"""A deferred model started from pretrained safetensors weights: each rank reads only its own.

``GeneralParallel(init_weights=path)`` reads, at the first batch, the tensors of the parameters
a rank keeps (runtime/pretrained.py) from weights saved as ``transformers`` saves them: one
``model.safetensors``, or shards with a ``model.safetensors.index.json``. Checked here, at W=2
under fsdp and 1f1b, against one device in the same test:

* right after the build each rank's kept parameters equal the saved tensors, and the persistent
  buffers the file has are loaded on every rank;
* each rank called ``get_tensor`` for exactly the tensors of the parameters it keeps (plus the
  buffers), never for the whole model (``safetensors.safe_open`` is wrapped in the worker);
* training from the loaded weights ends where a single process that loads the same file with
  ``load_state_dict`` ends (``assert_same_state``'s tolerance: float32 summation order);
* a missing or mismatched tensor, a wrong path, and ``init_weights`` with a model built with
  weights are refused naming the tensor, the file and the fix.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_harness import WorkerContext
from lightning_models import as_worker, assert_same_state, rank_loader, trainer

safetensors_torch = pytest.importorskip("safetensors.torch")

SEED = 7
WORLD_TIMEOUT = 180.0  # seconds per check: whole Trainer fits
STEPS = 2
GLOBAL_BATCH = 8
DIM = 8


class Block(nn.Module):
    """A residual layer with a persistent buffer (loaded from the file when it has it)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.linear = nn.Linear(dim, dim)
        self.register_buffer("shift", torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(self.norm(x))) + self.shift


class Net(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.Sequential(*[Block(DIM) for _ in range(layers)])
        self.out = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


class LitNet(pl.LightningModule):
    """Holds the saved network as ``self.model``: its names are ``model.<file name>``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def saved_network() -> dict[str, torch.Tensor]:
    """The 'pretrained' weights: a network with values no seeded initialisation gives."""
    torch.manual_seed(SEED)
    net = Net()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for b in net.buffers():
            b.copy_(torch.randn_like(b) * 0.1)
    return {k: v.detach().clone().contiguous() for k, v in net.state_dict().items()}


def save(tmp: Path, how: str) -> tuple[str, str, dict[str, torch.Tensor]]:
    """Save the weights as transformers does; returns (init_weights, prefix, file's tensors).

    ``single``: the network's own names in one file (the LightningModule needs
    ``prefix='model.'``); ``sharded``: the LightningModule's names in two shards and an index."""
    weights = saved_network()
    if how == "single":
        safetensors_torch.save_file(weights, str(tmp / "model.safetensors"))
        return str(tmp / "model.safetensors"), "model.", weights
    weights = {f"model.{k}": v for k, v in weights.items()}
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        safetensors_torch.save_file({k: weights[k] for k in keys}, str(tmp / file))
    index = {"metadata": {"total_size": 0},
             "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(tmp), "", weights


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(GLOBAL_BATCH * STEPS, DIM, generator=g)
    return x, x.sum(-1, keepdim=True).sin()


class Reads:
    """Wraps ``safetensors.safe_open`` so the worker sees which tensors it read."""

    def __init__(self) -> None:
        import safetensors

        self.module, self.original, self.names = safetensors, safetensors.safe_open, []
        reads = self

        class Counted:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self.inner = reads.original(*args, **kwargs)

            def __enter__(self) -> Counted:
                self.inner.__enter__()
                return self

            def __exit__(self, *exc: Any) -> None:
                self.inner.__exit__(*exc)

            def get_tensor(self, name: str) -> torch.Tensor:
                reads.names.append(name)
                return self.inner.get_tensor(name)

            def __getattr__(self, attr: str) -> Any:
                return getattr(self.inner, attr)

        safetensors.safe_open = Counted

    def restore(self) -> None:
        self.module.safe_open = self.original


class Snapshot(pl.Callback):
    """The kept parameters and the buffers right after the build (before any update)."""

    def __init__(self) -> None:
        self.kept: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        if not self.kept:  # first step: gradients computed, weights not yet updated
            self.kept = {n: p.detach().clone() for n, p in module.named_parameters()
                         if not p.is_meta and p.numel() > 0}
            self.buffers = {n: b.detach().clone() for n, b in module.named_buffers()}


def fit_pretrained(ctx: WorkerContext, schedule: str, init_weights: str, prefix: str) -> dict:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    torch.manual_seed(SEED)
    reads = Reads()
    try:
        snapshot = Snapshot()
        fit = trainer(ctx.world_size, GeneralParallel(schedule, init_weights=init_weights,
                                                      init_weights_prefix=prefix),
                      max_steps=STEPS, callbacks=[snapshot])
        with fit.init_module():
            model = LitNet()
        assert all(p.is_meta for p in model.parameters())
        fit.fit(model, rank_loader(data(), GLOBAL_BATCH, ctx.world_size, ctx.rank))
    finally:
        reads.restore()
    trained = {n: p.detach().clone() for n, p in model.named_parameters()
               if not p.is_meta and p.numel() > 0}
    return {"at_build": snapshot.kept, "buffers": snapshot.buffers, "trained": trained,
            "reads": reads.names, "all": [n for n, _ in model.named_parameters()]}


def reference(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """One device: the same model with the file's weights loaded whole, trained by Lightning."""
    torch.manual_seed(SEED)
    model = LitNet()
    model.load_state_dict({prefix + k: v for k, v in weights.items()})
    fit = trainer(1, "auto", max_steps=STEPS)
    fit.fit(model, rank_loader(data(), GLOBAL_BATCH, 1, 0))
    return {n: p.detach().clone() for n, p in model.named_parameters()}



@pytest.mark.distributed
@pytest.mark.parametrize("schedule,how", [("fsdp", "single"), ("1f1b", "sharded")])
def test_each_rank_reads_only_its_parameters_and_trains_like_one_device(
        world, tmp_path: Path, schedule: str, how: str) -> None:
    init_weights, prefix, weights = save(tmp_path, how)
    want = reference(weights, prefix)
    results = world.run(fit_pretrained, schedule, init_weights, prefix)
    buffers = {prefix + k for k in weights if k.endswith("shift")}
    seen: set[str] = set()
    for rank, got in enumerate(results):
        kept = set(got["trained"])  # what the rank keeps (the others are meta or empty)
        assert kept and kept != set(got["all"]), f"rank {rank} keeps {sorted(kept)}"
        for name in kept:  # loaded, not initialised
            assert torch.equal(got["at_build"][name], weights[name[len(prefix):]]), name
        for name in buffers:  # every rank holds and runs every buffer
            assert torch.equal(got["buffers"][name], weights[name[len(prefix):]]), name
        read = sorted(prefix + n for n in got["reads"])
        assert read == sorted(kept | buffers), f"rank {rank} read {read}"
        assert_same_state(got["trained"], {n: want[n] for n in got["trained"]}, f"rank {rank}")
        seen |= kept
    assert seen == set(want)  # every parameter loaded somewhere


def deferred_net() -> Net:
    from lightning_gsched.runtime import deferred_parameters

    with deferred_parameters():
        return Net()


def test_load_pretrained_on_one_device_equals_load_state_dict(tmp_path: Path) -> None:
    from lightning_gsched.runtime import load_pretrained

    _, _, weights = save(tmp_path, "single")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every tensor of the file is read: nothing to warn of
        net = load_pretrained(deferred_net(), tmp_path)
    for name, value in net.state_dict().items():
        assert torch.equal(value, weights[name]), name


def test_a_missing_tensor_is_named_with_its_file(tmp_path: Path) -> None:
    from lightning_gsched.errors import GschedError
    from lightning_gsched.runtime import load_pretrained

    weights = saved_network()
    del weights["blocks.2.linear.bias"]
    safetensors_torch.save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(GschedError, match=r"'blocks.2.linear.bias' is not in .*model.safetensors"):
        load_pretrained(deferred_net(), tmp_path)
    with pytest.raises(GschedError, match="init_weights_prefix"):  # names with another prefix
        load_pretrained(LitNet(), tmp_path)


def test_tensors_no_parameter_reads_are_warned_of(tmp_path: Path) -> None:
    """A file of a deeper model loaded into a shallower one: its extra layers are dropped, as
    transformers' from_pretrained does, but said (they were dropped silently, found by
    probing)."""
    from lightning_gsched.runtime import load_pretrained

    torch.manual_seed(SEED)
    deeper = {k: v.detach().clone() for k, v in Net(layers=6).state_dict().items()}
    safetensors_torch.save_file(deeper, str(tmp_path / "model.safetensors"))
    with pytest.warns(UserWarning, match=r"10 tensor\(s\) of .*model.safetensors are read by no "
                                         r"parameter or buffer of Net .*'blocks\.4\.linear\.bias'"):
        net = load_pretrained(deferred_net(), tmp_path)
    for name, value in net.state_dict().items():  # what the model has is still read
        assert torch.equal(value, deeper[name]), name


def test_a_prefix_starting_no_parameter_name_is_refused(tmp_path: Path) -> None:
    """A misspelt prefix covered no parameter: every one was drawn from the seed instead, with
    no error for a model whose modules all have reset_parameters() (found by probing)."""
    from lightning_gsched.errors import GschedError
    from lightning_gsched.runtime import deferred_parameters, load_pretrained, pretrained_weights

    init_weights, _, _ = save(tmp_path, "single")
    with deferred_parameters():
        model = LitNet()
    with pytest.raises(GschedError, match=r"init_weights_prefix='modle\.' starts no parameter "
                                          r"name of LitNet \(e\.g\. 'model\.inp\.weight'\)"):
        load_pretrained(model, pretrained_weights(init_weights, "modle."))


def test_a_mismatched_shape_is_named_with_its_file(tmp_path: Path) -> None:
    from lightning_gsched.errors import GschedError
    from lightning_gsched.runtime import load_pretrained

    weights = saved_network()
    weights["out.weight"] = torch.zeros(2, DIM)
    safetensors_torch.save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(GschedError, match=r"'out.weight' in .*model.safetensors has shape \[2, 8\]"):
        load_pretrained(deferred_net(), tmp_path)


def test_a_file_that_is_not_safetensors_is_named(tmp_path: Path) -> None:
    """A torch.save'd checkpoint passed as init_weights: safetensors' bare "header too large"
    named neither the file nor what to give (found by probing)."""
    from lightning_gsched.runtime import PretrainedWeightsError, load_pretrained

    torch.save(saved_network(), tmp_path / "pytorch_model.bin")
    with pytest.raises(PretrainedWeightsError, match=r"pytorch_model\.bin is not a safetensors "
                                                     r"file .*safe_serialization=True"):
        load_pretrained(deferred_net(), tmp_path / "pytorch_model.bin")


def test_a_wrong_path_is_refused_when_the_strategy_is_made(tmp_path: Path) -> None:
    from lightning_gsched import GeneralParallel
    from lightning_gsched.errors import GschedError

    with pytest.raises(GschedError, match="does not exist"):
        GeneralParallel("fsdp", init_weights=tmp_path / "nowhere.safetensors")
    with pytest.raises(GschedError, match="directory without model.safetensors.index.json"):
        GeneralParallel("fsdp", init_weights=tmp_path)


def fit_with_weights_built(ctx: WorkerContext, init_weights: str) -> None:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    fit = trainer(ctx.world_size, GeneralParallel("fsdp", init_weights=init_weights,
                                                  init_weights_prefix="model."), max_steps=1)
    fit.fit(LitNet(), rank_loader(data(), GLOBAL_BATCH, ctx.world_size, ctx.rank))


@pytest.mark.distributed
def test_init_weights_with_a_model_built_with_weights_is_refused(world, tmp_path: Path) -> None:
    from dist_harness import RankError

    init_weights, _, _ = save(tmp_path, "single")
    results = world.run(fit_with_weights_built, init_weights, expect_errors=True)
    for result in results:
        assert isinstance(result, RankError), result
        assert "built with weights" in result.message and "init_module" in result.message


class Tied(nn.Module):
    """An embedding and an output head sharing one weight, as language models do."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(5, DIM)
        self.head = nn.Linear(DIM, 5, bias=False)
        self.head.weight = self.wte.weight


@pytest.mark.parametrize("saved_as", ["wte.weight", "head.weight"])
def test_a_tied_parameter_is_read_under_the_name_the_file_has(tmp_path: Path,
                                                               saved_as: str) -> None:
    """transformers saves one of a tied parameter's names; either one fills the parameter."""
    from lightning_gsched.runtime import deferred_parameters, load_pretrained

    value = torch.randn(5, DIM)
    safetensors_torch.save_file({saved_as: value}, str(tmp_path / "model.safetensors"))
    with deferred_parameters():
        model = Tied()
    load_pretrained(model, tmp_path)
    assert model.head.weight is model.wte.weight
    assert torch.equal(model.wte.weight, value)


def test_a_file_of_another_dtype_is_converted_to_the_parameters(tmp_path: Path) -> None:
    from lightning_gsched.runtime import load_pretrained

    weights = saved_network()
    safetensors_torch.save_file({k: v.to(torch.bfloat16) for k, v in weights.items()},
                                str(tmp_path / "model.safetensors"))
    net = load_pretrained(deferred_net(), tmp_path / "model.safetensors")
    for name, value in net.state_dict().items():
        assert value.dtype == torch.float32
        assert torch.equal(value, weights[name].to(torch.bfloat16).float()), name


@pytest.mark.distributed
def test_a_tensor_missing_for_one_rank_fails_every_rank(world, tmp_path: Path) -> None:
    """Every rank checks every name against the headers, so a tensor only rank 1 would read
    fails rank 0 too (no rank waits for a peer that failed)."""
    from dist_harness import RankError

    weights = saved_network()
    del weights["out.bias"]  # the last stage's: kept by one rank under 1f1b
    safetensors_torch.save_file(weights, str(tmp_path / "model.safetensors"))
    results = world.run(fit_pretrained, "1f1b", str(tmp_path), "model.", expect_errors=True)
    for result in results:
        assert isinstance(result, RankError), result
        assert "'model.out.bias' is not in" in result.message, result.message
        assert "model.safetensors" in result.message


def fabric_pretrained(ctx: WorkerContext, init_weights: str) -> dict:
    """Fabric: ``fabric.init_module()`` then one ``strategy.step`` from the file's weights."""
    from lightning.fabric import Fabric

    from lightning_gsched.fabric import GeneralParallelFabric

    as_worker(ctx.rank)
    reads = Reads()
    try:
        fabric = Fabric(accelerator="cpu", devices=ctx.world_size,
                        strategy=GeneralParallelFabric("fsdp", init_weights=init_weights))
        fabric.launch()
        with fabric.init_module():
            net = Net()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
        model, optimizer = fabric.setup(net, optimizer)
        x, y = data()
        rows = GLOBAL_BATCH // ctx.world_size
        batch = torch.cat([x, y], 1)[ctx.rank * rows:(ctx.rank + 1) * rows]
        fabric.strategy.step(model, batch, lambda m, b: F.mse_loss(m(b[:, :DIM]), b[:, DIM:]))
        optimizer.step()
    finally:
        reads.restore()
    kept = {n: p.detach().clone() for n, p in net.named_parameters()
            if not p.is_meta and p.numel() > 0}
    return {"kept": kept, "reads": reads.names}


@pytest.mark.distributed
def test_fabric_reads_only_its_parameters_and_steps_like_one_device(world, tmp_path: Path) -> None:
    _, _, weights = save(tmp_path, "single")
    torch.manual_seed(SEED)
    net = Net()
    net.load_state_dict(weights)
    x, y = data()
    F.mse_loss(net(x[:GLOBAL_BATCH]), y[:GLOBAL_BATCH]).backward()
    torch.optim.SGD(net.parameters(), lr=0.05).step()
    want = dict(net.named_parameters())
    results = world.run(fabric_pretrained, str(tmp_path))
    buffers = {k for k in weights if k.endswith("shift")}
    for rank, got in enumerate(results):
        kept = set(got["kept"])
        assert kept and kept != set(want), f"rank {rank} keeps {sorted(kept)}"
        assert sorted(got["reads"]) == sorted(kept | buffers), f"rank {rank}"
        assert_same_state(got["kept"], {n: want[n].detach() for n in kept}, f"rank {rank}")
