"""Undo the side effects that tracing and profiling have on the user's module.

Partitioning must leave the model exactly as it found it: tracing runs ``forward`` with proxies,
and forwards that cache things (``self.src_mask = ...`` in ``lightning.pytorch.demos``) would keep
a Proxy forever; the example run and the ``"time"`` profile run real forwards, which update
BatchNorm statistics and consume random numbers (dropout). These context managers restore all
of that.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from lightning_gsched.host_random import host_states, set_host_states


@contextlib.contextmanager
def preserved_attributes(module: nn.Module) -> Iterator[None]:
    """Restore every submodule's attributes, parameters, buffers and children on exit."""
    saved = [
        (m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules))
        for m in module.modules()
    ]
    try:
        yield
    finally:
        for m, attributes, parameters, buffers, children in saved:
            for key in [k for k in m.__dict__ if k not in attributes]:
                del m.__dict__[key]
            m.__dict__.update(attributes)
            # parameters, buffers, children: each {name: value or None}
            tables: list[tuple[dict[str, Any], dict[str, Any]]] = [
                (m._parameters, parameters),
                (m._buffers, buffers),
                (m._modules, children),
            ]
            for live, snapshot in tables:
                live.clear()
                live.update(snapshot)


@contextlib.contextmanager
def preserved_tensors_and_rng(module: nn.Module) -> Iterator[None]:
    """Restore buffer values (BatchNorm statistics...) and the RNG streams on exit."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    cpu_rng = torch.get_rng_state()
    host = host_states()  # Python's and numpy's (a leaf's example run may draw)
    # torch.cuda.is_initialized has no annotations
    cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    cuda_rng = torch.cuda.get_rng_state_all() if cuda else None
    try:
        yield
    finally:
        with torch.no_grad():
            for live, snapshot in buffers:
                live.copy_(snapshot)
        torch.set_rng_state(cpu_rng)
        set_host_states(host)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
