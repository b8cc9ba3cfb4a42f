"""A step's gradients, from the schedule to an optimizer loop; clipping by the global norm.

An optimizer loop expects ``loss.backward()`` semantics: gradients *added* to what ``param.grad``
holds, when the loop calls backward. The schedule computes them earlier (Lightning runs
``training_step``, then ``zero_grad``, then ``backward``), so :class:`GradStash` takes them out of
the parameters right after the schedule, restores what they held before, and adds them back,
scaled, in :meth:`GradStash.hand_over`. Which parameters get which gradients: :mod:`.ownership`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Collection, Iterable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_gsched.runtime.flat import FlatGrads, FlatLayout, FlatStage
from lightning_gsched.runtime.ownership import Ownership


class GradSource(Protocol):
    """What the stash reads of the executor: where each step's gradients accumulate."""

    flats: list[FlatStage]
    ties: dict[int, FlatStage]
    device: torch.device


class GradStash:
    """Holds one step's gradients from the schedule until :meth:`hand_over`."""

    def __init__(self, source: GradSource, ownership: Ownership, rank: int,
                 world_size: int, group: Callable[[], Any],
                 tensor_parallel: tuple[int, int] = (1, 0),
                 sharded: Collection[int] = ()) -> None:
        self.source = source
        self.group = group  # the workers' group, read at each use (Channels.workers_group)
        # (T, t) and the parameters held as shards: with T > 1 a norm counts each shard on its
        # rank and each replicated parameter once (on t = 0), over every rank
        self.tensor_parallel = tensor_parallel
        self.sharded = set(sharded)  # ids
        self.ownership = ownership
        self.rank, self.world_size = rank, world_size
        self.extra_layout = FlatLayout(ownership.extra)
        # (where each parameter's gradient is in the flat, the flat, its FlatGrads: None for extras)
        self.held: list[tuple[FlatLayout, torch.Tensor, FlatGrads | None]] = []
        self._saved: dict[int, torch.Tensor | None] = {}
        # per extra parameter (ownership.extra), whether any rank's step gave it a gradient
        self.extra_read: list[bool] = []
        # flats whose views the last hand_over gave the parameters, recycled once zero_grad dropped
        # every view
        self._given: list[tuple[torch.Tensor, FlatGrads]] = []

    def before_step(self, drop_previous: bool = False) -> None:
        """Set aside gradients an accumulation window holds; extras start from None.
        ``drop_previous``: the caller's loop zeroes the gradients before this step's are handed
        over (Lightning at the start of an accumulation window), so last step's are dropped and
        their buffers recycled now, instead of a second gradient buffer living through the step."""
        if drop_previous:
            for p in self.ownership.owned:
                p.grad = None
            self._recycle_given()
            self._saved = {}
        else:
            self._saved = {id(p): p.grad for p in self.ownership.owned}
        for p in self.ownership.extra:
            p.grad = None

    def after_step(self) -> None:
        """Take the step's gradients out of the parameters; restore what was set aside."""
        units = [*(self.source.flats[s] for s in self.ownership.stages),
                 *(self.source.ties[h] for h in self.ownership.ties)]
        self.held = [(unit.grads, unit.grads.take(), unit.grads) for unit in units]
        if self.ownership.extra:
            # one flat of their gradients (zeros where None), then one flag each: whether any
            # rank got a gradient for it. A parameter nothing read keeps grad None, as on one
            # device: with a zero gradient an optimizer would keep state for it and weight decay
            # would move it (found by probing: AdamW moved an unused parameter)
            extra = self.ownership.extra
            flat = torch.cat([*((p.grad if p.grad is not None else torch.zeros_like(p))
                                .reshape(-1) for p in extra),
                              torch.tensor([float(p.grad is not None) for p in extra],
                                           dtype=extra[0].dtype, device=extra[0].device)])
            if self.world_size > 1:
                dist.all_reduce(flat, group=self.group())
            flags = flat[-len(extra):].tolist()  # a host read, on steps of models with extras
            self.extra_read = [flag > 0 for flag in flags]
            self.held.append((self.extra_layout, flat[:-len(extra)], None))
        for p in self.ownership.owned:
            p.grad = self._saved.get(id(p))
        self._saved = {}

    def _recycle_given(self) -> None:
        """Return last step's flats whose views no parameter holds any more (zero_grad ran)."""
        for flat, source in self._given:
            start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
            if all(p.grad is None or not start <= p.grad.data_ptr() < end for p in source.params):
                source.recycle(flat)
        self._given = []

    def hand_over(self, scale: float) -> None:
        """``param.grad += scale * step gradient`` (assign when None), as ``backward`` would."""
        self._recycle_given()
        for layout, flat, source in self.held:
            assigned = False
            if scale != 1.0:
                flat.mul_(scale)
            views = source.grad_views(flat) if source is not None else (
                layout.view(flat, i) for i in range(len(layout.params)))
            read = self.extra_read if source is None else [True] * len(layout.params)
            for p, view, was_read in zip(layout.params, views, read, strict=True):
                if not was_read:  # no rank computed a gradient for it: it stays as it is
                    continue
                if p.grad is None:
                    p.grad = view
                    assigned = True
                else:
                    p.grad.add_(view)
            if source is not None:
                if assigned:  # parameters now hold views of it: recycle after they drop them
                    self._given.append((flat, source))
                else:  # added into existing gradients: free right away
                    source.recycle(flat)
        self.held = []

    def global_norm(self, params: Iterable[nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
        """Norm of all gradients of the model: each parameter counted once, on its primary rank,
        then one all-reduce gives every rank the whole model's norm."""
        params = list(params)
        wanted = {id(p) for p in params}
        # the norm's dtype is the gradients' (torch's clip_grad_norm_ gives a float64 model's
        # norm in float64), read off every parameter asked for: the same on every rank
        dtype = _norm_dtype(params)
        counted = self._counted_here()
        mine = [p.grad for p in self.ownership.primary if id(p) in wanted and id(p) in counted
                and p.grad is not None]
        device = self.source.device
        if math.isinf(norm_type):
            local = max((g.detach().abs().max().to(dtype) for g in mine),
                        default=torch.zeros((), dtype=dtype, device=device))
            local = torch.as_tensor(local, device=device).reshape(1).clone()
            self._all_reduce(local, dist.ReduceOp.MAX)
            return local[0]
        local = torch.zeros(1, dtype=torch.float64, device=device)
        for g in mine:
            local += g.detach().double().abs().pow(norm_type).sum()
        self._all_reduce(local, dist.ReduceOp.SUM)
        return local[0].pow(1.0 / norm_type).to(dtype)

    def _counted_here(self) -> set[int]:
        """Ids of the parameters whose gradients this rank counts in a norm: those it holds
        primarily, and with tensor parallelism (T > 1) each shard on its rank but each
        replicated parameter once (on t = 0)."""
        _, t = self.tensor_parallel
        return {id(p) for p in self.ownership.primary if t == 0 or id(p) in self.sharded}

    def _all_reduce(self, local: torch.Tensor, op: Any) -> None:
        """``local`` reduced over every rank that counts a share of the model's gradients: the
        workers' group, or with tensor parallelism every rank (a worker's shards live on its
        T ranks)."""
        T, _ = self.tensor_parallel
        if self.world_size * T > 1:
            dist.all_reduce(local, op=op, group=self.group() if T == 1 else None)

    def parameter_norms(self, params: Sequence[nn.Parameter], norm_type: float = 2.0
                        ) -> list[torch.Tensor | None]:
        """Each parameter's gradient norm over the whole (distributed) model, on every rank
        (collective): what ``p.grad.norm(norm_type)`` gives on one device, None where the
        parameter has no gradient there. Each parameter (each shard, under tensor
        parallelism) is counted on the rank that holds it primarily, and one all-reduce of
        ``[per-parameter sums of |g|^p (max |g| for p = inf) | has a gradient]`` gives every
        rank all of them (a sum composes for finite p, a max for inf, and either keeps the
        flag row's meaning)."""
        counted = self._counted_here()
        device = self.source.device
        infinite = math.isinf(norm_type)
        local = torch.zeros(2, len(params), dtype=torch.float64, device=device)
        for i, p in enumerate(params):
            g = p.grad
            if g is None or id(p) not in counted:
                continue
            g = g.detach().double().abs()
            local[0, i] = g.max() if infinite else g.pow(norm_type).sum()
            local[1, i] = 1.0
        self._all_reduce(local, dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM)
        values, present = local.tolist()  # one host read for every parameter
        out: list[torch.Tensor | None] = []
        for p, value, there in zip(params, values, present, strict=True):
            norm = value if infinite else value ** (1.0 / norm_type)
            out.append(torch.tensor(norm, dtype=p.dtype, device=device) if there else None)
        return out

    def clip_by_norm(self, params: list[nn.Parameter], max_norm: float, norm_type: float = 2.0,
                     error_if_nonfinite: bool = False) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole (distributed) model; the total norm."""
        total = self.global_norm(params, norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(  # the same on every rank: the norm was all-reduced
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
        return total


def _norm_dtype(params: Sequence[nn.Parameter]) -> torch.dtype:
    """The floating dtype the parameters' gradients promote to (float32 when none is)."""
    dtype = None
    for p in params:
        if p.is_floating_point():
            dtype = p.dtype if dtype is None else torch.promote_types(dtype, p.dtype)
    return dtype or torch.float32
