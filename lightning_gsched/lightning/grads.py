"""Gradients between the schedule and Lightning's optimizer loop.

Why: Lightning runs ``training_step`` -> ``zero_grad`` (first batch of an accumulation window)
-> ``backward`` -> clipping -> ``optimizer.step``. The schedule computes the gradients inside
``training_step``, so they would be wiped by ``zero_grad``; :class:`GradStash` takes them out of
the parameters right after the schedule ran and hands them back in ``backward``, scaled by
``1/accumulate_grad_batches`` and added to what an accumulation window already holds, exactly as
``loss.backward()`` would.

Three kinds of parameters:

* stage parameters: gradients live on their owners (replicas already all-reduced);
* tied parameters (several stages read them): replicated, summed over ranks by the runtime;
* extra parameters the forward never reads but the step does (a loss module, a head applied
  after ``self(...)``): they get gradients on the ranks that finish microbatches, so they are
  summed over all ranks here, like tied ones.

Clipping by norm counts every parameter once: stage parameters on their first owner, tied and
extra parameters on rank 0, then one all-reduce of the squared sum.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from lightning_gsched.runtime import ProgramExecutor
from lightning_gsched.runtime.flat import FlatGrads


def _flatten(params: list[nn.Parameter]) -> torch.Tensor:
    """The parameters' gradients in one flat tensor (zeros where a gradient is None)."""
    return torch.cat([
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params
    ])


class GradStash:
    """Holds one step's gradients from ``training_step`` until ``backward``."""

    def __init__(self, executor: ProgramExecutor, module: nn.Module) -> None:
        self.executor = executor
        self.world_size = executor.channels.world_size
        self.rank = executor.rank
        self.stage_params = {s: list(executor.flats[s].grads.params)
                             for s in sorted(executor.owned)}
        self.shared = list(executor.shared.params)
        known = {id(p) for f in executor.flats for p in f.params} | {id(p) for p in self.shared}
        self.extra = [p for p in module.parameters() if p.requires_grad and id(p) not in known]
        self.primary = self._primary_params()
        self._owned = ([p for ps in self.stage_params.values() for p in ps] + self.shared
                       + self.extra)
        # (parameters, their flat gradient, the FlatGrads it came from: None for extras)
        self.held: list[tuple[list[nn.Parameter], torch.Tensor, FlatGrads | None]] = []
        self._saved: dict[int, torch.Tensor | None] = {}
        # flats handed to the parameters by the last hand_over, with the FlatGrads they came
        # from: once Lightning's zero_grad has dropped every view of one, it is recycled
        self._given: list[tuple[list[nn.Parameter], torch.Tensor, FlatGrads]] = []

    def _primary_params(self) -> list[nn.Parameter]:
        owners = self.executor.programs.owners
        params = [p for s, ps in self.stage_params.items() if owners[s][0] == self.rank
                  for p in ps]
        if self.rank == 0:
            params += [p for p in self.shared if p.requires_grad] + self.extra
        return params

    def owned_parameters(self) -> list[nn.Parameter]:
        """Every parameter this rank updates (optimizer state is kept for these only)."""
        return self._owned

    # ------------------------------------------------------------------ around the schedule

    def before_step(self) -> None:
        """Set aside gradients an accumulation window holds; extras start from None."""
        self._saved = {id(p): p.grad for p in self.owned_parameters()}
        for p in self.extra:
            p.grad = None

    def after_step(self) -> None:
        """Take the step's gradients out of the parameters; restore what was set aside."""
        self.held = []
        for s, params in self.stage_params.items():
            source = self.executor.flats[s].grads
            self.held.append((params, source.take(), source))
        if self.shared:
            source = self.executor.shared
            self.held.append(([p for p in self.shared if p.requires_grad], source.take(), source))
        if self.extra:
            flat = _flatten(self.extra)
            if self.world_size > 1:
                dist.all_reduce(flat)
            self.held.append((self.extra, flat, None))
        for p in self.owned_parameters():
            p.grad = self._saved.get(id(p))
        self._saved = {}

    # ------------------------------------------------------------------ backward

    def _recycle_given(self) -> None:
        """Return last step's flats whose views no parameter holds any more (zero_grad ran)."""
        for params, flat, source in self._given:
            start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
            if all(p.grad is None or not start <= p.grad.data_ptr() < end for p in params):
                source.recycle(flat)
        self._given = []

    def hand_over(self, scale: float) -> None:
        """``param.grad += scale * step gradient`` (assign when None), as ``backward`` would."""
        self._recycle_given()
        for params, flat, source in self.held:
            assigned = False
            if scale != 1.0:
                flat.mul_(scale)
            offset = 0
            for p in params:
                size = p.numel()
                view = flat[offset: offset + size].view(p.shape)
                offset += size
                if p.grad is None:
                    p.grad = view
                    assigned = True
                else:
                    p.grad.add_(view)
            if source is not None:
                if assigned:  # parameters now hold views of it: recycle after they drop them
                    self._given.append((params, flat, source))
                else:  # added into existing gradients: free right away
                    source.recycle(flat)
        self.held = []

    # ------------------------------------------------------------------ clipping

    def global_norm(self, params: Iterable[nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
        """Norm of all gradients of the model, each parameter counted once over all ranks."""
        wanted = {id(p) for p in params}
        mine = [p.grad for p in self.primary if id(p) in wanted and p.grad is not None]
        device = self.executor.device
        if math.isinf(norm_type):
            local = max((g.detach().abs().max().float() for g in mine),
                        default=torch.zeros((), device=device))
            local = torch.as_tensor(local, device=device).reshape(1).clone()
            if self.world_size > 1:
                dist.all_reduce(local, op=dist.ReduceOp.MAX)
            return local[0]
        local = torch.zeros(1, dtype=torch.float64, device=device)
        for g in mine:
            local += g.detach().double().abs().pow(norm_type).sum()
        if self.world_size > 1:
            dist.all_reduce(local)
        return local[0].pow(1.0 / norm_type).float()

    def clip_by_norm(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole (distributed) model."""
        total = self.global_norm(params)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
        return total
