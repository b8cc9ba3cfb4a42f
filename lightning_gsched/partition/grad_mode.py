"""``torch.no_grad()`` (and every grad-mode switch) in a traced forward: kept whole, not dropped.

Why: torch.fx records tensor operations, not the grad mode they ran under, so the graph of
``with torch.no_grad(): t = self.target(h)`` computes ``t`` with gradients: the split would give
``target`` gradients the model never gives it and send gradient through ``h`` where the model
sends none (a momentum encoder, a frozen teacher, a stop-gradient). ``verify=`` catches it only
on models it runs (up to 1 GiB by default). So while the tracer runs traced code, a switch of
the grad mode (``torch.no_grad()``, ``torch.enable_grad()``, ``torch.set_grad_enabled(m)`` or a
function decorated with one, which all go through ``torch._C._set_grad_enabled``) raises
:class:`GradModeSwitch`; the tracer then keeps the module that switched whole (an automatic
leaf), so it runs for real, under the mode it asks for, and a switch in the root forward fails
the trace naming it. Every switch counts, also one that changes nothing while tracing
(``enable_grad()`` where gradients are on: a forward-only step runs without them). Code that
runs for real while tracing (a leaf's example run, which the tracer does under ``no_grad``) is
not traced code: the guard reads the same per-thread flag as the random-number guard
(:func:`lightning_gsched.host_random.traced_code`, ``real_code``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from lightning_gsched.host_random import in_traced_code


class GradModeSwitch(RuntimeError):
    """Traced code switched the grad mode (``torch.no_grad()`` & co.)."""


@contextmanager
def grad_mode_switches_refused() -> Iterator[None]:
    """While the body runs, a grad-mode switch raises :class:`GradModeSwitch` in
    :func:`~lightning_gsched.host_random.traced_code` (the original switch comes back on
    exit)."""
    original = torch._C._set_grad_enabled

    def switch(mode: bool) -> None:
        if in_traced_code():
            state = "off" if not mode else "on"
            raise GradModeSwitch(
                f"the forward turns gradients {state} (torch.no_grad(), torch.enable_grad() or "
                "torch.set_grad_enabled(), or a function decorated with one) while traced: "
                "torch.fx does not record the grad mode, so the split would compute with "
                "gradients where the model has none. The module that does it runs whole "
                "instead; in the root forward, move the block into a submodule (or use "
                "tensor.detach(), which is recorded)")
        original(mode)

    torch._C._set_grad_enabled = switch  # type: ignore[assignment]  # same call, checked
    try:
        yield
    finally:
        torch._C._set_grad_enabled = original
