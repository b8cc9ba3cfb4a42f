"""Run the user's step on one microbatch, with the model's call intercepted.

Why: the user's step stays unchanged: a LightningModule's ``training_step`` (and validation,
test, predict steps) calling ``self(...)``, or a Fabric loss function calling ``model(...)``.
The engine runs the step twice per microbatch, on different ranks:

* capture (on the rank that computes stage 0): the model's call records its arguments and stops
  the step right there, so the pipeline gets the model's input without running any of the model;
* finish (on the rank that computes the last stage, inside the executor): the model's call
  returns the pipeline's output instead of running the model, and the rest of the step computes
  the loss.

For the Trainer, ``self.log`` calls made while finishing are recorded (with the microbatch)
instead of going to Lightning: the strategy reduces them over microbatches and ranks and logs
each value once, the same on every rank. During capture they are dropped (the finishing run logs
them). A logged tensor is kept as a tensor (detached, as Lightning keeps it), not read with
``.item()``: on a GPU each read waits for the device, once per value and microbatch; the step's
one exchange (:mod:`.logsync`) turns them all into numbers with a single read.

Stopping the step uses an exception, :class:`_Captured`. It derives from ``BaseException`` (as
``KeyboardInterrupt`` and ``GeneratorExit`` do), so a user's ``try: ... except Exception:``
around the model's call lets it through. A bare ``except:`` still catches it; the capture then
notices that the call happened but the step went on, and raises a ``TrainingStepError`` saying
so, instead of guessing.

A step that runs a backward itself (``loss.backward()`` left in a ported loop) is named with a
``TrainingStepError``: the schedule runs each microbatch's backward from the loss the step
returns. The probe runs under ``no_grad``, where such a call fails inside
``torch.autograd.backward``; the error's traceback passing through it is the sign (nothing is
checked unless the step failed). A finishing run has the real graph, where the call would
succeed (and, with ``retain_graph=True``, add its gradients twice): a hook on the output
tensors the step gets, held only while it runs, fails it when a gradient reaches them.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from lightning_gsched.errors import TrainingStepError, error_text, mark_origin

# the model's call on one microbatch: positional and keyword arguments
CallArgs = tuple[tuple[Any, ...], dict[str, Any]]


class _Captured(BaseException):
    """Raised by the intercepted ``forward`` to leave the user's step after the model's call
    (a BaseException so that ``except Exception:`` in user code lets it through)."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("captured")
        self.args, self.kwargs = args, kwargs


@dataclass
class LogRecord:
    """One ``self.log(name, value, **options)`` call made on microbatch ``micro``."""

    micro: int
    name: str
    value: float | torch.Tensor  # a tensor (0-dim, detached) until the step's exchange
    options: dict[str, Any]


@dataclass
class ProbeResult:
    """What the probe saw: the arguments of the one ``self(...)`` call and the step's result."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    result: Any


@dataclass
class StepCaller:
    """Calls the user's step on a microbatch in probe, capture or finish mode (see module doc).

    ``module``: the model whose ``forward`` the step calls. ``run(micro_batch)``: runs the
    user's step. ``name`` (e.g. ``"LitGPT.training_step"``) and ``who`` (``"self"`` in a
    LightningModule's step, ``"model"`` in a Fabric loss function) make the messages.
    ``record_logs``: intercept ``module.log`` (Trainer only).
    """

    module: nn.Module
    run: Callable[[Any], Any]
    name: str
    who: str = "self"
    record_logs: bool = True
    logs: list[LogRecord] = field(default_factory=list)

    @classmethod
    def for_hook(cls, module: nn.Module, hook: str, rest: tuple[Any, ...] = (),
                 kwargs: dict[str, Any] | None = None) -> "StepCaller":
        """A LightningModule's ``<hook>(microbatch, *rest, **kwargs)``, e.g. training_step."""
        kwargs = dict(kwargs or {})

        def run(micro_batch: Any) -> Any:
            return getattr(module, hook)(micro_batch, *rest, **kwargs)

        return cls(module, run, f"{type(module).__name__}.{hook}")

    @contextmanager
    def _patched(self, forward: Callable[..., Any], log: Callable[..., Any]) -> Iterator[None]:
        module = self.module
        patches = {"forward": forward, **({"log": log} if self.record_logs else {})}
        saved = {name: (name in vars(module), vars(module).get(name)) for name in patches}
        for name, value in patches.items():
            setattr(module, name, value)
        _INTERCEPTING.add(id(module))
        try:
            yield
        finally:
            _INTERCEPTING.discard(id(module))
            for name, (had, old) in saved.items():
                if had:
                    setattr(module, name, old)
                else:
                    delattr(module, name)

    def capture(self, micro_batch: Any) -> CallArgs:
        """The ``(args, kwargs)`` the step passes to the model for this microbatch."""
        called = False

        def forward(*args: Any, **kwargs: Any) -> Any:
            nonlocal called
            called = True
            raise _Captured(args, kwargs)

        with self._patched(forward, _drop_log):
            try:
                self.run(micro_batch)
            except _Captured as call:
                return call.args, call.kwargs
            except Exception as exc:
                # a model built without weights (meta parameters) that the step runs directly,
                # self.model(x), fails inside torch before the call is ever made ("not on the
                # expected device meta"): say what the step must do instead
                if not called and "meta" in str(exc):
                    raise TrainingStepError(
                        f"{self._never()} (it failed before: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}; the model's "
                        "weights do not exist yet outside the pipeline)") from exc
                raise
        raise TrainingStepError(self._swallowed() if called else self._never())

    def probe(self, micro_batch: Any) -> "ProbeResult":
        """Run the whole step with the real forward, checking it calls the model once.

        Used once per run on every rank (same data everywhere, so every rank reaches the same
        verdict); logging is dropped. The caller preserves RNG and buffers around it.
        """
        real = type(self.module).forward.__get__(self.module)
        calls: list[CallArgs] = []

        def forward(*args: Any, **kwargs: Any) -> Any:
            calls.append((args, kwargs))
            if len(calls) > 1:
                raise TrainingStepError(self._twice())
            return real(*args, **kwargs)

        with self._patched(forward, _drop_log):
            try:
                result = self.run(micro_batch)
            except Exception as exc:
                if _ran_backward(exc):
                    raise TrainingStepError(self._backward(exc)) from exc
                raise
        if not calls:
            raise TrainingStepError(self._never())
        return ProbeResult(calls[0][0], calls[0][1], result)

    def _never(self) -> str:
        return (
            f"{self.name} never calls {self.who}(...). GeneralParallel "
            "pipelines the module's forward(), so the step must call it exactly once, e.g. "
            f"`out = {self.who}(x)` (not `{self.who}.model(x)`: move that call into forward())"
        )

    def _twice(self) -> str:
        return (
            f"{self.name} calls {self.who}(...) more than once; "
            f"GeneralParallel pipelines one forward per step. Call {self.who}(...) once (e.g. on "
            "concatenated inputs) and split its output"
        )

    def _swallowed(self) -> str:
        return (
            f"{self.name} calls {self.who}(...) inside a try block whose bare `except:` (or "
            "`except BaseException:`) caught GeneralParallel's capture of the call's inputs, "
            "so the step went on without the model's output. Catch `Exception` there (the "
            "capture is not one), or move the try block away from the call"
        )

    def _backward(self, exc: BaseException | None = None) -> str:
        calls = ("loss.backward() or self.manual_backward(loss)" if self.who == "self"
                 else "loss.backward()")
        failed = f" (it failed there with {error_text(exc)})" if exc is not None else ""
        return (
            f"{self.name} calls backward itself ({calls}){failed}. Under GeneralParallel the "
            "schedule runs each microbatch's backward itself, from the loss "
            f"{self.name} returns: remove the backward call from {self.name} and return the "
            "loss"
        )

    def _guard_backward(self, output: Any) -> list[RemovableHandle]:
        """Hooks failing a backward that reaches ``output`` while the step runs (module doc):
        one per output tensor that requires grad (none under no_grad)."""
        if not torch.is_grad_enabled():
            return []

        def hook(grad: torch.Tensor) -> None:
            raise TrainingStepError(self._backward())

        return [leaf.register_hook(hook)  # type: ignore[no-untyped-call]
                for leaf in pytree.tree_leaves(output)
                if isinstance(leaf, torch.Tensor) and leaf.requires_grad]

    def finish(self, micro_batch: Any, output: Any, micro: int) -> Any:
        """Run the step with the model's call returning ``output``; returns the step's result."""
        calls = 0

        def forward(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:
                raise TrainingStepError(self._twice())
            return output

        def log(name: str, value: Any, *args: Any, **options: Any) -> None:
            if args:
                raise TrainingStepError(
                    f"self.log({name!r}, ...) got positional options; pass them by keyword "
                    "(prog_bar=True, ...) so GeneralParallel can replay them"
                )
            if _is_metric(value):
                value, options = _logged_metric(self.module, name, value, options)
            if isinstance(value, torch.Tensor) and value.dtype == torch.float64:
                options = {**options, FLOAT64_OPTION: True}
            self.logs.append(LogRecord(micro, name, _logged_value(name, value), options))

        lists = _list_lengths(self.module)
        guards = self._guard_backward(output)
        with self._patched(forward, log):
            try:
                result = self.run(micro_batch)
            except Exception as exc:
                # the runtime reports the action it ran this in; this names the user's hook
                where = f"{self.name} after {self.who}(...)"
                if not isinstance(exc, TrainingStepError) and _ran_backward(exc):
                    named = TrainingStepError(self._backward(exc))
                    mark_origin(named, where)
                    raise named from exc
                mark_origin(exc, where)
                raise
            finally:
                for guard in guards:
                    guard.remove()
        _warn_grown_lists(self.module, lists, self.name, self.who)
        return result


# torch.autograd.backward (which Tensor.backward, Lightning's manual_backward and Fabric's
# backward reach): a frame of either in a step's error means the step ran a backward itself
_BACKWARD_CODES = (torch.autograd.backward.__code__, torch.Tensor.backward.__code__)


def _ran_backward(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside a backward the step called (module doc)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in _BACKWARD_CODES:
            return True
        tb = tb.tb_next
    return False


# ids of the modules whose call a StepCaller intercepts right now (see intercepting)
_INTERCEPTING: set[int] = set()


def intercepting(module: nn.Module) -> bool:
    """Whether a call of ``module`` now is a step's intercepted call (capture, finish or
    probe), not a direct call of the model by the user."""
    return id(module) in _INTERCEPTING


def _list_lengths(module: nn.Module) -> dict[str, int]:
    """The lengths of the module's public list attributes (see :func:`_warn_grown_lists`)."""
    return {name: len(value) for name, value in vars(module).items()
            if isinstance(value, list) and not name.startswith("_")}


# (class, attribute) pairs already warned of, once per process
_WARNED_LISTS: set[tuple[type, str]] = set()


def _warn_grown_lists(module: nn.Module, before: dict[str, int], step: str, who: str) -> None:
    """Warn once when the step appended to a list attribute of the module (Lightning's
    ``self.validation_step_outputs.append(...)`` pattern): the step finishes on the rank that
    computes each microbatch's last stage, so the list grows there, once per microbatch, and
    stays empty on the other ranks, where an epoch-end hook that stacks it fails."""
    for name, length in _list_lengths(module).items():
        key = (type(module), name)
        if length > before.get(name, length) and key not in _WARNED_LISTS:
            _WARNED_LISTS.add(key)
            warnings.warn(
                f"{step} appended to {who}.{name}: under GeneralParallel the step finishes each "
                "microbatch on the rank computing its last stage, so the list grows there, once "
                "per microbatch, and stays empty on the other ranks. Append in the batch-end "
                "hook instead (e.g. on_validation_batch_end(outputs, ...)), whose outputs every "
                "rank gets for the rows it loaded (docs/usage.md, \"What the batch-end hooks "
                "receive\")", stacklevel=2)


def _drop_log(*args: Any, **kwargs: Any) -> None:
    """``self.log`` during capture: the finishing run on the last-stage rank logs instead."""


# a LogRecord option naming the torchmetrics Metric logged (its submodule name), whose value is
# the Metric's last forward on that microbatch (logsync.replay logs the Metric itself)
METRIC_OPTION = "_gsched_metric"
# a LogRecord option marking a float64 value, logged in float64 again after the reduction (as
# Lightning keeps a float64 tensor's dtype; the exchange carries every value in float64)
FLOAT64_OPTION = "_gsched_float64"


def _is_metric(value: Any) -> bool:
    """A torchmetrics ``Metric`` (Lightning's dependency, imported only for such an object)."""
    if isinstance(value, (torch.Tensor, int, float, bool)):
        return False
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - Lightning installs torchmetrics
        return False
    return isinstance(value, Metric)


def _logged_metric(module: nn.Module, name: str, metric: Any, options: dict[str, Any]
                   ) -> tuple[Any, dict[str, Any]]:
    """``self.log(name, metric)``: the value this microbatch logs for the step (the metric's
    last forward here: NaN when only ``update`` was called) and the options naming the
    metric's submodule, so that every rank logs its own copy of it at the step's end and
    Lightning computes it over every rank's state at the epoch's end (module doc)."""
    path = options.get("metric_attribute")
    if path is None:  # usually an attribute of the LightningModule itself
        path = next((n for n, m in module.named_children() if m is metric), None)
    if path is None:
        path = next((n for n, m in module.named_modules() if m is metric and n), None)
    if path is None:
        raise TrainingStepError(
            f"self.log({name!r}, metric): the torchmetrics Metric is not a submodule of the "
            "LightningModule; assign it as an attribute (self.acc = Accuracy(...)) so that "
            "every rank can log its own copy")
    cache = metric._forward_cache
    value = cache if isinstance(cache, torch.Tensor) and cache.numel() == 1 else float("nan")
    return value, {**options, METRIC_OPTION: path}


def _logged_value(name: str, value: Any) -> float | torch.Tensor:
    """A logged scalar as kept until the exchange: a tensor stays on its device (a copy,
    detached, as Lightning's own ``log`` keeps it: the step may change the original in place),
    a number becomes a float. No host read here (see the module doc)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TrainingStepError(
                f"self.log({name!r}) got a tensor of shape {tuple(value.shape)}; log scalars"
            )
        return value.detach().clone().reshape(())
    if isinstance(value, (int, float, bool)):
        return float(value)
    raise TrainingStepError(
        f"self.log({name!r}) got a {type(value).__name__}; under GeneralParallel log tensors, "
        "numbers or torchmetrics Metrics"
    )


def step_loss(result: Any, hook: str) -> torch.Tensor:
    """The loss a training step returned (a tensor, or a dict with 'loss')."""
    loss = result.get("loss") if isinstance(result, dict) else result
    if isinstance(result, dict) and not isinstance(loss, torch.Tensor):
        raise TrainingStepError(
            f"{hook} returned a dict without a 'loss' tensor (keys {sorted(map(str, result))}); "
            "Lightning and GeneralParallel take the loss from its 'loss' key: add it")
    if not isinstance(loss, torch.Tensor):
        raise TrainingStepError(
            f"{hook} returned {type(result).__name__}; under GeneralParallel it must return the "
            "loss tensor (or a dict with 'loss'). Skipping a step by returning None is not "
            "supported: the step's microbatches run on several ranks"
        )
    return loss
