"""The capture of the model's call survives user code that catches exceptions around it.

The engine stops the user's step right after ``self(...)`` / ``model(...)`` by raising an
exception from the intercepted ``forward``. It used to be an ``Exception``, so a user's
``try: out = self(x) except Exception: ...`` swallowed it and the step went on with the
fallback; the capture then claimed the step "never calls self(...)". Now the capture derives
from ``BaseException`` (``except Exception`` lets it through), and a bare ``except:`` that still
swallows it is named in the error. One process, no Trainer.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_gsched.engine.intercept import StepCaller
from lightning_gsched.errors import TrainingStepError
from lightning_models import LitGPT, tokens
from models import seeded


class GuardedGPT(LitGPT):
    """LitGPT whose step guards the model call with its own fallback."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (t,) = batch
        try:
            logits = self(t[:, :-1])
        except Exception:  # noqa: BLE001 - the user's own fallback, the point of this test
            return torch.zeros(())
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), t[:, 1:].reshape(-1))


def test_except_exception_around_self_call_does_not_swallow_the_capture() -> None:
    module = seeded(0, GuardedGPT)
    batch = (tokens(4),)
    caller = StepCaller.for_hook(module, "training_step", (0,))
    args, kwargs = caller.capture(batch)
    assert torch.equal(args[0], batch[0][:, :-1]) and kwargs == {}
    assert "forward" not in vars(module) and "log" not in vars(module)  # unpatched afterwards


def test_a_bare_except_that_swallows_the_capture_is_named() -> None:
    model = nn.Linear(3, 2)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        try:
            out = model(x)
        except:  # noqa: E722 - swallows BaseException too: what the error must name
            out = torch.zeros(len(x), 2)
        return F.mse_loss(out, y)

    caller = StepCaller(model, lambda micro: loss_fn(model, micro), "loss_fn", who="model",
                        record_logs=False)
    with pytest.raises(TrainingStepError, match=r"loss_fn calls model\(\.\.\.\) inside a try "
                                                r"block whose bare `except:`"):
        caller.capture((torch.ones(4, 3), torch.zeros(4, 2)))
    assert "forward" not in vars(model)


def test_a_step_that_never_calls_the_model_is_still_told_so() -> None:
    model = nn.Linear(3, 2)
    caller = StepCaller(model, lambda micro: micro.sum(), "loss_fn", who="model",
                        record_logs=False)
    with pytest.raises(TrainingStepError, match=r"loss_fn never calls model\(\.\.\.\)"):
        caller.capture(torch.ones(2, 3))


def test_a_model_without_weights_run_directly_is_told_to_call_self() -> None:
    """A model built without weights (meta parameters) whose step calls ``self.model(x)``:
    torch failed first ("Tensor on device cpu is not on the expected device meta!") on every
    rank; now the step is told to call ``self(...)`` (found by probing)."""

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with torch.device("meta"):
                self.model = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

    holder = Holder()
    caller = StepCaller(holder, lambda micro: F.mse_loss(holder.model(micro), micro[:, :2]),
                        "Lit.training_step", record_logs=False)
    with pytest.raises(TrainingStepError, match=r"never calls self\(\.\.\.\).*not "
                                                r"`self\.model\(x\)`.*weights do not exist yet"):
        caller.capture(torch.ones(2, 3))
    other = StepCaller(holder, lambda micro: micro["missing"], "Lit.training_step",
                       record_logs=False)
    with pytest.raises(IndexError):  # the user's own error before the call stays as it is
        other.capture(torch.ones(2, 3))


class AppendingGPT(LitGPT):
    """Lightning's ``self.validation_step_outputs.append(...)`` pattern."""

    def __init__(self) -> None:
        super().__init__()
        self.validation_step_outputs: list[torch.Tensor] = []
        self.names: list[str] = ["kept"]  # a list the step does not touch

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (t,) = batch
        logits = self(t[:, :-1])
        self.validation_step_outputs.append(logits[:, -1])


def test_a_step_appending_to_a_module_list_is_warned_of_once() -> None:
    module = seeded(0, AppendingGPT)
    batch = (tokens(4),)
    caller = StepCaller.for_hook(module, "validation_step", (0,))
    output = module(batch[0][:, :-1])
    with pytest.warns(UserWarning, match=r"AppendingGPT.validation_step appended to "
                                         r"self.validation_step_outputs: .* once per microbatch"):
        caller.finish(batch, output, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per attribute and process
        caller.finish(batch, output, 1)
    assert len(module.validation_step_outputs) == 2 and module.names == ["kept"]


def test_a_returned_dict_without_loss_is_named_as_such() -> None:
    from lightning_gsched.engine.intercept import step_loss

    with pytest.raises(TrainingStepError, match=r"M.training_step returned a dict without a "
                                                r"'loss' tensor \(keys \['acc'\]\)"):
        step_loss({"acc": torch.ones(())}, "M.training_step")
    with pytest.raises(TrainingStepError, match="returned NoneType.*Skipping a step"):
        step_loss(None, "M.training_step")
