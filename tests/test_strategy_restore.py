"""GeneralParallel's checkpoint-restore hooks (lightning/checkpointing.py, to which the strategy's
hooks delegate), called directly in one process (no Trainer).

Lightning names the hooks' argument ``checkpoint``; strategy.py once imported its gathering
module under that very name, so inside ``load_optimizer_state_dict`` the module was shadowed by
the checkpoint dict and the branch for an already-built pipeline raised ``AttributeError``.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
from torch import nn

from lightning_gsched.lightning.checkpointing import SaveContext, TrainerCheckpoints
from lightning_gsched.runtime.fullstate import prune_optimizer_state


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
    ctx = SaveContext(module=None, engine=SimpleNamespace(runtime=runtime),  # type: ignore[arg-type]
                      optimizers=[fresh], rank=0, world_size=1, checkpoint_io=None)
    TrainerCheckpoints("full", "auto").load_optimizer_states(
        ctx, {"optimizer_states": [saved]}, torch.device("cpu"))

    assert set(fresh.state) == {owned}  # this rank's parameters only, restored
    torch.testing.assert_close(fresh.state[owned]["exp_avg"], trained.state[owned]["exp_avg"])
