"""Bytes per rank predicted from the programs, at every action and at the peak: whether a plan fits
and where its memory goes, without running it (stage sizes measured by
:func:`lightning_gsched.measure.measure_stage_bytes`). The runtime accounts for the same categories
executing the same programs (``runtime/footprint.py``), so predicted and measured compare rank by
rank:

* **weights**: the owned weight units (stages, and the ties of owned home stages); a fetched one
  from its ``FETCH_W`` (the receive is posted into its buffer) to its ``FREE_W``.
* **gradients**: the owned units' buffers; a fetched unit's from the first weight-gradient job
  (``B``, or ``W`` when split) of a stage reading it to its ``REDUCE_G``.
* **optimizer**: the owned units' state; after the program, the optimizer's step is one more
  moment: owned weights, gradients and state plus ``ModelSizes.optimizer_step`` x the gradients.
* **activations**: what ``F s b`` saves for its backward, until ``B s b``; a split ``B`` narrows
  it to what ``W s b`` needs (less ``b_released``, plus ``w_grads``). A checkpointed stage keeps
  only its inputs from ``F`` to ``B`` (the last stage also its loss's graph); split, its
  recomputed graph less the loss's, plus ``w_grads``, from ``B`` to ``W``.
* **communication**: posted receive buffers not yet consumed (:mod:`.consumption` says by which
  action). Sends are not counted: a sent tensor is one the stash or a gradient buffer holds, and
  the transport drops it when the send completes (runtime/transport.py: SendReleaser).

With tensor parallelism each worker's T ranks run the same program on shards of its stages:
sizes measured on a rank's shards fit as they are, and :func:`tensor_parallel_share` turns an
unsharded stage's parameter bytes (``gsched plan --tp T --stage-bytes``) into one rank's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence

from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule import validate
from lightning_gsched.schedule.consumption import OpRules, UnitKey, unit_of
from lightning_gsched.schedule.program import Action, Message, Op, Programs

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "communication")


@dataclass(frozen=True)
class StageSizes:
    """Bytes of one stage. ``activations``: what one microbatch's forward stashes when its input
    is local; ``received_activations``: when it arrived as a message (a saved view of the received
    buffer keeps it alive whole). ``message``: the stage's output for one microbatch (the
    input-gradient coming back is counted at the same size)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    message: int
    received_activations: int = -1  # -1: the same as ``activations``
    inputs: int = 0  # what a checkpointed stage keeps from F to B
    loss_graph: int = 0  # of ``activations``, the last stage's loss code's own graph
    b_released: int = 0  # split: of ``activations``, what B frees (the graph above every weight)
    w_grads: int = 0  # split: the gradients B records for W, held from B to W

    @property
    def stash_from_message(self) -> int:
        return self.activations if self.received_activations < 0 else self.received_activations


@dataclass(frozen=True)
class TieSizes:
    """Bytes of one tie; ``readers``: every stage that reads it (home included)."""

    readers: tuple[int, ...]
    params: int
    grads: int
    optimizer: int


@dataclass(frozen=True)
class ModelSizes:
    """Every stage's sizes plus every tie's (``{home stage: TieSizes}``, in no stage)."""

    stages: tuple[StageSizes, ...]
    ties: Mapping[int, TieSizes] = field(default_factory=dict)
    # the optimizer step's allocation per gradient byte (1.0 for a multi-tensor Adam, else 0)
    optimizer_step: float = 0.0

    @property
    def tie_map(self) -> dict[int, tuple[int, ...]]:  # {home: readers}, as plan(ties=) takes
        return {h: tuple(t.readers) for h, t in sorted(self.ties.items())}


@dataclass(frozen=True)
class Bytes:
    """Bytes by category at one moment."""

    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    communication: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict[str, int]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "total": self.total}


@dataclass(frozen=True)
class RankMemory:
    """One rank: the total's peak (``at_peak``, by category, at the start or after any action)
    and each category's own peak."""

    rank: int
    at_peak: Bytes
    category_peaks: Bytes

    @property
    def peak(self) -> int:
        return self.at_peak.total


_UNIT_OPS = frozenset({Op.FETCH_W, Op.FREE_W, Op.REDUCE_G, Op.RECV_G, Op.ALLREDUCE_G})


class RankWalk:
    """The live bytes of one rank while its program runs, action by action."""

    def __init__(self, programs: Programs, sizes: ModelSizes, rank: int,
                 checkpointed: Sequence[bool], rules: OpRules | None = None) -> None:
        self.sizes, self.checkpointed = sizes, checkpointed
        self.rules = rules or OpRules.of(programs)
        owned, owned_ties = programs.owned_stages(rank), programs.owned_ties(rank)
        self.owned, self.owned_ties = set(owned), set(owned_ties)
        units: list[StageSizes | TieSizes] = [*(sizes.stages[s] for s in owned),
                                              *(sizes.ties[h] for h in owned_ties)]
        training = not programs.forward_only
        self.weights = sum(u.params for u in units)
        self.gradients = sum(u.grads for u in units) if training else 0
        self.optimizer = sum(u.optimizer for u in units) if training else 0
        self.activations = self.communication = 0
        self.fetched_grads: set[UnitKey] = set()  # fetched units' gradients not yet handed off
        self.posted: dict[Message, int] = {}  # activations, input-gradients
        self.grads_posted: dict[UnitKey, int] = {}  # peers' gradients not yet summed in
        self.stashed: dict[tuple[int, int | None], int] = {}  # (stage, micro) -> bytes held
        self.fed_by_message: set[tuple[int, int | None]] = set()

    def now(self) -> tuple[int, int, int, int, int]:  # in CATEGORIES' order
        return (self.weights, self.gradients, self.optimizer, self.activations,
                self.communication)

    def apply(self, a: Action) -> None:
        stages, rules = self.sizes.stages, self.rules
        op, s = a.op, a.stage
        if op is Op.F or op is Op.B or op is Op.W:
            # the posted receives it reads are consumed (a list: ``any`` would stop early)
            received = any([self._consume(key) for key in rules.messages_read(a)])
            if op is rules.stash_op:
                if received:
                    self.fed_by_message.add((s, a.micro))
                self._hold(s, a.micro, stages[s].inputs if self.checkpointed[s]
                           else self._graph(s, a.micro))
            elif op is rules.weight_grad_op:
                self._weight_grads(s)
                self.activations -= self.stashed.pop((s, a.micro), 0)
            elif rules.narrows_stash(op):  # a split B: from now to W, what W needs
                graph = self._graph(s, a.micro)
                # checkpointed: the recomputed graph lives until W, the loss's not
                kept = graph - (stages[s].loss_graph if self.checkpointed[s]
                                else stages[s].b_released)
                self._hold(s, a.micro, kept + stages[s].w_grads)
        elif op is Op.RECV_ACT or op is Op.RECV_GRAD:
            # an input-gradient is the size of the output of the stage that produced the input
            nbytes = (stages[s].message if op is Op.RECV_ACT
                      else max((stages[p].message for p in rules.act_from[s]), default=0))
            self.posted[Message.of(a)] = nbytes
            self.communication += nbytes
        elif op in _UNIT_OPS:  # a weight unit's (a stage's or a tie's)
            unit = unit_of(a)
            sizes = self._unit_sizes(unit)
            if op is Op.FETCH_W or op is Op.FREE_W:
                self.weights += sizes.params if op is Op.FETCH_W else -sizes.params
            elif op is Op.REDUCE_G and unit in self.fetched_grads:
                self.fetched_grads.discard(unit)
                self.gradients -= sizes.grads
            elif op is Op.RECV_G:
                self.grads_posted[unit] = self.grads_posted.get(unit, 0) + sizes.grads
                self.communication += sizes.grads
            elif op is Op.ALLREDUCE_G:  # the gradients received for it are summed in
                self.communication -= self.grads_posted.pop(unit, 0)
        # sends and serves change nothing: a sent tensor is one the stash or a buffer holds

    def _unit_sizes(self, unit: UnitKey) -> StageSizes | TieSizes:  # a stage's, or a tie's
        return self.sizes.ties[unit[0]] if unit[1] else self.sizes.stages[unit[0]]

    def _graph(self, s: int, micro: int | None) -> int:  # of ``F s micro``
        stage = self.sizes.stages[s]
        return stage.stash_from_message if (s, micro) in self.fed_by_message else stage.activations

    def _hold(self, s: int, micro: int | None, nbytes: int) -> None:
        self.activations += nbytes - self.stashed.get((s, micro), 0)
        self.stashed[(s, micro)] = nbytes

    def _weight_grads(self, s: int) -> None:
        """The gradient buffers of the fetched units stage ``s`` reads start at their first use."""
        units = [((s, False), s in self.owned),
                 *(((h, True), h in self.owned_ties) for h in self.rules.ties_read[s])]
        for unit, owned in units:
            if not owned and unit not in self.fetched_grads:
                self.fetched_grads.add(unit)
                self.gradients += self._unit_sizes(unit).grads

    def _consume(self, key: Message) -> bool:  # drop a posted receive's buffer, if one was
        if key not in self.posted:
            return False
        self.communication -= self.posted.pop(key)
        return True


def rank_memory(programs: Programs, sizes: ModelSizes, rank: int,
                checkpointed: Sequence[bool] = (), rules: OpRules | None = None) -> RankMemory:
    """Walk one rank's program: the peak of the total and of each category."""
    walk = RankWalk(programs, sizes, rank,
                     list(checkpointed) or [False] * programs.num_stages, rules)
    # plain tuples per action, Bytes only at the end: the tuner walks every rank of hundreds of
    # plans, and a dataclass per action was most of its time
    moments = [walk.now()]
    for action in programs.ranks[rank]:
        walk.apply(action)
        moments.append(walk.now())
    if sizes.optimizer_step and walk.gradients:
        # the optimizer's step: owned weights, gradients, state and its temporaries (optimizer)
        moments.append((walk.weights, walk.gradients,
                        walk.optimizer + int(sizes.optimizer_step * walk.gradients), 0, 0))
    peak = max(moments, key=sum)  # the first of equal totals
    return RankMemory(rank, Bytes(*peak), Bytes(*map(max, zip(*moments, strict=True))))


def predict_memory(programs: Programs, sizes: ModelSizes, checkpointed: Sequence[bool] = (),
                   ranks: Sequence[int] | None = None) -> list[RankMemory]:
    """Every rank's predicted bytes for one step. ``checkpointed``: ``plan(...).checkpointed``
    (empty: none). ``ranks``: only these, in this order; a walk reads only its rank's program,
    so each rank of a job can predict its own."""
    for rank in ranks or ():
        if not 0 <= rank < programs.world_size:
            raise ScheduleConfigError(
                f"rank {rank} is not one of the programs' {programs.world_size} ranks")
    if len(sizes.stages) != programs.num_stages:
        raise ScheduleConfigError(
            f"the sizes describe {len(sizes.stages)} stages but the programs have "
            f"{programs.num_stages}; measure the sizes on the partition the plan was made for "
            "(the same number of stages)")
    for s, stage in enumerate(sizes.stages):
        for name, value in vars(stage).items():  # the fields, in order
            if name != "received_activations" or value != -1:
                _check_bytes(f"stage {s}'s {name}", value)
    if sizes.tie_map != dict(programs.ties):
        raise ScheduleConfigError(
            f"the sizes describe ties {sizes.tie_map} (home stage: reader stages) but the "
            f"programs were planned with ties {dict(programs.ties)}; plan with "
            "ties=sizes.tie_map (the partition's shared_parameters) so that tied weights are "
            "placed by the plan")
    for h, tie in sizes.ties.items():
        for name in ("params", "grads", "optimizer"):
            _check_bytes(f"tie {h}'s {name}", getattr(tie, name))
    if checkpointed and len(checkpointed) != programs.num_stages:
        raise ScheduleConfigError(
            f"checkpointed has {len(checkpointed)} flags for {programs.num_stages} stages; pass "
            "the plan's own plan(...).checkpointed")
    if ranks is None:
        programs.ranks.make_all()  # a reader of every rank: the full lowering at once
    rules = OpRules.of(programs)
    return [rank_memory(programs, sizes, r, checkpointed, rules)
            for r in (range(programs.world_size) if ranks is None else ranks)]


def _check_bytes(what: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ScheduleConfigError(f"{what} bytes must be a non-negative int, got {value!r}")


@dataclass(frozen=True)
class ResidentBytes:
    """One worker's parameter bytes: owned, and the most it holds at once."""

    owned: int
    peak: int


def resident_bytes(programs: Programs, stage_bytes: Sequence[int],
                   tie_bytes: Mapping[int, int] | None = None,
                   ranks: Sequence[int] | None = None) -> list[ResidentBytes]:
    """Per rank: owned parameter bytes and the peak of owned + fetched ones (the walk's weights
    with nothing else sized: the runtime's ``peak_resident_param_bytes``). ``stage_bytes``: every
    stage's (tied parameters are in no stage); ``tie_bytes``: ``{home: bytes}`` (None: 0)."""
    sizes = list(stage_bytes)
    if len(sizes) != programs.num_stages or any(isinstance(b, bool) or not isinstance(b, int)
                                                or b < 0 for b in sizes):
        raise ScheduleConfigError(
            f"stage_bytes must be one int >= 0 per stage ({programs.num_stages}), got "
            f"{stage_bytes!r}")
    ties = {h: int((tie_bytes or {}).get(h, 0)) for h in programs.ties}
    weights_only = ModelSizes(tuple(StageSizes(b, 0, 0, 0, 0) for b in sizes),
                              {h: TieSizes(r, ties[h], 0, 0) for h, r in programs.ties.items()})
    rules = OpRules.of(programs)
    return [ResidentBytes(owned=sum(sizes[s] for s in programs.owned_stages(rank))
                          + sum(ties[h] for h in programs.owned_ties(rank)),
                          peak=rank_memory(programs, weights_only, rank,
                                           rules=rules).category_peaks.weights)
            for rank in (range(programs.world_size) if ranks is None else ranks)]


def tensor_parallel_share(stage_bytes: Sequence[int], tensor_parallel_size: int,
                          sharded: float | Sequence[float] = 1.0) -> list[int]:
    """One rank's bytes of every stage when its worker's T = ``tensor_parallel_size`` ranks
    shard the fraction ``sharded`` of it (one number, or one per stage) and replicate the rest.

    ``stage_bytes`` are the unsharded stage's (one device's, as ``measure_stage_bytes`` gives
    them without a tensor-parallel plan). The sharded part is divided by T, rounded up (the
    largest shard's); the rest (norms, a row-wise layer's bias, layers the plan leaves out)
    stays whole on every rank. Parameters, their gradients and their optimizer state divide
    alike, so one rule serves all three. Activations are not divided here: column- and
    row-wise layers leave a stage's boundary activations full size on every rank; only
    ``SequenceParallel`` shards them.
    """
    T = validate.positive_int("tensor_parallel_size", tensor_parallel_size, "2")
    sizes = list(stage_bytes)
    for s, nbytes in enumerate(sizes):
        _check_bytes(f"stage {s}'s parameter", nbytes)
    shares = []
    for nbytes, fraction in zip(sizes, sharded_fractions(sharded, len(sizes)), strict=True):
        split = round(nbytes * fraction)  # the sharded bytes; the rest is replicated
        shares.append(nbytes - split + -(-split // T))
    return shares


def sharded_fractions(sharded: float | Sequence[float], stages: int | None = None
                      ) -> list[float]:
    """``sharded`` (:func:`tensor_parallel_share`'s) as fractions in [0, 1]: one per stage
    where ``stages`` is known, else as given; or the error naming the bad entry."""
    rule = "a fraction of a stage's parameter bytes, from 0 (none sharded) to 1 (all)"
    values: list[Any]
    if validate.is_real(sharded):
        values = [sharded] * (1 if stages is None else stages)
    elif isinstance(sharded, (str, bytes)) or not isinstance(sharded, Sequence) or not sharded:
        raise validate.invalid("tensor_parallel_sharded", sharded,
                               f"give one fraction or one per stage ({rule})", "0.9")
    elif stages is not None and len(sharded) != stages:
        raise ScheduleConfigError(
            f"tensor_parallel_sharded has {len(sharded)} values for S={stages} stages: give one "
            "fraction for every stage or a single one for all, e.g. tensor_parallel_sharded=0.9")
    else:
        values = list(sharded)
    for s, value in enumerate(values):
        if not validate.is_real(value) or not 0 <= value <= 1:
            name = "tensor_parallel_sharded" + ("" if validate.is_real(sharded) else f"[{s}]")
            raise validate.invalid(name, value, rule, "0.9")
    return [float(v) for v in values]
