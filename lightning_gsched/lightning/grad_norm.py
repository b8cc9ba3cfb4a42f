"""``grad_norm``: Lightning's gradient-norm helper, with every parameter's gradient counted.

Why: users log gradient norms from ``on_before_optimizer_step`` with
``lightning.pytorch.utilities.grad_norm(self, norm_type=2)``. Under GeneralParallel a rank
holds the gradients of the stages it owns only (the others' ``.grad`` is None there), so
Lightning's helper gives each rank its own stages' norms and a rank-local total. This one takes
the same arguments and returns the same keys and values as one device: each parameter's norm is
computed where its gradient lives and one all-reduce gives every rank all of them (a
collective: call it on every rank, as the hook runs). Under any other strategy it is
Lightning's own.
"""

from __future__ import annotations

import functools
from typing import Any, Union

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import nn

from lightning_gsched.engine import PipelineEngine, engine_holding


def grad_norm(module: nn.Module, norm_type: Union[float, int, str],
              group_separator: str = "/") -> dict[str, Any]:
    """Each parameter's gradient norm (``grad_{p}_norm/{name}``) and their total
    (``grad_{p}_norm_total``), as Lightning's ``grad_norm`` computes them on one device (0-dim
    tensors; Lightning annotates them as floats)."""
    engine = _running_engine(module)
    if engine is None:
        return lightning_grad_norm(module, norm_type, group_separator)
    p = float(norm_type)
    if p <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). "
                         f"Got {p}")
    named = list(module.named_parameters())
    values = engine.parameter_grad_norms([param for _, param in named], p)
    norms: dict[str, Any] = {
        f"grad_{p}_norm{group_separator}{name}": value
        for (name, _), value in zip(named, values, strict=True) if value is not None}
    if norms:  # in the norms' promoted dtype, as Lightning's torch.tensor of them gives
        dtype = functools.reduce(torch.promote_types, (v.dtype for v in norms.values()))
        norms[f"grad_{p}_norm_total"] = torch.tensor(
            [float(v) for v in norms.values()], dtype=dtype).norm(p)
    return norms


def _running_engine(module: nn.Module) -> PipelineEngine | None:
    """The GeneralParallel engine ``module`` trains under, or None: a LightningModule's
    strategy's, else the running engine whose model holds the module (a submodule, e.g.
    ``grad_norm(self.model.blocks, 2)``)."""
    from lightning_gsched.lightning.strategy import GeneralParallel

    if not isinstance(module, LightningModule):
        return engine_holding(module)
    try:
        strategy = module.trainer.strategy
    except RuntimeError:  # not attached to a Trainer
        return None
    if not isinstance(strategy, GeneralParallel):
        return None
    return strategy.engine
