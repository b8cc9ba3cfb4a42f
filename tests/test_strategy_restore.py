"""GeneralParallel's checkpoint-restore hooks (the engine's checkpoint service,
engine/checkpoint.py, which the strategy's hooks call), called directly in one process (no
Trainer).

Lightning names the hooks' argument ``checkpoint``; strategy.py once imported its gathering
module under that very name, so inside ``load_optimizer_state_dict`` the module was shadowed by
the checkpoint dict and the branch for an already-built pipeline raised ``AttributeError``.

A model built without weights reads a sharded directory's tensors only at the build, while
Lightning restores the optimizers' param groups before it: another model's directory failed
there with torch's "loaded state dict contains a parameter group that doesn't match the size of
optimizer's group" (on every rank of any layout). It is now checked when ``ckpt_path`` is
given, by the shapes in the directory's index.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lightning_gsched.engine import TRAINER, CheckpointService, CheckpointView
from lightning_gsched.engine import checkpoint_sharded as sharded
from lightning_gsched.errors import CheckpointError
from lightning_gsched.runtime.fullstate import prune_optimizer_state
from lightning_models import LitGPT


def test_optimizer_state_loaded_into_a_built_pipeline_keeps_only_owned_parameters() -> None:
    owned, elsewhere = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    trained = torch.optim.Adam([owned, elsewhere])
    (owned.sum() + elsewhere.sum()).backward()
    trained.step()
    saved = copy.deepcopy(trained.state_dict())

    fresh = torch.optim.Adam([owned, elsewhere])
    # the runtime facade of a built pipeline in which this rank owns `owned` only
    runtime = SimpleNamespace(
        prune_optimizer_state=lambda optimizers: prune_optimizer_state(optimizers, [owned]))
    # what the hook reads of the strategy, with the pipeline already built
    engine = SimpleNamespace(runtime=runtime, tensor_parallel_size=1)  # one rank per worker
    view = CheckpointView(module=None, engine=engine,  # type: ignore[arg-type]
                          optimizers=[fresh], rank=0, world_size=1, checkpoint_io=None)
    CheckpointService(None, TRAINER, "full", "auto").load_optimizer_states(view, [saved])

    assert set(fresh.state) == {owned}  # this rank's parameters only, restored
    torch.testing.assert_close(fresh.state[owned]["exp_avg"], trained.state[owned]["exp_avg"])


def _sharded_directory(module: nn.Module, path: Any) -> None:
    """``module``'s weights and Adam state as the Trainer writes a sharded directory (one
    process: every key is this rank's)."""
    optimizer = torch.optim.Adam(module.parameters())
    sum(p.sum() for p in module.parameters()).backward()
    optimizer.step()
    everything = lambda key: True  # one process writes every key
    sharded.save({"state_dict": sharded.local_model_state(module, everything),
                  "optimizer_states": [sharded.local_optimizer_state(module, optimizer,
                                                                     everything)],
                  "global_step": 1}, path, rank=0)


def _load_deferred(path: Any) -> dict:
    """Lightning's ``ckpt_path`` read into a LitGPT built without weights."""
    with torch.device("meta"):
        module = LitGPT(optimizer="adam")
    view = CheckpointView(module=module, engine=None, optimizers=[], rank=0, world_size=1,
                          checkpoint_io=None, timeout=30.0)
    return CheckpointService(None, TRAINER, "sharded", "auto").read(view, path, None,
                                                                     read_default=dict)


@pytest.mark.parametrize("other, phrase", [
    ({"layers": 2}, r"does not hold this model's parameters: 11 of 37 entries .* missing"),
    ({"tie": "module"}, r"holds 1 entries LitGPT does not have \(model.head.weight\)"),
], ids=["fewer-layers", "an-alias-more"])
def test_another_models_sharded_directory_is_refused_before_a_deferred_build(
        tmp_path, other: dict, phrase: str) -> None:
    _sharded_directory(LitGPT(**other), tmp_path / "other.dir")
    with pytest.raises(CheckpointError, match=phrase):
        _load_deferred(str(tmp_path / "other.dir"))
    _sharded_directory(LitGPT(), tmp_path / "same.dir")
    checkpoint = _load_deferred(str(tmp_path / "same.dir"))  # this model's: read, no tensors
    assert checkpoint["global_step"] == 1 and checkpoint["state_dict"] == {}
