"""Which rows of which rank's DataLoader batch make each microbatch, and who sends them to whom.

Why a pure module: the batch semantics are a question of row arithmetic that every rank answers
alone and identically (each knows every rank's row count after one small collective), so all
agree on who sends which rows without asking. Written here once, with no torch, it is read by
the row exchange (``batches.exchange_rows``), by the prediction hand-back (the rows a rank loaded
and where they sit in each microbatch's output), by the logged values' weights and by tests.

Semantics (DDP's, per data-parallel replica): with G replicas (``data_parallel_size``), replica
``g``'s batch is the concatenation of its ranks' DataLoader batches in position order
(``ReplicaLayout.members(g)``), cut into ``parts / G`` microbatches (``torch.tensor_split``'s
sizes); replica ``g``'s ``m``-th is the step's microbatch ``g + G * m`` (the microbatch that
``schedule/data_parallel.py`` places on replica ``g`` as its ``m``-th). With G = 1 the one
replica is every rank in rank order: the global batch cut into ``parts`` microbatches. Rows
therefore only ever travel inside their replica. The arithmetic counts *positions*, the batches
it joins: ranks here; a tensor-parallel worker's T ranks or, with ``data_loading=
"per_replica"``, a whole replica's ranks load one batch and are one position
(``engine/workers.py``), so a replica's batch is then one position's and no row travels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_gsched.errors import BatchSplitError


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of rank ``source``'s batch, at ``offset`` in microbatch ``micro``."""

    micro: int
    source: int
    start: int
    stop: int
    offset: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class RowMap:
    """Every microbatch of a step as pieces of the ranks' batches (see the module docstring).

    ``rows``: every rank's DataLoader rows; ``replicas``: each replica's ranks by position;
    ``micros[b]``: microbatch b's pieces in row order (none for an empty microbatch).
    """

    rows: tuple[int, ...]
    replicas: tuple[tuple[int, ...], ...]
    micros: tuple[tuple[Piece, ...], ...]

    @property
    def parts(self) -> int:
        return len(self.micros)

    def micro_rows(self) -> list[int]:
        """Rows of each microbatch (the logged values' weights)."""
        return [sum(p.rows for p in pieces) for pieces in self.micros]

    def replica_rows(self) -> list[int]:
        """Rows of each replica's batch."""
        return [sum(self.rows[r] for r in ranks) for ranks in self.replicas]

    def loaded_by(self, rank: int) -> list[Piece]:
        """The pieces cut from ``rank``'s batch, in its row order (where its predictions are)."""
        return sorted((p for pieces in self.micros for p in pieces if p.source == rank),
                      key=lambda p: p.start)

    def first_nonempty(self) -> int:
        """The first microbatch holding rows (0 when none does): the one a build is probed on."""
        return next((b for b, pieces in enumerate(self.micros) if pieces), 0)


@dataclass(frozen=True)
class Transfer:
    """The rows ``source`` sends ``target`` in one step: ``pieces`` in microbatch order, sent as
    one concatenation (per batch tensor)."""

    source: int
    target: int
    pieces: tuple[Piece, ...]

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.pieces)


def micro_rows(rows: int, parts: int) -> list[int]:
    """Row counts of ``rows`` rows cut into ``parts`` microbatches (torch.tensor_split's rule)."""
    base, extra = divmod(rows, parts)
    return [base + (1 if b < extra else 0) for b in range(parts)]


def micro_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) rows of each microbatch of ``rows`` rows cut into ``parts``."""
    bounds, start = [], 0
    for size in micro_rows(rows, parts):
        bounds.append((start, start + size))
        start += size
    return bounds


def row_map(rows: Sequence[int], replicas: Sequence[Sequence[int]], parts: int) -> RowMap:
    """The step's ``parts`` microbatches over ``replicas`` (module docstring); ``parts`` counts
    every replica's microbatches, so it must be a multiple of their number."""
    G = len(replicas)
    if parts % G:
        raise BatchSplitError(
            f"{parts} microbatches do not split over {G} data-parallel replicas; the plan's "
            "microbatch count is per replica times data_parallel_size")
    micros: list[tuple[Piece, ...]] = [() for _ in range(parts)]
    for g, ranks in enumerate(replicas):
        starts, first = [], 0
        for r in ranks:  # where each rank's rows start in its replica's batch
            starts.append(first)
            first += rows[r]
        for m, (low, high) in enumerate(micro_bounds(first, parts // G)):
            micros[g + G * m] = tuple(
                Piece(g + G * m, r, max(low, s) - s, min(high, s + rows[r]) - s,
                      max(low, s) - low)
                for r, s in zip(ranks, starts, strict=True)
                if max(low, s) < min(high, s + rows[r]))
    return RowMap(tuple(rows), tuple(tuple(ranks) for ranks in replicas), tuple(micros))


def transfers(rows: RowMap, wanted: Sequence[Sequence[int]]) -> list[Transfer]:
    """Who sends which rows to whom so that rank r holds microbatches ``wanted[r]``: every piece
    of those not cut from r's own batch, one transfer per (source, target), in (source, target)
    order; no transfer for rows a rank does not want."""
    moves: dict[tuple[int, int], list[Piece]] = {}
    for target, micros in enumerate(wanted):
        for b in sorted(set(micros)):
            for piece in rows.micros[b]:
                if piece.source != target:
                    moves.setdefault((piece.source, target), []).append(piece)
    return [Transfer(source, target, tuple(pieces))
            for (source, target), pieces in sorted(moves.items())]


def check_rows(rows: RowMap, exact: bool, what: str = "global batch",
               per_replica: bool = False, loaders: str = "ranks") -> None:
    """With ``exact`` (training), refuse batches whose microbatches would differ in size.

    Why: each microbatch's loss carries weight 1/B, which is the mean over the global batch (one
    device's loss) only when every microbatch has the same rows; with replicas, every replica's
    batch must then hold the same rows, a multiple of its microbatches. ``per_replica``: the
    row map's positions are replicas, each loaded whole by every one of its ranks
    (``data_loading="per_replica"``), which the message names instead of ranks' shares.
    ``loaders``: what the positions are, for the message (``"ranks"``, or ``"tensor-parallel
    workers"`` whose T ranks load one batch). Where their batches differ in size, the message
    lists them: a rank handed fewer rows than the others is then the cause.
    """
    if not exact:
        return
    G = len(rows.replicas)
    if G == 1:
        shares = None if per_replica or len(set(rows.rows)) < 2 else list(rows.rows)
        check_split(sum(rows.rows), rows.parts, exact, what, per_replica, shares, loaders)
        return
    per, replica_rows = rows.parts // G, rows.replica_rows()
    if len(set(replica_rows)) > 1 or replica_rows[0] % per:
        size = per * max(1, -(-max(replica_rows) // per))
        if per_replica:
            loaded = "(each of its ranks loads it whole: data_loading='per_replica')"
            example = f"{size} per replica: batch_size {size} on every rank"
        else:
            loaded = (f"(its {loaders}' DataLoader batches, concatenated; {loaders}' rows "
                      f"{list(rows.rows)})")
            example = f"{size} per replica: equal batch_size on every rank"
        raise BatchSplitError(
            f"with data_parallel_size={G}, each replica's batch {loaded} is cut into {per} "
            f"microbatches of equal size, but the replicas hold {replica_rows} rows. Give every "
            f"replica the same rows, a multiple of {per} (e.g. {example}), pass microbatches= "
            "dividing them, or use drop_last=True so the last batch is not short")


def check_split(rows: int, parts: int, exact: bool, what: str,
                per_replica: bool = False, shares: list[int] | None = None,
                loaders: str = "ranks") -> None:
    """With ``exact``, refuse row counts that do not split into equal microbatches.
    ``per_replica``: one replica whose ranks each load the whole batch (its size is then the
    DataLoader's batch_size, not batch_size x devices x num_nodes). ``shares``: the rows of
    each of the ``loaders``' batches that make it, where they differ (named as the cause)."""
    if not exact or not rows % parts:
        return
    if shares is not None:
        n = len(shares)
        step = parts * n // math.gcd(parts, n)  # a global batch every rank shares equally
        each = step * max(1, -(-rows // step)) // n
        raise BatchSplitError(
            f"the {what} has {rows} rows, which do not split into {parts} equal microbatches: "
            f"the {loaders}' batches differ in size ({loaders}' rows {shares}, concatenated in "
            f"order). Hand every one of the {n} {loaders} a batch of the same "
            f"size, together a multiple of microbatches={parts} (e.g. {each} rows each), pass "
            f"microbatches= dividing {rows}, or use drop_last=True so the last batch is not "
            "short")
    sizes = "batch_size" if per_replica else "batch_size x devices x num_nodes"
    raise BatchSplitError(
        f"the {what} has {rows} rows, which do not split into {parts} equal microbatches. "
        f"Make {sizes} a multiple of microbatches={parts} (e.g. a "
        f"global batch of {parts * max(1, -(-rows // parts))}), pass microbatches= dividing "
        f"{rows}, or use drop_last=True so the last batch is not short"
    )
