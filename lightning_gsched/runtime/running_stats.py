"""Running statistics (BatchNorm, InstanceNorm): after a step, one device's values on every rank.

Why: every rank holds every stage's modules but runs a stage's forward only on the microbatches
its program gives it, so each copy of a BatchNorm would track different microbatches. Kept here,
the strongest semantics exact for every placement: after each training step every rank holds the
running statistics ONE device would hold after running each stage's forward on microbatches
``0 .. B-1`` in order from the step's starting buffers (outputs still normalise with each
microbatch's own batch statistics, as DDP without SyncBatchNorm).

How (checked against torch's ``_BatchNorm``, ``_InstanceNorm`` and ATen's CPU kernel): an update
is ``running = f * batch_stat + (1 - f) * running`` for the mean and the *unbiased* variance,
``f`` being ``momentum``, or with ``momentum=None`` ``1 / num_batches_tracked`` for a BatchNorm
(after its per-call increment) and 0 for an InstanceNorm. So each ``F s b`` runs the stage's such
modules with ``momentum = 1.0``: right after each call the buffers hold its batch statistics,
which a forward hook copies into the step's table at (microbatch b, stage s). At the step's end
one SUM all-reduce (each slot written by the one rank that ran ``F s b``) gives every rank the
whole table, which it folds into its starting buffers microbatch by microbatch, stage by stage,
with each module's real factor, adding the calls to ``num_batches_tracked``.

Exact but for the batch variance, which the kernel keeps in double until mixed in, rounded once
to float32 here (about 1e-7 relative). Cost: nothing without modules keeping running statistics
in training mode, else one all-reduce of ``B * (2 * channels + 1 per module)`` numbers per step
and an O(B) fold. Refused: a module called twice in one stage forward (one slot per call site; a
rank that did not run the stage cannot know how many calls another made), ``nn.SyncBatchNorm``.
Other buffers a forward mutates are not synchronised.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass
from functools import reduce
from typing import Any, Callable, Iterator, Sequence, TypeGuard

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.nn.modules.instancenorm import _InstanceNorm

from lightning_gsched.errors import RuntimeConfigError

AllReduce = Callable[[torch.Tensor], Any]  # starts a SUM all-reduce over every rank, returns work
Wait = Callable[[Any, str], None]


def has_running_stats(module: nn.Module) -> TypeGuard[_NormBase]:
    """A norm layer that updates running statistics when it runs in training mode."""
    return (isinstance(module, (_BatchNorm, _InstanceNorm)) and module.track_running_stats
            and module.running_mean is not None and module.running_var is not None)


def _statistics(module: _NormBase) -> tuple[torch.Tensor, torch.Tensor]:
    """``(running_mean, running_var)`` of a module that :func:`has_running_stats`."""
    mean, var = module.running_mean, module.running_var
    assert mean is not None and var is not None
    return mean, var


def _factor(module: _NormBase, calls_so_far: int) -> float:
    """The update factor of this module's next call (torch's rule); ``calls_so_far`` is
    ``num_batches_tracked`` after this call's increment."""
    if module.momentum is not None:
        return float(module.momentum)
    if isinstance(module, _BatchNorm) and module.num_batches_tracked is not None:
        return 1.0 / float(calls_so_far)
    return 0.0


def _counter(module: nn.Module) -> torch.Tensor | None:
    """A BatchNorm's ``num_batches_tracked`` (InstanceNorm's is never updated)."""
    return module.num_batches_tracked if isinstance(module, _BatchNorm) else None


@dataclass(frozen=True)
class _Site:
    """One module as called by one stage: where its batch statistics go in a table row."""

    stage: int
    module: int  # index into StatsLayout.modules
    offset: int  # first element of [mean | var] in a row, after the call counts
    size: int  # channels
    round: int  # how many earlier stages call the same module (fold order within a microbatch)


class StatsLayout:
    """Where every training module's statistics sit: a table row (one per microbatch) is ``[calls
    of each site | mean, var of each site]``, the running vector ``R`` is ``[running_mean,
    running_var]`` of each distinct module. Sites of the same round touch distinct modules, so one
    microbatch's fold is one vector update per round (one unless several stages call a module)."""

    def __init__(self, per_stage: Sequence[Sequence[_NormBase]]) -> None:
        self.modules = list({id(m): m for ms in per_stage for m in ms}.values())
        index = {id(m): j for j, m in enumerate(self.modules)}
        sizes = [_statistics(m)[0].numel() for m in self.modules]
        self.starts = [2 * n for n in itertools.accumulate(sizes, initial=0)][:-1]  # in R
        self.sites: list[_Site] = []
        offset = 0
        for s, modules in enumerate(per_stage):
            for j in (index[id(m)] for m in modules):
                earlier = sum(site.module == j for site in self.sites)
                self.sites.append(_Site(s, j, offset, sizes[j], earlier))
                offset += 2 * sizes[j]
        self.by_stage: dict[int, list[tuple[int, _Site]]] = {}
        for k, site in enumerate(self.sites):
            self.by_stage.setdefault(site.stage, []).append((k, site))
        self.width = len(self.sites) + offset  # one table row
        self.dtype = reduce(torch.promote_types, [_statistics(m)[0].dtype for m in self.modules])
        self.device = _statistics(self.modules[0])[0].device
        self.rounds = self._rounds()

    def _rounds(self) -> list[tuple[torch.Tensor, ...]]:
        """Per round: (its sites, positions in R, positions in a row, site of each element)."""
        rounds = []
        for r in range(max(site.round for site in self.sites) + 1):
            sites = [k for k, site in enumerate(self.sites) if site.round == r]
            in_r, in_row, owner = [], [], []
            for column, k in enumerate(sites):
                site = self.sites[k]
                span = torch.arange(2 * site.size)
                in_r.append(span + self.starts[site.module])
                in_row.append(span + len(self.sites) + site.offset)
                owner.append(torch.full_like(span, column))
            rounds.append((torch.tensor(sites, device=self.device),
                           *(torch.cat(t).to(self.device) for t in (in_r, in_row, owner))))
        return rounds

    def running(self) -> torch.Tensor:
        """R: the modules' current ``[running_mean, running_var]``."""
        return torch.cat([t.detach().reshape(-1).to(self.dtype) for m in self.modules
                          for t in _statistics(m)])

    def calls(self) -> torch.Tensor:
        """Each module's ``num_batches_tracked`` (0 where it has none), as one int64 tensor."""
        zero = torch.zeros((), dtype=torch.long, device=self.device)
        return torch.stack([zero if c is None else c.detach().reshape(()).to(zero)
                            for c in map(_counter, self.modules)])

    def write(self, values: torch.Tensor, calls: Sequence[int]) -> None:
        """Copy R into the modules' buffers in place, ``calls`` into ``num_batches_tracked``."""
        with torch.no_grad():
            for j, (m, start) in enumerate(zip(self.modules, self.starts, strict=True)):
                mean, var = _statistics(m)
                size = mean.numel()
                mean.copy_(values[start:start + size].view_as(mean))
                var.copy_(values[start + size:start + 2 * size].view_as(var))
                counter = _counter(m)
                if counter is not None:
                    counter.fill_(calls[j])


class StatsStep:
    """One training step's table: filled by the forwards, exchanged and folded at the end."""

    def __init__(self, layout: StatsLayout, num_micro: int) -> None:
        self.layout = layout
        self.table = torch.zeros(num_micro, layout.width, dtype=layout.dtype, device=layout.device)
        self.start = layout.running()
        self.start_calls = layout.calls()  # a tensor: read (one device sync) when folding
        self.calls: set[tuple[int, int]] = set()  # (site, microbatch) already recorded
        self.folded = False

    @contextmanager
    def capture(self, s: int, b: int) -> Iterator[None]:
        """Run ``F s b`` inside: its modules' batch statistics land in row b; momentum and hooks
        are put back even when the forward fails."""
        sites = self.layout.by_stage.get(s, [])
        modules = [self.layout.modules[site.module] for _, site in sites]
        momenta = [m.momentum for m in modules]
        handles = []
        try:
            for (k, site), m in zip(sites, modules, strict=True):
                m.momentum = 1.0
                handles.append(m.register_forward_hook(self._recorder(k, site, b)))
            yield
        finally:
            for handle in handles:
                handle.remove()
            for m, momentum in zip(modules, momenta, strict=True):
                m.momentum = momentum

    def _recorder(self, k: int, site: _Site, b: int) -> Callable[..., None]:
        def record(module: _NormBase, args: Any, output: Any) -> None:
            if (k, b) in self.calls:
                raise RuntimeConfigError(
                    f"{type(module).__name__} in stage {site.stage} ran twice in one forward; "
                    "the runtime keeps running statistics exact for modules called at most once "
                    "per stage forward. Use one norm module per call site.")
            self.calls.add((k, b))
            row = self.table[b]
            start = len(self.layout.sites) + site.offset
            mean, var = _statistics(module)
            with torch.no_grad():
                row[k] = 1
                row[start:start + site.size].copy_(mean.reshape(-1))
                row[start + site.size:start + 2 * site.size].copy_(var.reshape(-1))

        return record

    def finish(self, all_reduce: AllReduce | None, wait: Wait) -> None:
        """Exchange the table (``all_reduce`` None: a single rank) and fold it on this rank."""
        if all_reduce is not None:
            wait(all_reduce(self.table), "the all-reduce of running statistics over all ranks")
        layout = self.layout
        calls = self.table[:, : len(layout.sites)].tolist()  # one device sync
        tracked = self.start_calls.tolist()
        factors = [[0.0] * len(layout.sites) for _ in calls]  # 0: not called, no update
        for b, called in enumerate(calls):
            for k, site in enumerate(layout.sites):  # stage order within a microbatch
                if called[k]:
                    tracked[site.module] += 1
                    factors[b][k] = _factor(layout.modules[site.module], tracked[site.module])
        f_table = torch.tensor(factors, dtype=layout.dtype).to(layout.device)
        running = self.start.clone()
        for b in range(len(calls)):
            for sites, in_r, in_row, owner in layout.rounds:
                f = f_table[b, sites][owner]
                running[in_r] = f * self.table[b, in_row] + (1 - f) * running[in_r]
        layout.write(running, tracked)
        self.folded = True

    def abandon(self) -> None:
        """A failed step: put back the buffers of the step's start (the captures changed them)."""
        if not self.folded:
            self.layout.write(self.start, self.start_calls.tolist())


class RunningStats:
    """The modules with running statistics in each stage, found once per executor; while none
    is in training mode, :meth:`begin_step` gives None and a step costs nothing extra."""

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        # SyncBatchNorm is refused, not converted: that would change what the forward computes
        for s, stage in enumerate(stages):
            for name, module in stage.named_modules():
                if isinstance(module, nn.SyncBatchNorm):
                    raise RuntimeConfigError(
                        f"stage {s} contains nn.SyncBatchNorm ({name or type(module).__name__}), "
                        "whose training forward is a collective that every rank must run at "
                        "once; a schedule runs each stage's forwards on different ranks at "
                        "different times. Use nn.BatchNorm1d/2d/3d instead (do not convert the "
                        "model with nn.SyncBatchNorm.convert_sync_batchnorm): every rank then ends "
                        "each step with the running statistics one device would have "
                        "(docs/runtime.md, 'BatchNorm and other running statistics').")
        self.per_stage = [[m for m in stage.modules() if has_running_stats(m)] for stage in stages]
        self.modules = list({id(m): m for ms in self.per_stage for m in ms}.values())
        self._layouts: dict[tuple[bool, ...], StatsLayout] = {}

    def begin_step(self, num_micro: int) -> StatsStep | None:
        key = tuple(m.training for m in self.modules)
        if not any(key):
            return None
        if key not in self._layouts:
            self._layouts[key] = StatsLayout([[m for m in ms if m.training]
                                              for ms in self.per_stage])
        return StatsStep(self._layouts[key], num_micro)

    @contextmanager
    def unchanged(self) -> Iterator[None]:
        """Buffers as they were before (a forward-only run of modules left in training mode)."""
        saved = [(t, t.detach().clone()) for m in self.modules if m.training
                 for t in m.buffers(recurse=False)]
        try:
            yield
        finally:
            with torch.no_grad():
                for tensor, value in saved:
                    tensor.copy_(value)

    def broadcast(self, broadcast: Callable[[torch.Tensor], None]) -> None:
        """Rank 0's running statistics on every rank (``broadcast(tensor)`` from rank 0, in
        place; collective): two messages, statistics and ``num_batches_tracked``."""
        if not self.modules:
            return
        layout = StatsLayout(self.per_stage)
        values, calls = layout.running(), layout.calls()
        broadcast(values)
        broadcast(calls)
        layout.write(values, calls.tolist())
