"""Point a parameter at new storage, the one way that also works to and from the meta device.

Why a module of its own: the flat buffers (:mod:`.flat`) and deferred initialisation
(:mod:`.materialize`) both re-home parameters, and a deferred model's parameters start on the
meta device, where ``param.data = tensor`` is refused ("incompatible tensor type").
"""

from __future__ import annotations

import torch
from torch import nn


def set_storage(param: nn.Parameter, data: torch.Tensor) -> None:
    """``param.data = data``, also from or to the meta device (where ``.data`` cannot be set):
    then the tensors are swapped in place, so every holder of ``param`` (modules, stages, the
    optimizer) sees the new storage."""
    if param.is_meta != data.is_meta:
        # torch.utils.swap_tensors has no annotations
        torch.utils.swap_tensors(  # type: ignore[no-untyped-call]
            param, nn.Parameter(data, requires_grad=param.requires_grad))
    else:
        param.data = data
