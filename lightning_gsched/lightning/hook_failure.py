"""Which Lightning hook an exception came from, and the callback that reports it first.

Why: when a rank fails between steps (a callback, the dataloader, ``validation_step``), the
other ranks are waiting for it in a collective and only see a lost connection. The failing rank
therefore writes ``"rank r failed in <hook>: <error>"`` into the job's store before anything else
runs (:mod:`.control`). Lightning hands ``on_exception`` the exception only, not the hook, but its
dispatchers (``_call_callback_hooks``, ``_call_lightning_module_hook``, ``_call_strategy_hook``, ...)
hold the hook's name in a local ``hook_name``, which the traceback's frames keep.

:class:`FailureNotice` is put first in ``trainer.callbacks`` by the strategy so that its
``on_exception`` runs before any other callback's: a ``ModelCheckpoint(save_on_exception=True)``
would otherwise start a collective save while the peers are stuck elsewhere.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Callable

from lightning.pytorch.callbacks import Callback

from lightning_gsched.errors import error_text

_DISPATCHERS = {
    "_call_callback_hooks": "callback",
    "_call_lightning_module_hook": "LightningModule",
    "_call_lightning_datamodule_hook": "LightningDataModule",
    "_call_strategy_hook": "strategy",
}
_DATA_FRAMES = ("__next__", "_fetch_next_batch")
# Lightning's loops over the callbacks' checkpoint hooks, which keep the callback in a local
# but not the hook's name (a failing on_save_checkpoint was named as the hook that saved)
_CALLBACK_LOOPS = {
    "_call_callbacks_on_save_checkpoint": "on_save_checkpoint",
    "_call_callbacks_on_load_checkpoint": "on_load_checkpoint",
    "_call_callbacks_state_dict": "state_dict",
    "_call_callbacks_load_state_dict": "load_state_dict",
}


def failed_hook(exception: BaseException) -> str:
    """The innermost Lightning hook the exception went through, e.g. ``"validation_step"``,
    ``"ModelCheckpoint.on_train_batch_end"`` or ``"the dataloader (next batch)"``."""
    found = "the training loop"
    tb: TracebackType | None = exception.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        name = frame.f_code.co_name
        kind = _DISPATCHERS.get(name)
        if kind is not None and isinstance(frame.f_locals.get("hook_name"), str):
            hook = frame.f_locals["hook_name"]
            callback = frame.f_locals.get("callback")
            if kind == "callback" and callback is not None:
                hook = f"{type(callback).__name__}.{hook}"
            elif kind == "LightningModule":
                module = frame.f_locals.get("pl_module")
                hook = f"{type(module).__name__}.{hook}" if module is not None else hook
            found = hook
        elif name in _CALLBACK_LOOPS and frame.f_locals.get("callback") is not None:
            found = f"{type(frame.f_locals['callback']).__name__}.{_CALLBACK_LOOPS[name]}"
        elif name in _DATA_FRAMES and "fetchers" in frame.f_code.co_filename:
            found = "the dataloader (next batch)"
        tb = tb.tb_next
    return found


def failure_message(rank: int, exception: BaseException) -> str:
    """``"rank 0 failed in validation_step: ValueError: boom"`` (a RuntimeFault's own text,
    which already names the rank and the action, is kept as it is)."""
    from lightning_gsched.errors import RuntimeFault

    if isinstance(exception, RuntimeFault):
        return str(exception).split(". First failure reported in the job")[0]
    return f"rank {rank} failed in {failed_hook(exception)}: {error_text(exception)}"


class FailureNotice(Callback):
    """Calls ``on_failure(exception)`` before every other callback's ``on_exception``."""

    def __init__(self, on_failure: Callable[[BaseException], None]) -> None:
        self.on_failure = on_failure

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.on_failure(exception)
