"""Refuse a direct call of the model while its pipeline runs, naming the way to call it.

Why: between a pipeline's build and its end a rank holds only the weights of its own stages;
the other stages' parameters are empty tensors there (runtime/flat.py). A user who calls the
model outside a step (``model(x)`` in a Fabric loop between ``step`` calls, ``pl_module(x)`` in
a callback) got torch's shape error from inside some layer ("mat2 must be a matrix"), which
says nothing of the cause. The guard is a forward pre-hook on the model: a step's own calls are
intercepted (engine/intercept.py) and pass; so does any call on a rank that holds every stage
(ddp), where the model is whole.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from lightning_gsched.engine.intercept import intercepting
from lightning_gsched.errors import WholeModelCallError
from lightning_gsched.runtime import ModelRuntime


class WholeCallGuard:
    """The pre-hook (see the module doc). It holds its runtime weakly: a module copied with
    ``copy.deepcopy`` (weight averaging callbacks) copies the hook, not the runtime."""

    def __init__(self, runtime: ModelRuntime, rank: int) -> None:
        self.runtime = weakref.ref(runtime)
        self.rank = rank

    def __call__(self, module: nn.Module, args: Any) -> None:
        runtime = self.runtime()
        if runtime is None or runtime.closed or intercepting(module):
            return
        absent = runtime.absent_stages()
        if absent:
            raise WholeModelCallError(refusal(type(module).__name__, self.rank, absent))


def install(module: nn.Module, runtime: ModelRuntime, rank: int) -> Any:
    """Guard ``module``'s calls while ``runtime`` runs; returns the handle to ``remove()``."""
    return module.register_forward_pre_hook(WholeCallGuard(runtime, rank))


def refusal(name: str, rank: int, absent: list[int]) -> str:
    stages = ", ".join(map(str, absent))
    return (
        f"{name}(...) was called directly, outside a step of its pipeline: rank {rank} holds "
        f"only its own stages' weights while the pipeline runs (those of stage(s) {stages} are "
        "on other ranks, empty here). Run the forward through the schedule instead: from "
        "training/validation/test/predict_step (or trainer.validate/predict) under the "
        "Trainer, fabric.strategy.evaluate(model, batch, fn) under Fabric. For the whole "
        "model on every rank, end the pipeline first: fabric.strategy.finish() under Fabric; "
        "the Trainer gathers it when fit/validate/test/predict returns"
    )
