"""Whether a step's returned values are read by a batch-end hook, so they must be gathered.

Why: under a pipeline a step's return exists on the ranks that finished its microbatches, and
giving every rank its rows' share costs a gather (:mod:`lightning_gsched.engine.step_outputs`).
Lightning's own callbacks (progress bars, ModelCheckpoint, LearningRateMonitor, ...) override
``on_train_batch_end`` and friends without reading ``outputs``, so only the LightningModule's own
override, a callback from outside Lightning, or a user's function given to a callback
(``LambdaCallback``) asks for them.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden

# the batch-end hook that receives each step's return
BATCH_END_HOOKS = {
    "training_step": "on_train_batch_end",
    "validation_step": "on_validation_batch_end",
    "test_step": "on_test_batch_end",
}
_LIGHTNING_PACKAGES = ("lightning.", "pytorch_lightning.")


def outputs_read(module: LightningModule, step: str) -> bool:
    """Whether the LightningModule or a user's callback overrides the batch-end hook that
    receives ``step``'s return (the same verdict on every rank: the same classes)."""
    hook = BATCH_END_HOOKS.get(step)
    if hook is None:
        return False
    if is_overridden(hook, module, LightningModule):
        return True
    trainer: Any = module.trainer
    return any(_reads(callback, hook) for callback in trainer.callbacks)


def _reads(callback: Callback, hook: str) -> bool:
    """A callback of the user's class overriding ``hook``, or any callback given the hook as a
    function of the user's on the instance (``LambdaCallback(on_train_batch_end=...)``)."""
    if hook in vars(callback):
        return True
    return (not type(callback).__module__.startswith(_LIGHTNING_PACKAGES)
            and is_overridden(hook, callback, Callback))
