"""What a Lightning project may not do under GeneralParallel, refused at setup with the fix.

Why at setup: each of these would otherwise train silently wrong or fail later with an error
that does not name the cause (a user's ``backward`` never called; Stochastic Weight Averaging
averaging the empty parameters a rank does not hold). Every rank runs the same checks on the
same classes, so every rank refuses alike, before any collective.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_gsched.errors import StrategyConfigError


def check_supported(module: LightningModule, trainer: Any, fitting: bool,
                    sync_batchnorm: bool) -> None:
    """Refuse what GeneralParallel cannot run as one device would, naming the fix."""
    name = type(module).__name__
    if not module.automatic_optimization:
        raise StrategyConfigError(
            f"{name} sets automatic_optimization = False. GeneralParallel runs forward and "
            "backward inside the schedule, so the loop must own the backward: use automatic "
            "optimization (return the loss from training_step)")
    if getattr(module, "_compiler_ctx", None) is not None:
        raise StrategyConfigError(
            f"{name} was passed compiled whole (trainer.fit(torch.compile(model)): Lightning "
            "then runs its forward and steps as one compiled graph, which GeneralParallel can "
            "neither trace nor cut into stages. Pass the uncompiled module and compile its "
            "blocks instead, e.g. in configure_model: `for i, block in enumerate(self.blocks): "
            "self.blocks[i] = torch.compile(block)` (each compiled block is one unit of the "
            "split; docs/usage.md, 'torch.compile')")
    if fitting and is_overridden("backward", module, LightningModule):
        raise StrategyConfigError(
            f"{name} overrides backward(). GeneralParallel runs each microbatch's backward "
            "inside the schedule (the loss's rank starts it from the loss training_step "
            "returned), so your backward would never be called and its changes (a scaled "
            "loss, retain_graph, ...) silently lost. Put a change of the loss into "
            "training_step's returned loss, and work on the gradients in on_after_backward or "
            "on_before_optimizer_step")
    swa = [type(c).__name__ for c in trainer.callbacks if isinstance(c, StochasticWeightAveraging)]
    if fitting and swa:
        raise StrategyConfigError(
            f"{swa[0]} (Stochastic Weight Averaging) is not supported by GeneralParallel: it "
            "averages a copy of the whole model with the module's parameters at each epoch, "
            "and while the pipeline runs a rank holds only its own stages (the others are "
            "empty). Remove the callback, or average weights yourself from a checkpoint")
    if fitting and sync_batchnorm:
        raise StrategyConfigError(
            "Trainer(sync_batchnorm=True) is not supported by GeneralParallel: SyncBatchNorm "
            "runs a collective inside every training forward, and a schedule runs each "
            "stage's forwards on different ranks at different times. Leave it off: every "
            "rank then ends each step with the BatchNorm running statistics one device would "
            "have (docs/runtime.md, 'BatchNorm and other running statistics')")
