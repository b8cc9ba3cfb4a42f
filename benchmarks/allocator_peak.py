"""Peak bytes of one training step as the torch profiler sees the allocations, not the runtime.

Why: the ``memory[...]`` rows used to compare the planner's prediction with the runtime's own
accounting of its tensors (``runtime/footprint.py``), which counts the categories the planner
predicts by construction. Here the measurement comes from outside the runtime: the torch
profiler (``profile_memory=True``) records every CPU allocation and free during the step, and
its memory profile (the machinery behind ``export_memory_timeline``) adds the tensors that
existed before the step (weights, gradients, optimizer state) when the step touches them. The
peak of their sum over the step is what the allocator held for tensors; its categories
(parameter, optimizer state, gradient, activation, autograd detail, input, temporary) are the
profiler's own, not ours. Reads torch internals (``prof._memory_profile()``,
``MemoryProfileTimeline._coalesce_timeline``) of torch 2.13.

Second route, which never needs torch's data-flow analysis (that pass asserts "version
mismatch" on some steps): :func:`events_peak`. The profiler's raw allocation events
(``experimental_event_tree()`` nodes of type Allocation: signed ``alloc_size``, ``ptr``, start
time) give the running sum of bytes allocated during the step; its peak is added to a census
taken at the step's start, independently of the runtime: every distinct CPU tensor storage
reachable from a Python object (``gc.get_objects()``, and the ``.grad`` of each), deduplicated
by storage address. Limits: the profiler does not report the free of a block allocated before
profiling started (torch says so: "Memory block of unknown size was allocated before the
profiling started"), so a storage of the census freed during the step is still counted, and
storages held only by C++ (none at a step boundary here, as far as we know) are missed: an
upper bound, up to the storages freed during the step that existed at its start.
"""

from __future__ import annotations

import gc
from typing import Any

import lightning.pytorch as pl


def timeline_peak(prof: Any) -> dict[str, Any]:
    """``{"total": peak bytes, "at_peak": {category: bytes}}`` of a finished CPU profile, or
    ``{"error": text}`` where torch's analysis of the step fails (its data-flow pass asserts on
    some steps: "version mismatch")."""
    import torch
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

    try:
        timeline = MemoryProfileTimeline(prof._memory_profile())
    except AssertionError as exc:
        return {"error": f"torch's memory profile failed: {str(exc)[:80]}"}
    _, sizes = timeline._coalesce_timeline(torch.device("cpu"))
    totals = [sum(row) for row in sizes]
    at = max(range(len(totals)), key=totals.__getitem__)
    # column 0 is torch's own spare slot; a category's column is its index + 1
    names = {i + 1: "unknown" if c is None else c.name.lower()
             for c, i in _CATEGORY_TO_INDEX.items()}
    at_peak = {names.get(i, "other"): int(b) for i, b in enumerate(sizes[at]) if b}
    return {"total": int(totals[at]), "at_peak": at_peak}


def census_bytes() -> int:
    """Bytes of every distinct CPU tensor storage reachable from a Python object now (and of
    their ``.grad``), by storage address: what is alive before a step, counted without the
    runtime."""
    import torch

    seen: dict[int, int] = {}

    def add(t: Any) -> None:
        if t.device.type != "cpu" or t.is_sparse or t.is_quantized:
            return
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
        except (RuntimeError, NotImplementedError):
            # a tensor without storage (a wrapper), or one whose storage was invalidated
            # (FSDP2 frees an unsharded parameter's storage under a live Python tensor)
            return
        if ptr:
            seen[ptr] = storage.nbytes()

    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            add(obj)
            grad = obj.grad if obj.is_leaf else None
            if grad is not None:
                add(grad)
    return sum(seen.values())


def events_peak(prof: Any, baseline: int) -> dict[str, Any]:
    """``{"total": baseline + the peak of the running sum of the step's allocation events,
    "at_peak": {"census": baseline, "allocated in the step": that peak}}`` (module docstring:
    an upper bound)."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.Allocation:
            fields = node.typed[1]
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.alloc_size))
        stack.extend(node.children)
    running = high = 0
    for _, size in sorted(events):
        running += size
        high = max(high, running)
    return {"total": baseline + high,
            "at_peak": {"census": baseline, "allocated in the step": high}}


def fit_peak(events: dict[str, Any], before_fit: int) -> dict[str, Any]:
    """:func:`events_peak`'s figure less ``before_fit`` (a census taken, after a collection,
    before the fit built anything): the bytes the fit itself held at its peak.

    Why: in reused processes (``benchmarks/rounds.py``) earlier fits can leave storages alive
    that no Python collection frees (torch 2.13's ``replicate`` and ``fully_shard`` leave the
    whole model behind: 12.6 MiB of the benchmark GPT per fit, found by a census after
    ``gc.collect()``; their hooks hold it from C++), and the census would count them in every
    later fit's peak."""
    total = events["total"] - before_fit
    return {"total": total, "before_fit": before_fit,
            "at_peak": {**events["at_peak"], "census": events["at_peak"]["census"] - before_fit}}


def census_now() -> int:
    """:func:`census_bytes` after a full collection: what is alive now, garbage excluded."""
    gc.collect()
    return census_bytes()


class StepPeak:
    """The peak bytes of the code run inside ``with StepPeak() as peak:`` (a plain loop's step),
    measured as :class:`ProfilerPeak` measures a Lightning batch: a census just before, the
    profiler's allocation events during it. After the block: ``events`` (:func:`events_peak`)
    and, with ``timeline=True``, ``peak`` (:func:`timeline_peak`; torch's data-flow analysis,
    slow and failing on some steps, hence optional).

    Why a context manager beside the callback: a comparison of peaks (ours in a Trainer against
    torch in a plain loop) must measure both sides by the same code, and a plain loop has no
    batch hooks."""

    def __init__(self, timeline: bool = False) -> None:
        self.timeline = timeline
        self.peak: dict[str, Any] | None = None
        self.events: dict[str, Any] | None = None
        self._prof: Any = None
        self._baseline = 0

    def __enter__(self) -> "StepPeak":
        from torch.profiler import ProfilerActivity, profile

        self._baseline = census_now()
        # stacks and shapes only feed torch's own analysis (timeline_peak)
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                             record_shapes=self.timeline, with_stack=self.timeline)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self.peak = timeline_peak(self._prof) if self.timeline else None
            self.events = events_peak(self._prof, self._baseline)
        self._prof = None


class ProfilerPeak(pl.Callback):
    """Profile the allocations of one training batch (``batch``); keep :func:`timeline_peak`
    (``peak``, unless ``timeline=False``) and :func:`events_peak` (``events``), the census taken
    just before profiling (:class:`StepPeak` around the batch)."""

    def __init__(self, batch: int, timeline: bool = True) -> None:
        self.batch = batch
        self.timeline = timeline
        self.peak: dict[str, Any] | None = None
        self.events: dict[str, Any] | None = None
        self._step: StepPeak | None = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.batch:
            self._step = StepPeak(self.timeline).__enter__()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if batch_idx == self.batch and self._step is not None:
            self._step.__exit__(None, None, None)
            self.peak, self.events = self._step.peak, self._step.events
            self._step = None
