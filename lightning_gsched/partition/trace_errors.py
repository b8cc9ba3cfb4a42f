"""Turn a torch.fx tracing exception into a message that names the module, the line and the fix.

The tracer tags the exception with the innermost module whose ``forward`` was being traced
(:func:`attach_failure_site`); the offending line is the innermost traceback frame outside torch
and this package, i.e. in the user's code.
"""

from __future__ import annotations

import inspect
import os
import sys
import traceback

import torch
from torch import nn

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_OWN_DIR = os.path.dirname(os.path.abspath(__file__))


def attach_failure_site(exc: BaseException, path: str, cls: type) -> None:
    """Record where tracing failed; the innermost module wins (outer frames see it set)."""
    if hasattr(exc, "_gsched_path"):
        return
    try:
        exc._gsched_path, exc._gsched_class = path, cls  # type: ignore[attr-defined]
    except AttributeError:  # exception types with __slots__: blamed on the root instead
        pass


def failure_site(exc: BaseException) -> tuple[str | None, type | None]:
    """(module path, class) a failure was attributed to; path ``""`` is the root forward."""
    return getattr(exc, "_gsched_path", None), getattr(exc, "_gsched_class", None)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame in user code (not torch, not this package)."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        filename = os.path.abspath(frame.filename)
        if frame.filename.startswith("<") or filename.startswith((_TORCH_DIR, _OWN_DIR)):
            continue
        return frame
    return None


def _frame_in_torch_module(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame in the source file of the failing module when torch defines it
    (``nn.TransformerEncoder``'s fast-path checks): the user's frame would only be the call."""
    _, cls = failure_site(exc)
    try:
        source = inspect.getsourcefile(cls) if cls is not None else None
    except TypeError:
        source = None
    if source is None or not os.path.abspath(source).startswith(_TORCH_DIR):
        return None
    source = os.path.abspath(source)
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if os.path.abspath(frame.filename) == source:
            return frame
    return None


def site_of(exc: BaseException) -> str:
    """``file:line`` of the user code that stopped a trace, shortened for one-line summaries.

    Files of installed packages are named from their package root
    (``transformers/models/gpt2/modeling_gpt2.py:830``), the user's files from the working
    directory; ``"?"`` when no frame outside torch and this package is on the traceback.
    """
    frame = _frame_in_torch_module(exc) or user_frame(exc)
    if frame is None:
        return "?"
    path = os.path.abspath(frame.filename)
    roots = [os.getcwd(), *(p for p in sys.path if p and "-packages" in p)]
    for root in sorted((os.path.abspath(r) for r in roots), key=len, reverse=True):
        if path.startswith(root + os.sep):
            path = os.path.relpath(path, root)
            break
    return f"{path}:{frame.lineno}"


def failure_summary(exc: BaseException) -> str:
    """``ExcType: first line (at file:line)``: why one trace attempt stopped, on one line."""
    return f"{type(exc).__name__}: {first_line(exc)} (at {site_of(exc)})"


def explain(exc: BaseException) -> tuple[str, str]:
    """(kind, why fx could not record this in user terms); kind is "branch", "size" or "other"."""
    text = str(exc)
    if "cannot be used as inputs to control flow" in text:
        return "branch", (
            "forward branches on a tensor's value (if/while/and/or/bool() on a tensor), which "
            "fx cannot record because the value is unknown while tracing."
        )
    if "'len' is not supported" in text or "cannot be iterated" in text:
        return "size", "forward calls len() on, or iterates over, a tensor whose size fx does not know."
    if isinstance(exc, TypeError) or "Proxy" in text:
        return "size", (
            "a function got a symbolic value where it needs a concrete Python number (e.g. "
            "torch.ones(t, t) or range(t) with t taken from x.shape, int(x), a tensor used as "
            "a Python index)."
        )
    return "other", "forward does something torch.fx cannot record symbolically."


def failure_message(
    module: nn.Module,
    path: str,
    cls: type,
    exc: BaseException,
    symbolic_failure: BaseException | None = None,
    static_tried: bool = False,
) -> str:
    """The TraceFailedError text: what failed, where (file:line), why, and the fixes."""
    frame = user_frame(exc)
    where = f"\n  at {frame.filename}:{frame.lineno}: {(frame.line or '').strip()}" if frame else ""
    kind, why = explain(exc)
    root = type(module).__name__
    if path:
        what = f"{cls.__name__}.forward (module {path!r} of {root})"
        fixes = [
            f"pass leaf_modules=({cls.__name__},) or leaf_modules=({path!r},) so that module runs "
            "whole, with real tensors, inside one stage (auto_leaf=True does this automatically)"
        ]
    else:
        what = f"{root}.forward"
        fixes = [
            "move that code into a submodule and pass leaf_modules=(ThatModule,): a leaf module "
            "runs whole, with real tensors, inside one stage"
        ]
    if kind == "size" and not static_tried:
        fixes.append("pass static_shapes=True to trace with the example's sizes fixed")
    if kind == "branch":
        fixes.append(
            "branch on a non-tensor argument instead (plain values in example_args/"
            "example_kwargs are fixed at trace time)"
        )
    fixes.append("choose the cuts around a big leaf with split_points=[...]")
    tried = (
        f"\n(Tried in order: symbolic trace, which stopped with "
        f"{failure_summary(symbolic_failure)}; then the example's static shapes, which stopped "
        "as shown above.)"
        if symbolic_failure is not None
        else ""
    )
    return (
        f"torch.fx cannot trace {what}: {type(exc).__name__}: {first_line(exc)}{where}\n{why}\n"
        + "Fix: " + "; or ".join(fixes) + "." + tried
    )
