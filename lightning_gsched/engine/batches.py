"""A step's microbatches from the ranks' batches: rows moved point to point, outputs handed back.

Why: GeneralParallel keeps DDP's batch semantics (the DataLoader batch is per device; with G
data-parallel replicas, each replica's batch is its ranks' batches concatenated, see
:mod:`.rows`), but a schedule may run a microbatch's first stage (its inputs) and last stage (its
targets, the loss) on other ranks than those that loaded its rows. Each rank therefore receives
exactly the rows of the microbatches its program reads that it did not load, point to point from
the ranks that loaded them (:func:`exchange_rows`), and nothing else: rows stay inside their
replica, and a rank that reads only its own rows (``ddp``) receives none. Row ownership is
kept, so predictions can go back to the rank that loaded them (:func:`local_outputs`).

Tensors with a leading dimension are batch data; plain values and 0-d tensors are taken from the
local batch and must be the same on every rank (e.g. a flag). A list holding no tensor whose
length is the batch's rows (sample ids as ``default_collate`` gives strings) is per-row data too:
each microbatch gets its rows of it, but it cannot travel (rows move as tensors), so a step that
moves rows refuses it, naming it. A receiving rank sizes what it receives from its own batch (the
batch tensors' trailing shapes and dtypes are the same on every rank, as DDP's DataLoaders give
them).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from lightning_gsched.engine.rows import RowMap, Transfer, transfers
from lightning_gsched.errors import BatchSplitError

# torch 2.13 renamed the single-tensor all-gather (all_gather_into_tensor warns a FutureWarning)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def plain_list(value: Any) -> bool:
    """A list holding no tensor: one leaf of a batch or a step's return (its items are values,
    e.g. string ids), cut with the rows when it has one per row."""
    return isinstance(value, list) and not any(
        isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))


def _flatten(batch: Any) -> tuple[list[Any], Any]:
    return pytree.tree_flatten(batch, is_leaf=plain_list)


def _row_lists(leaves: list[Any], data: list[int]) -> list[int]:
    """The plain lists with one value per row of the batch (module doc)."""
    rows = leaves[data[0]].shape[0]
    return [i for i, leaf in enumerate(leaves) if plain_list(leaf) and len(leaf) == rows]


def _leaf_name(batch: Any, index: int) -> str:
    """``batch['ids']``: where leaf ``index`` of :func:`_flatten` is in the batch."""
    path = pytree.tree_flatten_with_path(batch, is_leaf=plain_list)[0][index][0]
    return "batch" + pytree.keystr(path)


def _batch_leaves(batch: Any) -> tuple[list[Any], Any, list[int]]:
    leaves, spec = _flatten(batch)
    data = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    if not data:
        opaque = sorted({type(leaf).__name__ for leaf in leaves
                         if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type)})
        raise BatchSplitError(
            "the batch holds no tensor with a batch dimension, so it cannot be split into "
            "microbatches; return tensors (dim 0 = samples) from your DataLoader / collate_fn"
            + (f". Its {', '.join(opaque)} is a dataclass, whose tensors the split does not "
               "look into (tuples, lists, dicts and namedtuples it does): return them in a dict "
               "or a tuple, e.g. dataclasses.asdict(batch)" if opaque else "")
        )
    sizes = {leaves[i].shape[0] for i in data}
    if len(sizes) > 1:
        shapes = [tuple(leaves[i].shape) for i in data]
        raise BatchSplitError(
            f"the batch's tensors disagree on the batch dimension (shapes {shapes}); every tensor "
            "in a batch must have the number of samples as its first dimension"
        )
    return leaves, spec, data


def layout_digest(batch: Any) -> int:
    """A 64-bit digest of a batch's layout per row: its pytree structure, each tensor's shape
    after the rows (dimension 0) and dtype, each plain value. Equal layouts give equal digests
    on every rank (no per-process hashing). Why without the rows: they travel beside the digest
    wherever it goes (the step's sizes, signature and stamps), and batches of other row counts
    but one layout per row are rows that one microbatch can join (:meth:`.step_rows.StepRows.
    exchange` refuses to join others)."""
    leaves, spec, data = _batch_leaves(batch)
    per_row = set(_row_lists(leaves, data))
    items = [str(spec)] + [(tuple(leaf.shape[1:]), leaf.dim(), str(leaf.dtype))
                           if isinstance(leaf, torch.Tensor)
                           else "a value per row" if i in per_row else repr(leaf)
                           for i, leaf in enumerate(leaves)]
    digest = hashlib.blake2b(repr(items).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def content_fingerprint(batch: Any) -> torch.Tensor:
    """A 0-d int64 tensor (on the batch's device) that summarises the batch tensors' values:
    the bytes of up to ~4096 evenly spaced elements of each, weighted by position and tensor
    and summed as integers. Integer sums do not depend on their order, so equal batches give
    equal fingerprints on any device and CPU; batches of other rows differ (a sample of each
    tensor, not a hash: it tells apart loaded shares, not crafted collisions). Tensors that
    are not strided (sparse) count by their layout alone."""
    leaves, _, data = _batch_leaves(batch)
    device = leaves[data[0]].device
    total = torch.zeros((), dtype=torch.int64, device=device)
    for k, i in enumerate(data):
        leaf = leaves[i].detach()
        if leaf.layout is not torch.strided:
            continue
        flat = leaf.reshape(-1)
        sample = flat[::max(1, flat.numel() // 4096)].contiguous().view(torch.uint8)
        weights = torch.arange(1, sample.numel() + 1, dtype=torch.int64, device=device)
        total = total + (sample.to(torch.int64) * weights).sum() * (k + 1)
    return total


def rows_and_layouts(batch: Any, world_size: int, group: Any = None, *,
                     contents: bool = False) -> tuple[list[int], list[int], list[int]]:
    """Every rank's number of rows, :func:`layout_digest` and (``contents``) its
    :func:`content_fingerprint` (else 0), in one small collective of host tensors over
    ``group`` (a gloo group: on a GPU job, device tensors read back would wait for the device).

    Why the rows: every rank then computes the same row map (:mod:`.rows`), so the rows move
    without further questions. Why the digests ride along: together they are a step signature
    every rank holds (the runtime sends activations as bare tensors for a signature it has seen,
    see ``runtime/transport.py``), at no extra collective. Why the contents: ranks that must
    have loaded the same rows (a tensor-parallel worker's) are checked to have, not only rows
    of the same sizes (:meth:`.workers.Workers.batch_rows`).
    """
    leaves, _, data = _batch_leaves(batch)
    local_rows = leaves[data[0]].shape[0]
    digest = layout_digest(batch)
    if world_size == 1:
        return [local_rows], [digest], [0]
    # host numbers over a host group (the engine's ``ControlGroup.host_group``): the rows and
    # the digest are read off the shapes, so only ``contents`` reads the batch's device
    fingerprint = int(content_fingerprint(batch)) if contents else 0
    gathered = torch.zeros(3 * world_size, dtype=torch.int64)
    mine = torch.tensor([local_rows, digest, fingerprint], dtype=torch.int64)
    _all_gather_single(gathered, mine, group=group)
    values = gathered.tolist()  # a host tensor: the rows cut the microbatches on the host
    return ([int(v) for v in values[0::3]], [int(v) for v in values[1::3]],
            [int(v) for v in values[2::3]])


# a stamp's numbers ride in a float64 exchange: integers below 2**52 are exact there
_STAMP_MODULUS = 1 << 52
STAMP_SIZE = 3  # rows, layout, contents


def batch_stamp(batch: Any, rows: int, layout: int) -> list[Any]:
    """``[rows, layout, contents]`` of this rank's batch for an exchange of float64 slots
    (the loss exchange: ``LossLogExchange.start``'s ``stamp``): ``rows`` and ``layout`` as
    :func:`rows_and_layouts` read them at the step's start (not read again), the layout and
    the batch's :func:`content_fingerprint` taken modulo 2**52 (exact in float64; equal
    batches give equal numbers, other batches differ but for a 2**-52 chance). The
    fingerprint stays a tensor on the batch's device: the exchange reads it with the step's
    one host read, so a step asks the device nothing before its first computation."""
    contents = (content_fingerprint(batch) % _STAMP_MODULUS).to(torch.float64)
    return [float(rows), float(layout % _STAMP_MODULUS), contents]


def exchange_rows(batch: Any, rows: RowMap, rank: int, wanted: Sequence[Sequence[int]],
                  group: Any = None, peers: Sequence[int] | None = None,
                  layouts: Sequence[int] | None = None) -> dict[int, Any]:
    """This rank's microbatches ``wanted[rank]``, from its own rows and the rows it receives.

    ``wanted``: every rank's microbatches (the same lists on every rank), so every rank derives
    the same transfers (:func:`~.rows.transfers`) and takes part only in its own: point to point
    over ``group``, nothing for a rank that neither sends nor receives. ``peers``: the global
    rank of each position of ``rows`` (with tensor parallelism a position is a worker, whose
    rank with this rank's tensor-parallel index is the peer); None: the positions are ranks.
    ``layouts``: every position's :func:`layout_digest`, checked for every transfer first
    (:func:`_check_layouts`).
    """
    leaves, spec, data = _batch_leaves(batch)
    ranks = peers if peers is not None else range(len(wanted))
    moves = transfers(rows, wanted)
    if layouts is not None:
        _check_layouts(moves, layouts, ranks)
    listed = _row_lists(leaves, data)
    if listed and moves:  # every rank alike: the same moves, batches of one layout
        raise BatchSplitError(
            f"{_leaf_name(batch, listed[0])} is a list of one value per row (e.g. sample ids), "
            "and this step moves rows between ranks, which travel as tensors only. Use "
            "data_loading='per_replica' (every rank of a replica loads its whole batch: no "
            "row moves, and each microbatch gets its rows of the list), turn the values into "
            "a tensor (e.g. indices into a table), or leave them out of the batch")
    mine = [t for t in moves if rank in (t.source, t.target)]
    inbox = _send_and_receive(leaves, data, mine, rank, group, ranks)
    return {b: _assemble(leaves, spec, data + listed, rows, b, rank, inbox)
            for b in wanted[rank]}


def _check_layouts(moves: Sequence[Transfer], layouts: Sequence[int],
                   peers: Sequence[int]) -> None:
    """Refuse, on every rank alike before any row moves, rows sent to a position whose own
    batch has another layout per row (shapes after the rows, dtypes or structure). Why: a
    receiver sizes its buffers from its own batch (:func:`_send_and_receive`), so another
    layout would abort the process inside the transport (gloo) or join rows of another shape;
    every rank holds every layout and every transfer, so all of them raise the same error."""
    for move in moves:
        if layouts[move.source] != layouts[move.target]:
            raise BatchSplitError(
                f"ranks {peers[move.source]} and {peers[move.target]} loaded batches of "
                f"different layouts, and rank {peers[move.target]} reads rows of rank "
                f"{peers[move.source]}'s (their tensors differ after the rows: in shape, dtype "
                "or structure, or a plain value that is not a tensor differs between them; "
                "which one is off, the digests do not say). Every rank must load batches of one "
                "layout per row (pad to one length, e.g. a collate_fn padding to a fixed size, "
                "and one dtype) whose plain values (a flag, a count) are equal on every rank "
                "(a list with one value per row excepted), or every rank of a replica its "
                "whole batch: data_loading='per_replica'")


def _send_and_receive(leaves: list[Any], data: list[int], mine: list[Transfer], rank: int,
                      group: Any, peers: Sequence[int]
                      ) -> dict[tuple[int, int, int], torch.Tensor]:
    """Post every transfer's rows (one message per batch tensor, in the same order on both
    sides) and wait; what arrived, as ``{(source, micro, leaf): rows}``."""
    ops, inbox = [], {}
    for t in mine:
        for i in data:
            leaf = leaves[i]
            if t.source == rank:
                rows = torch.cat([leaf[p.start:p.stop] for p in t.pieces]).contiguous()
                ops.append(dist.P2POp(dist.isend, rows, peers[t.target], group))
                continue
            buffer = leaf.new_empty((t.rows, *leaf.shape[1:]))
            ops.append(dist.P2POp(dist.irecv, buffer, peers[t.source], group))
            first = 0
            for p in t.pieces:
                inbox[(t.source, p.micro, i)] = buffer[first:first + p.rows]
                first += p.rows
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return inbox


def _assemble(leaves: list[Any], spec: Any, data: list[int], rows: RowMap, b: int, rank: int,
              inbox: Mapping[tuple[int, int, int], torch.Tensor]) -> Any:
    """Microbatch ``b``: its pieces in row order, this rank's own sliced from its batch
    (``data``: the row tensors, then the lists with a value per row, which never travel)."""
    micro = list(leaves)
    for i in data:
        parts = [leaves[i][p.start:p.stop] if p.source == rank else inbox[(p.source, b, i)]
                 for p in rows.micros[b]]
        if isinstance(leaves[i], list):
            micro[i] = [value for part in parts for value in part]
            continue
        micro[i] = (leaves[i][:0] if not parts else parts[0] if len(parts) == 1
                    else torch.cat(parts))
    return pytree.tree_unflatten(micro, spec)


def local_outputs(outputs: Mapping[int, Any], rows: RowMap, rank: int, what: str) -> Any:
    """The outputs of the rows ``rank`` loaded, in its batch's order, from every microbatch's
    output (``outputs[b]``: rows in microbatch b's order)."""
    same_structure(list(outputs.values()), what)
    pieces = rows.loaded_by(rank)
    if not pieces:  # this rank loaded no rows: an empty output of the same structure
        return take_rows(concat_outputs([outputs[min(outputs)]], what), 0, 0)
    return concat_outputs([take_rows(outputs[p.micro], p.offset, p.offset + p.rows)
                           for p in pieces], what)


def same_structure(outputs: list[Any], what: str) -> None:
    """Refuse per-microbatch outputs of different pytree structures (they cannot be joined)."""
    specs = [pytree.tree_flatten(o)[1] for o in outputs]
    if any(s != specs[0] for s in specs):
        raise BatchSplitError(
            f"{what} returned differently structured values for different microbatches; "
            "return the same structure for every batch"
        )


def concat_outputs(outputs: list[Any], what: str) -> Any:
    """Concatenate per-microbatch outputs (same pytree structure) along dim 0."""
    same_structure(outputs, what)
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
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
