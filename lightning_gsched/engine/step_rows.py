"""A step's rows: the batch sizes, the row map, and the rows moved to the ranks that read them.

Why a module of its own: a step's batch goes through the same four moves whatever the step
(training, evaluation, the build's probe, ``"auto"``'s tuner cut): the batch-size exchange
(every rank's rows, so every rank computes the same row map without asking again), the row map
(:mod:`.rows`, cut by replica and checked), which microbatches each rank reads (its first
stages' inputs, its last stages' targets), and the point-to-point exchange of the rows a rank
reads but did not load (:mod:`.batches`). The engine's steps read them here, in that order.
With ``data_loading="per_replica"`` a training step after the build skips the two exchanges
(every rank holds its replica's batch) and its batch's stamp is checked with the step's losses
instead (:meth:`StepRows.sizes`, :meth:`StepRows.check_stamps`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from lightning_gsched.engine.batches import batch_stamp, exchange_rows, rows_and_layouts
from lightning_gsched.engine.config import ScheduleConfig
from lightning_gsched.engine.control import Collective
from lightning_gsched.engine.rows import RowMap, check_rows, row_map
from lightning_gsched.engine.workers import Workers
from lightning_gsched.errors import BatchSplitError
from lightning_gsched.schedule.plan import Plan
from lightning_gsched.schedule.replicas import ReplicaLayout


def needed_micros(compute: list[list[int]], world_size: int) -> list[list[int]]:
    """Per rank, the microbatches whose rows it uses: those whose first stage (inputs) or last
    stage (targets, the loss) it computes, read from the placement table's compute rows.

    Why the table and not the programs: the same answer (a stage's forward of microbatch b runs
    on ``compute[s][b]``), without reading every rank's program, which a large plan lowers
    only for the ranks that read it (schedule/lazy_ranks.py)."""
    needed: list[list[int]] = [[] for _ in range(world_size)]
    for b, (first, last) in enumerate(zip(compute[0], compute[-1], strict=True)):
        needed[first].append(b)
        if last != first:
            needed[last].append(b)
    return needed


@dataclass(frozen=True)
class Held:
    """Microbatches every rank holds already (the first one, which a build probes) and the row
    map they were cut under: a step's exchange sends them again only under another row map."""

    cut: RowMap | None = None
    micros: dict[int, Any] = field(default_factory=dict)

    def first(self) -> Any:
        assert self.cut is not None
        return self.micros[self.cut.first_nonempty()]


class StepRows:
    """The row moves of one engine's steps. ``group()``: the group of the engine's collectives,
    read at each use (an aborted group must lose its last reference); ``collective``: the
    engine's runner of them (a backend failure becomes a fault naming the move); ``rank``: this
    process's, whose :attr:`workers` the config decides; ``host_group()``: the group of the
    batch-size exchange, which carries host tensors (``ControlGroup.host_group``)."""

    def __init__(self, config: ScheduleConfig, rank: int, world_size: int,
                 group: Callable[[], Any], collective: Collective,
                 host_group: Callable[[], Any]) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.host_group = host_group
        self.collective = collective
        self._needed: dict[int, list[list[int]]] = {}
        # the most rows a training step's global batch had so far: a shorter one that does not
        # split is the epoch's last batch, which the refusal then says
        self.largest_training_rows = 0

    @property
    def workers(self) -> Workers:
        """The ranks as the plan's workers, as the config has them now (``"auto"``'s pick
        decides a searched T)."""
        return self.config.workers(self.world_size, self.rank)

    def sizes(self, batch: Any, trusted: bool = False) -> tuple[list[int], list[int]]:
        """Every position's rows and batch layout (:meth:`.workers.Workers.batch_rows`: per
        worker, whose T ranks must have loaded the same batch, values included, per rank, or
        per replica). ``trusted`` with ``data_loading="per_replica"`` (a training step after
        the first): no collective, every replica's rows and layout taken to be this rank's
        (training refuses replicas of unequal rows anyway), and :meth:`check_stamps` checks
        the step's stamps after the step."""
        workers = self.workers
        if trusted and workers.replicas is not None:
            rows, layouts, _ = rows_and_layouts(batch, 1)  # this rank's, read off the shapes
            self._check_replica_split(workers, rows[0])
            return rows * workers.positions, layouts * workers.positions
        rows, layouts, contents = self.collective(
            "the batch-size exchange (every rank loads a batch at every step: a rank whose "
            "DataLoader has fewer batches ends its epoch while the others wait here)",
            lambda: rows_and_layouts(
                batch, self.world_size, self.host_group(), contents=workers.shares_batches))
        return workers.batch_rows(rows, layouts, contents)

    def _check_replica_split(self, workers: Workers, rows: int) -> None:
        """A trusted step's own replica batch splits into its microbatches, else a
        BatchSplitError naming it (the general check would name every replica with this
        rank's rows, which is all it knows)."""
        per = self.config.training_micro(self.world_size) // workers.positions
        if rows % per:
            raise BatchSplitError(
                f"data-parallel replica {workers.position}'s batch has {rows} rows "
                f"(data_loading='per_replica': each of its ranks loaded it), which do not split "
                f"into its {per} microbatches of equal size. Make batch_size a multiple of "
                f"{per} on every replica, pass microbatches= dividing it, or use "
                "drop_last=True so the last batch is not short")

    @property
    def stamped(self) -> bool:
        """Whether steps carry :meth:`stamp`: with ``data_loading="per_replica"`` on more
        than one rank, where a trusted step asks nothing (:meth:`sizes`). Why also with one
        rank per replica (P = T = 1, plain data parallelism): no ranks share a batch then,
        but the replicas must still hold as many rows, which only the stamps tell."""
        return self.workers.replicas is not None and self.world_size > 1

    def stamp(self, batch: Any, rows: list[int], layouts: list[int]) -> list[Any]:
        """This rank's batch for :meth:`check_stamps` (:func:`.batches.batch_stamp`; its
        numbers: :data:`.batches.STAMP_SIZE`), or nothing where not :attr:`stamped`.
        ``rows``/``layouts``: the step's :meth:`sizes`, whose entry at this rank's position
        is its own batch's (taken as every replica's when trusted, checked when gathered)."""
        if not self.stamped:
            return []
        position = self.workers.position
        return batch_stamp(batch, rows[position], layouts[position])

    def check_stamps(self, stamps: list[list[float]], parts: int) -> None:
        """Every rank's :meth:`stamp`, exchanged with the step's losses: the ranks of a
        replica loaded one batch (rows, layout and values), and the replicas as many rows, a
        multiple of their microbatches (training's :func:`.rows.check_rows`), else a
        StrategyConfigError or a BatchSplitError naming them on every rank alike. Why after
        the step: with ``data_loading="per_replica"`` a step trusts every rank of a replica
        to hold its batch (:meth:`sizes`), so that nothing is asked before its first
        computation; a sampler dealing other shares is then named one step late."""
        if not stamps or not stamps[0]:
            return
        rows, layouts, contents = ([int(stamp[k]) for stamp in stamps] for k in range(3))
        positions, _ = self.workers.batch_rows(rows, layouts, contents)
        self.row_map(positions, parts, exact=True)

    def row_map(self, rows: list[int], parts: int, *, exact: bool,
                what: str = "global batch", replicas: ReplicaLayout | None = None) -> RowMap:
        """The step's ``parts`` microbatches as pieces of the ranks' batches, cut by replica
        (engine/rows.py; ``replicas``: the schedule's unless given), checked: training
        (``exact``) refuses microbatches of unequal rows on every rank alike."""
        layout = replicas if replicas is not None else self.config.replicas(self.world_size)
        cut = row_map(rows, [self.workers.members(layout.members(g))
                             for g in range(layout.replicas)], parts)
        workers = self.workers
        loaders = ("ranks" if workers.positions == self.world_size
                   else "tensor-parallel workers")
        check_rows(cut, exact, what, per_replica=workers.replicas is not None, loaders=loaders)
        return cut

    def step_cut(self, rows: list[int], training: bool) -> RowMap:
        """The row map of a decided schedule's training or evaluation step."""
        if training:
            try:
                cut = self.row_map(rows, self.config.training_micro(self.world_size), exact=True)
            except BatchSplitError as exc:
                if sum(rows) < self.largest_training_rows:
                    raise BatchSplitError(
                        f"the epoch's last batch is short ({sum(rows)} rows where the earlier "
                        f"ones had {self.largest_training_rows}): {exc}") from exc
                raise
            self.largest_training_rows = max(self.largest_training_rows, sum(rows))
            return cut
        B = self.config.eval_plan(self.world_size, sum(rows)).micro
        return self.row_map(rows, B, exact=False, what="evaluation batch")

    def needed(self, plan: Plan) -> list[list[int]]:
        """Per rank, the microbatches whose rows it uses (first-stage inputs, last-stage
        targets), read once per plan off its placement table."""
        key = id(plan.programs)
        if key not in self._needed:
            self._needed[key] = self.workers.by_position(
                needed_micros(plan.table.compute, plan.workers))
        return self._needed[key]

    def exchange(self, batch: Any, cut: RowMap, wanted: list[list[int]],
                 held: Held | None = None, layouts: list[int] | None = None) -> dict[int, Any]:
        """This rank's ``wanted`` microbatches, the rows it did not load received point to
        point from the ranks that did (batches.exchange_rows: only inside their replica, and
        only to the ranks that read them); those ``held`` by every rank under the same cut are
        not sent again. ``layouts``: every position's :func:`.batches.layout_digest` (the
        step's :meth:`sizes`), checked first for every move (:func:`.batches.exchange_rows`)."""
        given = held.micros if held is not None and held.cut == cut else {}
        wanted = [[b for b in micros if b not in given] for micros in wanted]
        received = self.collective("the batch's row exchange", lambda: exchange_rows(
            batch, cut, self.workers.position, wanted, self.group(), self.workers.peers(),
            layouts))
        return {**given, **received}

    def first_micro(self, batch: Any, cut: RowMap, layouts: list[int] | None = None) -> Held:
        """The first non-empty microbatch of ``cut`` on every rank: the build probes the user's
        step on it and partitions the model on its call (every rank the same). ``layouts``: as
        for :meth:`exchange`."""
        everyone = [[cut.first_nonempty()]] * self.workers.positions
        return Held(cut, self.exchange(batch, cut, everyone, layouts=layouts))
