"""Reduce what the microbatch steps logged and the losses, once per step, over all ranks.

Why: each microbatch's step finishes on the rank that computes the last stage, so a value logged
there exists on one rank only. Lightning expects every rank to make the same ``self.log`` calls
(``sync_dist`` is a collective per call, and ``ModelCheckpoint(monitor=...)``/``EarlyStopping``
read the value on every rank). One exchange per step (:class:`LossLogExchange`: a single
all-reduce while the logged names stay the same) brings every microbatch's records and loss to
every rank; each name is then reduced over the global batch the way a single device
would have seen it, and logged with the user's options on every rank. The logged values arrive
here as tensors (engine/intercept.py) and become host numbers in the exchange's one read (with
the losses): no read per value and microbatch.

Reduction over microbatches: ``reduce_fx`` "mean" (the default) takes the row-weighted mean (the
value of a per-row average on the whole batch), "sum" the sum, "max"/"min" the extremes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from lightning_gsched.engine.control import ControlGroup
from lightning_gsched.engine.intercept import FLOAT64_OPTION, METRIC_OPTION, LogRecord
from lightning_gsched.errors import TrainingStepError

_FX_NAMES = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}
_FX_FUNCS: dict[Callable[..., Any], str] = {torch.mean: "mean", torch.sum: "sum", torch.max: "max",
                                  torch.min: "min"}


def exchange(payload: Any, world_size: int, group: Any = None) -> list[Any]:
    """Every rank's ``payload``, in rank order (one collective over ``group``)."""
    if world_size == 1:
        return [payload]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, payload, group=group)
    return gathered


class LossLogExchange:
    """Per training step: every microbatch's loss and every rank's log records, on every rank.

    Why not just :func:`exchange`: a pickled object all-gather costs two collectives plus
    pickling every step, a visible share of a small model's step. The records' *layout* (which
    names are logged on which microbatch, with which options) almost never changes between
    steps, so after one object exchange it is cached, and a step is a single float64 all-reduce
    of ``[losses | loss counts | record values | layout changed?]`` in which each rank fills its
    own slots, started asynchronously (:meth:`start`) and read after the step (:meth:`finish`).
    A rank whose layout differs from the cache raises the flag, and that step falls back to the
    object exchange (which also refreshes the cache), so no layout change is missed.
    """

    def __init__(self, world_size: int, rank: int, micro: int, device: torch.device,
                 control: ControlGroup | None = None, stamp_size: int = 0) -> None:
        self.world_size, self.rank, self.micro, self.device = world_size, rank, micro, device
        # numbers per rank that ride along (the batch stamps of data_loading="per_replica")
        self.stamp_size = stamp_size
        self.control = control  # collectives over control.group (None: the default group)
        self.layout: list[list[tuple[int, str, dict[str, Any]]]] | None = None
        self.object_exchanges = 0  # steps that fell back to the pickled all-gather

    @property
    def group(self) -> Any:
        """Read at each use: an aborted group must not be kept alive by this object."""
        return getattr(self.control, "group", None)

    def __call__(self, losses: dict[int, float],
                 records: list[LogRecord]) -> tuple[dict[int, float], list[LogRecord]]:
        """(loss per microbatch over all ranks, all ranks' records in rank order)."""
        return self.finish(self.start(losses, records))

    def start(self, losses: Mapping[int, Any], records: list[LogRecord],
              notice: int = 0, stamp: list[Any] | None = None,
              outputs: bool = False) -> PendingExchange:
        """Pack this rank's slots and start the all-reduce without waiting for it.

        Why split from :meth:`finish`: the engine starts the exchange the moment the step's
        compute is done, while the gradient all-reduce is still in flight (``on_computed`` of
        ``ProgramExecutor.step``), so the small collective's round trip and the ranks' skew are
        hidden behind that wait instead of following it. ``losses`` and the records' values
        may be 0-dim tensors: nothing here reads them on the host (:meth:`finish` does, once).
        ``notice``: this rank's pending preemption signal (0: none), one slot per rank, so that
        every rank learns of a signal any rank received at the same step (the front ends'
        preemption handling). ``stamp``: this rank's ``stamp_size`` numbers (floats or 0-dim
        tensors, exact in float64), every rank's back in ``PendingExchange.stamps``.
        ``outputs``: this rank holds step outputs for the hooks; whether any rank does comes
        back in ``PendingExchange.outputs_anywhere`` (a step whose ranks hold none gathers
        none, :mod:`.step_outputs`).
        """
        stamp = list(stamp or [])
        assert len(stamp) == self.stamp_size, "every rank stamps as many numbers"
        own = _as_float64([r.value for r in records], self.device)
        if self.world_size == 1:
            local = dict(losses)
            return PendingExchange(local, list(records), None, None, [notice],
                                   torch.cat([_as_float64(list(local.values()), self.device),
                                              own]), [[]], outputs)
        B = self.micro
        mine = [(r.micro, r.name, r.options) for r in records]
        sizes = [len(part) for part in self.layout] if self.layout is not None else [0] * self.world_size
        start = 2 * B + sum(sizes[: self.rank])
        W, K = self.world_size, self.stamp_size
        # [losses | loss counts | record values | notices | stamps | outputs? | layout changed?]
        packed = torch.zeros(2 * B + sum(sizes) + W * (1 + K) + 2, dtype=torch.float64,
                             device=self.device)
        packed[-2 - W * (1 + K) + self.rank] = float(notice)
        if K:
            first = packed.numel() - 2 - W * K + self.rank * K
            packed[first:first + K] = _as_float64(stamp, self.device)
        if losses:
            micros = sorted(losses)
            index = torch.tensor(micros).to(self.device, non_blocking=True)
            packed[index] = _as_float64([losses[b] for b in micros], self.device)
            packed[index + B] = 1.0
        changed = self.layout is None or mine != self.layout[self.rank]
        if outputs:
            packed[-2] = 1.0
        if changed:
            packed[-1] = 1.0
        else:
            packed[start : start + len(records)] = own
        work = dist.all_reduce(packed, async_op=True, group=self.group)
        return PendingExchange(dict(losses), list(records), packed, work, [], own, [])

    def finish(self, pending: PendingExchange) -> tuple[dict[int, float], list[LogRecord]]:
        """Wait for :meth:`start`'s all-reduce; (losses of all ranks, records of all ranks),
        every value a host number, read with one transfer."""
        if pending.work is None:  # a world of one: this rank's losses, then its records
            values = pending.own.tolist()  # the step's one host read
            losses = dict(zip(pending.losses, values, strict=False))
            return losses, _with_values(pending.records, values[len(losses):])
        pending.work.wait()
        assert pending.packed is not None  # set with the work
        size = pending.packed.numel()
        # the step's one host read: the all-reduced slots and this rank's own values
        values = torch.cat([pending.packed, pending.own]).tolist()
        values, own = values[:size], values[size:]
        W, K = self.world_size, self.stamp_size
        slots = values[-2 - W * (1 + K):-2]
        pending.outputs_anywhere = values[-2] > 0
        pending.notices = [int(v) for v in slots[:W]]
        pending.stamps = [slots[W + r * K:W + r * K + K] for r in range(W)]
        B = self.micro
        counts = values[B : 2 * B]
        all_losses = {b: values[b] for b in range(B) if counts[b] > 0}
        if any(c > 1 for c in counts):
            all_losses = {}  # a microbatch's loss came from two ranks: reported by the caller
        if values[-1] > 0:  # a rank's layout changed: the records go as objects, this once
            gathered = exchange(_with_values(pending.records, own), self.world_size, self.group)
            self.object_exchanges += 1
            self.layout = [[(r.micro, r.name, r.options) for r in logs] for logs in gathered]
            return all_losses, [r for logs in gathered for r in logs]
        out, position = [], 2 * B
        assert self.layout is not None
        for part in self.layout:
            for micro, name, options in part:
                out.append(LogRecord(micro, name, values[position], options))
                position += 1
        return all_losses, out


def _as_float64(values: list[Any], device: torch.device) -> torch.Tensor:
    """Numbers and 0-dim tensors as one float64 vector on ``device``, without a host read and
    without a blocking copy: the numbers cross to the device in one non-blocking copy (a
    ``torch.tensor(x, device="cuda")`` per number would wait for the device each time)."""
    if not values:
        return torch.zeros(0, dtype=torch.float64, device=device)
    numbers = torch.tensor([0.0 if isinstance(v, torch.Tensor) else float(v) for v in values],
                           dtype=torch.float64).to(device, non_blocking=True)
    if not any(isinstance(v, torch.Tensor) for v in values):
        return numbers
    return torch.stack([v.detach().reshape(()).to(device, torch.float64, non_blocking=True)
                        if isinstance(v, torch.Tensor) else numbers[i]
                        for i, v in enumerate(values)])


def _with_values(records: list[LogRecord], values: list[float]) -> list[LogRecord]:
    return [LogRecord(r.micro, r.name, v, r.options)
            for r, v in zip(records, values, strict=True)]


def on_host(records: list[LogRecord], device: torch.device) -> list[LogRecord]:
    """``records`` with host numbers as values, read with one transfer (an evaluation step's
    records, before they are gathered as objects)."""
    if not records:
        return []
    return _with_values(records, _as_float64([r.value for r in records], device).tolist())


@dataclass
class PendingExchange:
    """One step's exchange between :meth:`LossLogExchange.start` and ``finish``."""

    losses: dict[int, Any]
    records: list[LogRecord]
    packed: torch.Tensor | None  # the all-reduced slots (None: a world of one)
    work: Any  # the all-reduce's handle
    notices: list[int]  # every rank's pending preemption signal, once finished
    own: torch.Tensor  # this rank's record values (a world of one: its losses first)
    stamps: list[list[float]]  # every rank's stamp, once finished (a world of one: none)
    outputs_anywhere: bool = False  # some rank holds step outputs, once finished


def _fx_kind(name: str, fx: Any) -> str:
    if isinstance(fx, str) and fx.lower() in _FX_NAMES:
        return _FX_NAMES[fx.lower()]
    if fx in _FX_FUNCS:
        return _FX_FUNCS[fx]
    raise TrainingStepError(
        f"self.log({name!r}, reduce_fx={fx!r}): GeneralParallel combines microbatches with "
        "'mean', 'sum', 'max' or 'min' only"
    )


def reduce_records(records: list[LogRecord], weights: list[int]
                   ) -> list[tuple[str, float, dict[str, Any]]]:
    """(name, value, options) per logged name, in first-logged order (see module docstring)."""
    by_name: dict[str, list[LogRecord]] = {}
    for record in sorted(records, key=lambda r: r.micro):
        by_name.setdefault(record.name, []).append(record)
    out = []
    for name, group in by_name.items():
        options = group[0].options
        if "batch_size" in options and options["batch_size"] is None:
            # batch_size=None is Lightning's "infer it" (what self.log_dict always passes): as
            # if not given, the global batch's rows (it was summed: a TypeError on every rank)
            options = {k: v for k, v in options.items() if k != "batch_size"}
        if "batch_size" in options:  # the user's own, per microbatch: the step's is their sum
            options = {**options, "batch_size": sum(r.options.get("batch_size") or 0
                                                   for r in group)}
        values = [_number(r) for r in group]
        if METRIC_OPTION in options:  # a Metric's forwards: their row-weighted mean (NaN: none)
            pairs = [(v, weights[r.micro]) for v, r in zip(values, group, strict=True)
                     if not math.isnan(v) and weights[r.micro] > 0]
            total = sum(w for _, w in pairs)
            out.append((name, sum(v * w for v, w in pairs) / total if total else math.nan,
                        options))
            continue
        kind = _fx_kind(name, options.get("reduce_fx", "mean"))
        if kind == "mean":
            pairs = [(_number(r), weights[r.micro]) for r in group if weights[r.micro] > 0]
            total = sum(w for _, w in pairs)
            value = (sum(v * w for v, w in pairs) / total if total
                     else sum(values) / len(values))
        elif kind == "sum":
            value = sum(values)
        elif kind == "max":
            value = max(values)
        else:
            value = min(values)
        out.append((name, value, options))
    return out


def _number(record: LogRecord) -> float:
    """A record's value after the exchange (a host number: the exchange read it)."""
    if isinstance(record.value, torch.Tensor):
        raise TypeError(f"{record.name!r}: reduce the records the exchange returned")
    return float(record.value)


def replay(module: Any, reduced: list[tuple[str, float, dict[str, Any]]], device: torch.device,
           batch_size: int) -> None:
    """Log the reduced values through Lightning, identically on every rank. A torchmetrics
    Metric is logged as itself, each rank's copy (Lightning computes it over every rank's
    state at the epoch's end, and resets it), its step value being the step's reduced one.
    ``batch_size``: the global batch's rows, the weight of the step in Lightning's epoch mean
    (a ``batch_size`` the user gave is summed over the microbatches instead). A
    value logged as a float64 tensor is logged in float64 (others in the default dtype, as
    Lightning converts numbers)."""
    for name, value, options in reduced:
        options = dict(options)
        options.setdefault("batch_size", batch_size)
        if _fx_kind(name, options.get("reduce_fx", "mean")) == "sum":
            # the global batch's sum already, the same on every rank: synced, Lightning would
            # sum it over the ranks once more (a mean, max or min of equal values is unchanged)
            options["sync_dist"] = False
        path = options.pop(METRIC_OPTION, None)
        dtype = torch.float64 if options.pop(FLOAT64_OPTION, False) else None
        if path is not None:
            metric = module.get_submodule(path)
            metric._forward_cache = (None if math.isnan(value)
                                     else torch.tensor(value, device=device, dtype=dtype))
            mark_updated(metric)
            module.log(name, metric, **options)
            continue
        module.log(name, torch.tensor(value, device=device, dtype=dtype), **options)


def mark_updated(metric: Any) -> None:
    """Make this rank's copy of a Metric look updated, as the copy on the rank that computed
    the step's loss is (only that one ran ``update``).

    Why: torchmetrics' ``compute()`` syncs the state over every rank only when the copy has no
    cached value, and ``update`` is what drops the cache. A copy that was never updated here
    kept the value of an earlier ``compute()`` and returned it without the sync, while the
    updated copy waited in the sync: a Metric logged under two validation dataloaders (Lightning
    computes it at the end of each) stopped the job. The update count only silences the
    "compute before update" warning on ranks that hold no loss; it is raised from 0 alone,
    so a copy that does update keeps its own count.
    """
    metric._computed = None
    if metric._update_count == 0:
        metric._update_count = 1
