"""Will Lightning's loop zero the gradients between this ``training_step`` and its backward?

Why it matters: the schedule computes a step's gradients inside ``training_step``, before the
loop's ``zero_grad`` (Lightning runs ``training_step``, then ``zero_grad``, then ``backward``).
If the parameters' gradients of the previous step were set aside and restored, as an
accumulation window needs, every rank would hold two owned-gradient buffers during the
schedule: one for a gradient the loop is about to throw away. When the loop certainly zeroes
them, the runtime drops them before the schedule and reuses their buffer
(``ModelRuntime.step(drop_previous_grads=True)``).

"Certainly" means Lightning's own rules: automatic optimization, backward not skipped (the SWA
callback skips it), the first batch of an accumulation window
(``_AutomaticOptimization._make_zero_grad_fn``), and nothing user-written that could see the
old gradients or keep them: ``LightningModule.optimizer_zero_grad`` and every
``on_before_zero_grad`` hook (module and callbacks) are Lightning's own. Otherwise the old
gradients are kept, which is always correct and costs one owned-gradient buffer.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule


def _overrides(obj: Any, base: type, name: str) -> bool:
    return getattr(type(obj), name, None) is not getattr(base, name)


def loop_zeroes_grads(trainer: Any, module: Any) -> bool:
    """True when the fit loop zeroes the gradients after this ``training_step``, before its
    backward, and no user code can observe the previous step's gradients in between."""
    if not getattr(module, "automatic_optimization", False):
        return False
    fit_loop = getattr(trainer, "fit_loop", None)
    if fit_loop is None or getattr(fit_loop, "_skip_backward", True):
        return False
    if _overrides(module, LightningModule, "optimizer_zero_grad") or _overrides(
            module, LightningModule, "on_before_zero_grad"):
        return False
    if any(_overrides(cb, Callback, "on_before_zero_grad") for cb in trainer.callbacks):
        return False
    batch_idx: int = fit_loop.epoch_loop.batch_idx
    accumulate: int = trainer.accumulate_grad_batches
    return batch_idx % accumulate == 0
