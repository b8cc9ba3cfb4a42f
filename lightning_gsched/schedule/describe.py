"""Text summaries of a plan: :func:`describe` (a row per worker, what ``gsched plan`` prints),
:func:`startup_summary` (each per-worker number as its range over the workers, what
GeneralParallel prints when it starts) and its memory lines, predicted and measured. Here, not in
the CLI, because the strategy logs the plan it runs too, and nothing may import
``lightning_gsched.cli`` (``tests/test_layering.py``).
"""

from __future__ import annotations

from itertools import groupby
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from lightning_gsched.schedule.data_parallel import lift_caps
from lightning_gsched.schedule.fold import fold_rows, owners_text, sequence_text
from lightning_gsched.schedule.lazy_ranks import LazyList
from lightning_gsched.schedule.library import LIBRARY
from lightning_gsched.schedule.memory import CATEGORIES, RankMemory, ResidentBytes, resident_bytes
from lightning_gsched.schedule.metrics import WorkerMetrics
from lightning_gsched.schedule.orders import normalise_caps
from lightning_gsched.schedule.plan import Plan

FOLD_FROM = 17  # workers: from here on, equal rows are one row
MAX_ROWS = 48  # workers whose rows are all computed at most; beyond, a sample:
SHOWN_FIRST, SHOWN_LAST = 4, 2  # the first and the last workers (a pipeline's ends differ)
OWNERS_WIDTH = 160  # the owners line's plain form up to this width, else its compact form
SUMMARY_WIDTH = 112  # no line of the startup summary is longer (the partition table's width)
# what lists every worker where a bounded reader (table, --json) lists a sample
EVERY_WORKER_HINT = "--programs lists every worker (and with --json every slot and program)"


def text_table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """Columns padded to their widest cell; the first left-aligned, the rest right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*header), fmt.format(*["-" * w for w in widths]),
                      *(fmt.format(*map(str, r)) for r in rows)])


def cap_text(caps: Sequence[int | None]) -> str:
    """Per-worker activation caps as ``--cap`` takes them: ``none``, one value, or a list."""
    return "none" if all(c is None for c in caps) else _numbers(caps, str)


def checkpoint_text(checkpointed: Sequence[bool]) -> str:
    """As ``--checkpoint-stages`` takes them: ``""``, ``"all"`` or ``"0-2,5"``."""
    stages = [s for s, on in enumerate(checkpointed) if on]
    if stages and len(stages) == len(checkpointed):
        return "all"
    # consecutive stages share their offset from their index in ``stages``
    runs = [[s for _, s in run] for _, run in groupby(enumerate(stages), lambda p: p[1] - p[0])]
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def ties_text(ties: Mapping[int, Sequence[int]]) -> str:
    """As ``--tie`` takes them: ``0,3;1,2`` (each tie's reader stages)."""
    return ";".join(",".join(str(s) for s in readers) for readers in ties.values())


def workers_text(result: Plan) -> str:
    """``W=8``, or with data-parallel replicas ``W=8 (P=4 x G=2, replicate)``, or with
    tensor-parallel workers ``W=8 (P=2 x G=2 x T=2, replicate; worker w = ranks 2w..2w+1)``
    (``W=4 (P=2 x T=2; worker w = ranks 2w..2w+1)`` without replicas)."""
    return layout_text(result.ranks, result.data_parallel_size, result.data_parallel,
                       result.tensor_parallel_size)


def layout_text(ranks: int, data_parallel_size: int = 1, data_parallel: str = "replicate",
                tensor_parallel_size: int = 1) -> str:
    """W ranks as P x G x T, the factors above 1 only (``W=8`` for one pipeline).

    Why the rank map with T > 1: every per-worker figure (rows, timeline, owners) counts the
    W / T workers, while ``-w`` and ``W`` count ranks; the map says which ranks a row is."""
    G, T = data_parallel_size, tensor_parallel_size
    if G == 1 and T == 1:
        return f"W={ranks}"
    factors = [f"P={ranks // (G * T)}", *([f"G={G}"] if G > 1 else []),
               *([f"T={T}"] if T > 1 else [])]
    return (f"W={ranks} ({' x '.join(factors)}" + (f", {data_parallel}" if G > 1 else "")
            + (f"; worker w = ranks {T}w..{T}w+{T - 1}" if T > 1 else "") + ")")


def micro_text(result: Plan) -> str:
    """``B=8``, or with replicas ``B=16 (8 per replica)`` (``-b`` is one replica's)."""
    G = result.data_parallel_size
    return f"B={result.micro}" + (f" ({result.micro // G} per replica)" if G > 1 else "")


def configuration_text(result: Plan) -> str:
    """The plan's shape, ``W=2 S=4 B=2 order=bfs cap=none`` and what else is set; a long cap list
    as arithmetic runs (``1024..1``), lifted to G replicas one replica's and ``per replica``."""
    caps, suffix = list(result.caps), ""
    layout = result.replicas
    if layout.replicas > 1 and len(set(caps)) > 1:
        per_position = [caps[r] for r in layout.members(0)]
        if lift_caps(per_position, layout) == caps:
            caps, suffix = per_position, " per replica"
    cap = cap_text(caps)
    cap = (cap if len(caps) <= 16 or "," not in cap else sequence_text(caps)) + suffix
    checkpointed = checkpoint_text(result.checkpointed)
    split = _split_override(result)
    return (f"{workers_text(result)} S={result.stages} {micro_text(result)}"
            + (f" R={result.R}" if result.R is not None else "")
            + f" order={result.order} cap={cap}"
            + (f" fetch-window={result.fetch_window}" if result.fetch_window is not None else "")
            + (f" ties={ties_text(result.ties)}" if result.ties else "")
            + (f" checkpointed={checkpointed}" if checkpointed else "")
            + (f" split-backward={'on' if split else 'off'}" if split is not None else ""))


def _split_override(result: Plan) -> bool | None:
    """Whether the plan splits its backward where that is not its library schedule's default
    (``split_backward=`` given), else None (the default, or a custom schedule)."""
    spec = LIBRARY.get(result.schedule)
    split = bool(result.costs.weight)
    if spec is None or result.forward_only or split == spec.split_backward:
        return None
    return split


def describe(result: Plan, stage_bytes: Sequence[int] | None = None,
             tie_bytes: Mapping[int, int] | None = None, bytes_note: str | None = None) -> str:
    """Configuration, latency, bubble, and one row per worker; with ``stage_bytes`` (and
    ``tie_bytes``: ``{home: bytes}``) the parameter bytes a worker owns and its peak of owned +
    fetched ones. ``bytes_note``: a line under the head saying what those bytes are, where the
    caller changed them (a tensor-parallel rank's share). Beyond :data:`MAX_ROWS` workers only
    :func:`listed_workers`' rows are computed: a row reads (at large W: lowers) its worker's
    program, the head lines only the timeline."""
    m = result.metrics
    head = (
        f"schedule {result.schedule}: {configuration_text(result)}"
        + (" forward-only" if result.forward_only else "") + "\n"
        f"latency {m.latency:g}   bubble {m.bubble_fraction:.1%}   "
        f"stage owners {_owners_text(result.table.owners, OWNERS_WIDTH)}")
    if stage_bytes is not None and bytes_note is not None:
        head += "\n" + bytes_note
    header = ["worker", "busy", "act in/out", "grad in/out", "w fetch/serve", "g reduce out/in",
              "allreduce", "peak act", "owned", "peak resident"]
    if result.ties:
        header += ["tie fetch/serve", "tie reduce out/in", "tie allreduce"]
    if stage_bytes is not None:
        header += ["owned bytes", "peak bytes"]
    if stage_bytes is not None and result.data_parallel == "shard":
        head += "\n" + shard_saving(result, stage_bytes)
    shown = listed_workers(result.workers)
    rows = worker_rows(result, range(result.workers) if shown is None else shown, stage_bytes,
                       tie_bytes)
    if shown is None:
        return head + "\n" + text_table(rows if len(rows) < FOLD_FROM else fold_rows(rows), header)
    # the first and last workers' rows (each part's equal rows folded), a line for the rest
    hidden = hidden_workers(result.workers)
    gap: list[object] = [f"... {hidden}", *["..."] * (len(header) - 1)]
    table = text_table([*fold_rows(rows[:SHOWN_FIRST]), gap, *fold_rows(rows[SHOWN_FIRST:])],
                       header)
    return f"{head}\n{table}\n... workers {hidden} not shown; {EVERY_WORKER_HINT}"


def shard_saving(result: Plan, stage_bytes: Sequence[int]) -> str:
    """What sharding saves at rest: each rank's owned parameter bytes against the same plan
    replicated, where a rank owns every stage it computes (no second plan)."""
    ranks = listed_workers(result.workers) or range(result.workers)
    owned = [sum(stage_bytes[s] for s in result.table.owned_stages(r)) for r in ranks]
    replicated = [sum(stage_bytes[s] for s in result.table.computed_stages(r)) for r in ranks]
    saved = 1 - max(owned) / max(replicated) if max(replicated) else 0.0
    return (f"sharded over {result.data_parallel_size} replicas: each rank owns "
            f"{span(owned, byte_text)} of parameters at rest (gradients and optimizer state "
            f"alike), replicated it would own {span(replicated, byte_text)}: "
            f"{saved:.0%} less on the largest rank")


def listed_workers(workers: int) -> list[int] | None:
    """The workers whose rows the table and ``--json`` show: None (all) up to :data:`MAX_ROWS`,
    else the first and last few."""
    if workers <= max(MAX_ROWS, SHOWN_FIRST + SHOWN_LAST):
        return None
    return [*range(SHOWN_FIRST), *range(workers - SHOWN_LAST, workers)]


def hidden_workers(workers: int) -> str:
    """``4-1021``: the workers :func:`listed_workers` leaves out."""
    return f"{SHOWN_FIRST}-{workers - SHOWN_LAST - 1}"


def worker_rows(result: Plan, workers: Sequence[int], stage_bytes: Sequence[int] | None = None,
                tie_bytes: Mapping[int, int] | None = None) -> list[list[object]]:
    """:func:`describe`'s rows of ``workers``, cells as printed: each program read alone, or all
    at once (``make_all``) when every worker's row is asked."""
    per_worker = result.metrics.per_worker
    if len(workers) == len(per_worker) and isinstance(per_worker, LazyList):
        per_worker.make_all()
    rows: list[list[object]] = [
        [w.worker, f"{w.busy:g}", f"{w.activation_recvs}/{w.activation_sends}",
         f"{w.input_grad_recvs}/{w.input_grad_sends}", f"{w.weight_fetches}/{w.weight_serves}",
         f"{w.grad_sends}/{w.grad_recvs}", w.allreduces, w.peak_activations, w.owned_stages,
         w.peak_resident_stages,
         *([f"{w.tie_fetches}/{w.tie_serves}", f"{w.tie_grad_sends}/{w.tie_grad_recvs}",
            w.tie_allreduces] if result.ties else [])]
        for w in map(per_worker.__getitem__, workers)]
    if stage_bytes is not None:
        held = resident_bytes(result.programs, stage_bytes, tie_bytes, ranks=list(workers))
        for row, h in zip(rows, held, strict=True):
            row += [h.owned, h.peak]
    return rows


def byte_text(nbytes: float) -> str:
    """``512 B``, ``49.2 KiB``, ``3.1 MiB``, ``1.25 GiB``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"


def span(values: Sequence[float], text: Callable[[float], str] = "{:g}".format) -> str:
    """``"3"`` when every value is 3, else ``"min-max"``, each written by ``text``."""
    low, high = min(values), max(values)
    return text(low) if low == high else f"{text(low)}-{text(high)}"


def _numbers(values: Sequence[Any], text: Callable[[Any], str] = "{:g}".format) -> str:
    """One value when all are equal, else the comma list (the CLI's form of costs and caps)."""
    return text(values[0]) if len(set(values)) == 1 else ",".join(map(text, values))


def plan_command(result: Plan) -> str:
    """The ``gsched plan`` command that prints this (library) plan in full: W, S and B, the rest
    where it differs from the schedule's defaults. ``-w`` counts ranks, as ``--tp`` takes it."""
    spec = LIBRARY[result.schedule]
    G, T = result.data_parallel_size, result.tensor_parallel_size
    words = [f"gsched plan {result.schedule} -w {result.ranks} -s {result.stages} "
             f"-b {result.micro // G}"]  # -b: one replica's microbatches
    words += [word for given, word in (
        (G > 1, f"--dp {G}"), (result.data_parallel == "shard", "--data-parallel shard"),
        (T > 1, f"--tp {T}"),
        (result.R is not None, f"--R {result.R}"),
        (result.order != spec.order, f"--order {result.order}"),
        (result.fetch_window is not None, f"--fetch-window {result.fetch_window}")) if given]
    words += [f"--tie {','.join(str(s) for s in readers)}" for readers in result.ties.values()]
    layout = result.replicas
    default = spec.cap(layout.pipeline, result.stages)  # "auto" (a search): caps written out
    if isinstance(default, str) or result.caps != lift_caps(normalise_caps(
            default, layout.pipeline), layout):
        # --cap is per pipeline position (each replica's P workers): the caps of replica 0
        words.append(f"--cap {cap_text([result.caps[r] for r in layout.members(0)])}")
    split = _split_override(result)
    if split is not None:
        words.append("--split-backward" if split else "--no-split-backward")
    fwd, bwd, wgt = result.costs.forward, result.costs.backward, result.costs.weight
    checkpointed = checkpoint_text(result.checkpointed)
    if checkpointed == "all":
        words.append("--checkpoint-activations")
    elif checkpointed:
        words.append(f"--checkpoint-stages {checkpointed}")
    # the plan's backward costs include the recompute of checkpointed stages; the CLI adds it
    # (rounded: b + f - f may differ from b in its last bit)
    bwd = tuple(round(b - f, 12) if on else b
                for b, f, on in zip(bwd, fwd, result.checkpointed, strict=True))
    if any(c != 1.0 for c in fwd):
        words.append(f"--forward-cost {_numbers(fwd)}")
    if not wgt:
        if any(c != 2.0 for c in bwd):
            words.append(f"--backward-cost {_numbers(bwd)}")
    elif any(c != 1.0 for c in (*bwd, *wgt)):  # split: B and W each 1.0 is the halved default
        words.append(f"--backward-cost {_numbers(bwd)} --weight-cost {_numbers(wgt)}")
    return " ".join(words)


def _owners_text(owners: Sequence[Sequence[int]], width: int) -> str:
    """``[[0], [1], ...]`` when it fits ``width``, else :func:`~.fold.owners_text`."""
    if len(owners) <= width:
        text = str([list(o) for o in owners])
        if len(text) <= width:
            return text
    return owners_text(owners, width)


def _byte_span(values: Sequence[float]) -> str:
    """The range of byte counts, the unit written once when both ends share it."""
    low, high = byte_text(min(values)), byte_text(max(values))
    if low == high:
        return low
    low_number, low_unit = low.split()
    return f"{low_number}-{high}" if high.endswith(f" {low_unit}") else f"{low} to {high}"


class StartupRow(NamedTuple):
    """One worker's numbers in :func:`startup_summary`."""

    counts: WorkerMetrics
    resident: ResidentBytes


def startup_row(result: Plan, stage_bytes: Sequence[int], tie_bytes: Mapping[int, int],
                rank: int) -> StartupRow:
    """``rank``'s row, read off its own program only: each rank computes its own and the rows
    are gathered, so that no rank lowers the programs of all W ranks."""
    return StartupRow(result.metrics.per_worker[rank],
                      resident_bytes(result.programs, stage_bytes, tie_bytes, ranks=[rank])[0])


def startup_summary(result: Plan, stage_bytes: Sequence[int], tie_bytes: Mapping[int, int],
                    command: str | None, rows: Sequence[StartupRow] | None = None) -> str:
    """The plan as GeneralParallel prints it before the first step, in a fixed number of lines
    for any W. ``command``: how to print the full table (:func:`plan_command`; None for a
    custom placement); ``rows``: every worker's, gathered by the caller (None: read here)."""
    m = result.metrics
    if rows is None:
        rows = [StartupRow(w, r) for w, r in zip(
            m.per_worker, resident_bytes(result.programs, stage_bytes, tie_bytes), strict=True)]
    elif len(rows) != result.workers:
        raise ValueError(f"startup_summary got {len(rows)} rows for {result.workers} workers")
    per_worker = [row.counts for row in rows]
    workers = [w.worker for w in per_worker]

    def column(field: str) -> list[float]:
        return [getattr(w, field) for w in per_worker]

    def ranged(field: str) -> str:
        return span(column(field))

    def most(values: Sequence[float], text: Callable[[Sequence[float]], str] = span) -> str:
        """``text(values)`` and, when they differ, the worker with the largest."""
        if min(values) == max(values):
            return text(values)
        return f"{text(values)} (most: worker {workers[values.index(max(values))]})"

    fwd, bwd, wgt = result.costs.forward, result.costs.backward, result.costs.weight
    costs = (f"costs per stage: forward {_numbers(fwd)}, backward {_numbers(bwd)}"
             + (f", weight {_numbers(wgt)}" if wgt else "")
             if len({*fwd}) == 1 and len({*bwd}) == 1 and len({*wgt}) <= 1
             else "per-stage costs, uneven")
    owned = [float(row.resident.owned) for row in rows]
    peak = [float(row.resident.peak) for row in rows]
    lines = [
        f"GeneralParallel plan: {result.schedule} {configuration_text(result)}",
        f"  latency {m.latency:g}, bubble {m.bubble_fraction:.1%} ({costs}); busy per worker "
        f"{ranged('busy')}",
        f"  stage owners: {_owners_text(result.table.owners, SUMMARY_WIDTH - 16)}",
        f"  per worker, range over the {result.workers} workers:",
        f"    messages: activations in {ranged('activation_recvs')} / out "
        f"{ranged('activation_sends')}, input grads in {ranged('input_grad_recvs')} / out "
        f"{ranged('input_grad_sends')}",
        f"    weight fetches {ranged('weight_fetches')} / serves {ranged('weight_serves')}, "
        f"gradient reductions out {ranged('grad_sends')} / in {ranged('grad_recvs')}, "
        f"all-reduces {ranged('allreduces')}",
        f"    peak stashed activations (microbatch-stages) {most(column('peak_activations'))}; "
        f"stages owned {ranged('owned_stages')}, peak resident "
        f"{most(column('peak_resident_stages'))}",
        f"    parameters owned {_byte_span(owned)}, peak resident {most(peak, _byte_span)}",
    ]
    if not result.ties:
        lines.append("    optimizer state only for the owned part")
    else:
        total = sum(tie_bytes.get(h, 0) for h in result.ties)
        lines += [
            f"    optimizer state only for the owned part; ties {ties_text(result.ties)} "
            f"({byte_text(total)}) owned with their home stage, fetched where it is not",
            f"    tie fetches {ranged('tie_fetches')} / serves {ranged('tie_serves')}, "
            f"gradient reductions out {ranged('tie_grad_sends')} / in "
            f"{ranged('tie_grad_recvs')}, all-reduces {ranged('tie_allreduces')}",
        ]
    checkpointed = checkpoint_text(result.checkpointed)
    if checkpointed:
        which = "every stage" if checkpointed == "all" else f"stages {checkpointed}"
        lines.append(f"  activation checkpointing on {which}: F keeps only the stage's inputs, B "
                     "recomputes the forward (in the backward costs above)")
    if command is not None:
        lines.append(f"  per-worker table and timeline: {command}")
    return "\n".join(lines)


def predicted_text(memories: Sequence[RankMemory]) -> str:
    """Three lines: the predicted peak per rank (range, and the rank that peaks), and each
    category's range over the ranks' peaks."""
    peaks = [m.peak for m in memories]
    top = max(range(len(peaks)), key=peaks.__getitem__)
    parts = [f"{c} {span([getattr(m.at_peak, c) for m in memories], byte_text)}"
             for c in CATEGORIES]
    return (f"    predicted peak bytes per rank {span(peaks, byte_text)} (highest: rank {top}), "
            f"made of\n      {', '.join(parts[:3])}\n      {', '.join(parts[3:])}")


def comparison_text(memories: Sequence[RankMemory], measured: Sequence[Mapping[str, int]],
                    step: int, device_peaks: Sequence[int | None] = ()) -> str:
    """Per rank: predicted and measured peak (and the device allocator's peak where known)."""
    lines = [f"GeneralParallel memory per rank, step {step}: predicted / measured peak "
             "(runtime accounting of the tensors it holds)"]
    for rank, (m, got) in enumerate(zip(memories, measured, strict=True)):
        total = got.get("total", 0)
        ratio = f"{total / m.peak:.3f}" if m.peak else "-"
        device = device_peaks[rank] if rank < len(device_peaks) else None
        extra = f", device allocator peak {byte_text(device)}" if device is not None else ""
        lines.append(f"  rank {rank}: {byte_text(m.peak)} / {byte_text(total)} "
                     f"(measured/predicted {ratio}){extra}")
    return "\n".join(lines)
