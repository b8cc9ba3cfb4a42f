"""Global batches: gather the per-device batches, cut microbatches, hand rows back.

Why: GeneralParallel keeps DDP's batch semantics (the DataLoader batch is per device, the global
batch is their concatenation in rank order), but a schedule may run microbatch ``b`` on any rank,
so every rank needs the rows of the microbatches its program touches. Gathering the global batch
(usually token ids and labels, small next to activations) is the simple, schedule-independent
way to get them; row ownership is kept so predictions can go back to the rank that loaded them.

Tensors with a leading dimension are batch data; plain values and 0-d tensors are taken from the
local batch and must be the same on every rank (e.g. a flag).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from lightning_gsched.errors import BatchSplitError


@dataclass
class GlobalBatch:
    """The global batch: every rank's rows concatenated, or only this rank's when that suffices.

    ``value`` is the whole concatenated batch, or None when :func:`gather_batch` found that every
    rank's program touches only microbatches made of its own rows (e.g. ``ddp``); then ``local``
    holds this rank's rows and :meth:`micros` cuts the microbatches it can from them.
    """

    value: Any
    rows_per_rank: list[int]
    local: Any = None
    rank: int = 0

    @property
    def rows(self) -> int:
        return sum(self.rows_per_rank)

    def offset(self, rank: int) -> int:
        return sum(self.rows_per_rank[:rank])

    def micros(self, parts: int, *, exact: bool, what: str = "global batch") -> list[Any]:
        """The ``parts`` microbatches (``split_batch``'s rule); None for those not held here."""
        if self.value is not None:
            return split_batch(self.value, parts, exact=exact, what=what)
        check_split(self.rows, parts, exact, what)
        first, held = self.offset(self.rank), self.rows_per_rank[self.rank]
        return [take_rows(self.local, start - first, end - first)
                if first <= start and end <= first + held else None
                for start, end in micro_bounds(self.rows, parts)]


def _batch_leaves(batch: Any) -> tuple[list[Any], Any, list[int]]:
    leaves, spec = pytree.tree_flatten(batch)
    data = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    if not data:
        raise BatchSplitError(
            "the batch holds no tensor with a batch dimension, so it cannot be split into "
            "microbatches; return tensors (dim 0 = samples) from your DataLoader / collate_fn"
        )
    sizes = {leaves[i].shape[0] for i in data}
    if len(sizes) > 1:
        shapes = [tuple(leaves[i].shape) for i in data]
        raise BatchSplitError(
            f"the batch's tensors disagree on the batch dimension (shapes {shapes}); every tensor "
            "in a batch must have the number of samples as its first dimension"
        )
    return leaves, spec, data


def owns_its_micros(rows: list[int], parts: int, needed: list[list[int]]) -> bool:
    """Whether every rank r needs only microbatches cut entirely from r's own rows.

    ``needed[r]``: the microbatches whose inputs or targets rank r uses. Every rank evaluates this
    on the same numbers, so all of them take the same (collective or not) path.
    """
    bounds = micro_bounds(sum(rows), parts)
    first = 0
    for r, held in enumerate(rows):
        for b in needed[r]:
            low, high = bounds[b]
            if high > low and not (first <= low and high <= first + held):
                return False
        first += held
    return True


def layout_digest(batch: Any) -> int:
    """A 64-bit digest of a batch's layout: its pytree structure, each tensor's shape and dtype,
    each plain value. Equal layouts give equal digests on every rank (no per-process hashing)."""
    leaves, spec = pytree.tree_flatten(batch)
    items = [str(spec)] + [(tuple(leaf.shape), str(leaf.dtype)) if isinstance(leaf, torch.Tensor)
                           else repr(leaf) for leaf in leaves]
    digest = hashlib.blake2b(repr(items).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def rows_and_layouts(batch: Any, world_size: int,
                     group: Any = None) -> tuple[list[int], list[int]]:
    """Every rank's number of rows and :func:`layout_digest`, in one small collective.

    Why the digests ride along: together they are a step signature every rank holds (the
    runtime sends activations as bare tensors for a signature it has seen, see
    ``runtime/transport.py``), at no extra collective, since the rows are gathered anyway.
    """
    leaves, _, data = _batch_leaves(batch)
    local_rows = leaves[data[0]].shape[0]
    digest = layout_digest(batch)
    if world_size == 1:
        return [local_rows], [digest]
    device = leaves[data[0]].device
    gathered = torch.zeros(2 * world_size, dtype=torch.int64, device=device)
    mine = torch.tensor([local_rows, digest], dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(gathered, mine, group=group)
    values = gathered.tolist()  # the rows cut the microbatches on the host: one sync
    return [int(v) for v in values[0::2]], [int(v) for v in values[1::2]]


def gather_batch(batch: Any, rows: list[int], rank: int = 0, parts: int | None = None,
                 needed: list[list[int]] | None = None, group: Any = None) -> GlobalBatch:
    """Concatenate every rank's batch along dim 0 (collective unless skipped, see below).

    ``rows``: every rank's rows (:func:`rows_and_layouts`). With ``parts`` and ``needed`` (see :func:`owns_its_micros`),
    nothing is gathered when no rank needs another rank's rows.
    """
    world_size = len(rows)
    if world_size == 1:
        return GlobalBatch(batch, rows)
    if parts is not None and needed is not None and owns_its_micros(rows, parts, needed):
        return GlobalBatch(None, rows, local=batch, rank=rank)
    leaves, spec, data = _batch_leaves(batch)
    most = max(rows)
    out = list(leaves)
    for i in data:
        leaf = leaves[i].contiguous()
        if leaf.shape[0] < most:
            pad = leaf.new_zeros((most - leaf.shape[0], *leaf.shape[1:]))
            leaf = torch.cat([leaf, pad])
        pieces = [torch.empty_like(leaf) for _ in range(world_size)]
        dist.all_gather(pieces, leaf, group=group)
        out[i] = torch.cat([piece[:n] for piece, n in zip(pieces, rows, strict=True)])
    return GlobalBatch(pytree.tree_unflatten(out, spec), rows)


def split_batch(batch: Any, parts: int, *, exact: bool, what: str = "global batch") -> list[Any]:
    """Cut ``batch`` into ``parts`` microbatches along dim 0.

    ``exact``: the rows must divide evenly (training: each microbatch's loss carries weight 1/B,
    which equals the single-device mean only for equal sizes); otherwise sizes differ by at most
    one row, and may be 0 when there are fewer rows than microbatches.
    """
    leaves, spec, data = _batch_leaves(batch)
    check_split(leaves[data[0]].shape[0], parts, exact, what)
    chunks = {i: torch.tensor_split(leaves[i], parts) for i in data}
    micros = []
    for b in range(parts):
        micro = list(leaves)
        for i in data:
            micro[i] = chunks[i][b]
        micros.append(pytree.tree_unflatten(micro, spec))
    return micros


def check_split(rows: int, parts: int, exact: bool, what: str) -> None:
    """With ``exact``, refuse row counts that do not split into equal microbatches."""
    if exact and rows % parts:
        raise BatchSplitError(
            f"the {what} has {rows} rows, which do not split into {parts} equal microbatches. "
            f"Make batch_size x devices x num_nodes a multiple of microbatches={parts} (e.g. a "
            f"global batch of {parts * max(1, -(-rows // parts))}), pass microbatches= dividing "
            f"{rows}, or use drop_last=True so the last batch is not short"
        )


def micro_rows(rows: int, parts: int) -> list[int]:
    """Row counts of ``split_batch``'s microbatches (torch.tensor_split's rule)."""
    base, extra = divmod(rows, parts)
    return [base + (1 if b < extra else 0) for b in range(parts)]


def micro_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) rows of each of ``split_batch``'s microbatches in the global batch."""
    bounds, start = [], 0
    for size in micro_rows(rows, parts):
        bounds.append((start, start + size))
        start += size
    return bounds


def concat_outputs(outputs: list[Any], what: str) -> Any:
    """Concatenate per-microbatch outputs (same pytree structure) along dim 0."""
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    if any(s != spec for _, s in flat):
        raise BatchSplitError(
            f"{what} returned differently structured values for different microbatches; "
            "return the same structure for every batch"
        )
    joined = []
    for column in zip(*(leaves for leaves, _ in flat), strict=True):
        if isinstance(column[0], torch.Tensor) and column[0].dim() > 0:
            joined.append(torch.cat(list(column)))
        else:
            raise BatchSplitError(
                f"{what} returned a {type(column[0]).__name__} that has no batch dimension, so "
                "the per-microbatch results cannot be joined; return tensors whose first "
                "dimension is the samples"
            )
    return pytree.tree_unflatten(joined, spec)


def take_rows(value: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of every batch-dimension tensor in ``value``."""

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf[start:stop]
        return leaf

    return pytree.tree_map(cut, value)
