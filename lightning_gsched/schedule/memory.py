"""Bytes per rank, predicted from the programs: weights, gradients, optimizer state, stashed
activations and communication buffers, at every action and at the peak.

Why here, in pure Python: the question users bring to a pipeline or sharded schedule is "does it
fit, and where does the memory go". The programs already say, action by action, which stages'
weights are resident on a rank, which (stage, microbatch) activations are stashed and which
receives are posted; multiplying those by per-stage sizes answers it without running anything.
The sizes (:class:`StageSizes`) are plain numbers measured by the torch layers
(:func:`lightning_gsched.measure.measure_stage_bytes`), and the runtime accounts for the same
categories while it executes the same programs (``runtime/footprint.py``), so predicted and
measured can be compared rank by rank, as the action counters are.

What each category holds on a rank, as the runtime allocates it:

* **weights**: the weight units (stages, and ties: those of its owned home stages) it owns,
  always; a fetched unit from its ``FETCH_W`` (the receive is posted into the unit's buffer)
  to its ``FREE_W``.
* **gradients**: the owned units' gradient buffers for the whole step (zeroed at its start and
  handed to the optimizer at its end); a fetched unit's from the first weight-gradient job
  (``B``, or ``W`` when the backward is split) of a stage reading it to its ``REDUCE_G``.
* **optimizer**: the state the optimizer keeps for the parameters this rank updates (owned
  stages and owned ties); constant over the step. After the program, the optimizer's step is
  one more moment: owned weights, gradients and state plus the step's temporaries
  (``ModelSizes.optimizer_step`` x the owned gradients: a multi-tensor Adam's
  ``sqrt(exp_avg_sq)``), activations and messages gone.
* **activations**: what autograd saves in ``F s b`` for its backward, held until ``B s b``.
  When the backward is split, ``B s b`` narrows it (``OpRules.narrows_stash``) to what
  ``W s b`` needs, held until ``W``: the saved tensors less ``b_released`` (those of the graph
  above every weight, e.g. the loss's, which B frees) plus ``w_grads`` (the gradients B
  recorded for W). A checkpointed stage keeps only its inputs from ``F`` to ``B`` (on the last
  stage also the loss's own graph); with a split backward its recomputed graph then lives
  from ``B`` to ``W`` (the loss's graph is released at ``B``), with ``w_grads``.
* **communication**: receive buffers posted and not yet consumed: an activation from its
  ``RECV_ACT`` to the ``F`` that reads it, an input-gradient from ``RECV_GRAD`` to its ``B``, a
  peer's gradient of a unit from ``RECV_G`` to the unit's ``ALLREDUCE_G`` that sums it in (or
  the step's end). Sends are not counted: a sent tensor is one the stash or a gradient buffer
  already holds, and the transport drops its reference when the send completes, on every
  backend (runtime/send_release.py), so a fetched unit's gradient leaves at its ``REDUCE_G``.

Which action consumes which receive and which op ends a stash are the shared rules of
:mod:`.consumption` (the dry run, the time replay and the runtime read the same ones).

The peak is taken after every action (and at the start); :class:`RankMemory` reports the total's
peak with its split by category at that moment, and each category's own peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Mapping, Sequence

from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule.consumption import OpRules, UnitKey, unit_of
from lightning_gsched.schedule.program import Action, Message, Op, Programs

CATEGORIES = ("weights", "gradients", "optimizer", "activations", "communication")


@dataclass(frozen=True)
class StageSizes:
    """Bytes of one stage, as the torch layers measure them.

    ``params``: its weights. ``grads``: its gradient buffer (the trainable weights). ``optimizer``:
    the optimizer state its owner keeps. ``activations``: what one microbatch's forward stashes
    for the backward when its input comes from a stage on the same rank (or is the model's
    input); ``received_activations``: the same when its input arrived as a message (a tensor
    the stage saves can be a view of the received buffer, which then stays alive whole).
    ``message``: the stage's output for one microbatch as it travels (the activation message to
    the next stage's rank; the input-gradient coming back is counted at the same size).
    """

    params: int
    grads: int
    optimizer: int
    activations: int
    message: int
    received_activations: int = -1  # -1: the same as ``activations``
    inputs: int = 0  # what a checkpointed stage keeps from F to B: its inputs
    # of ``activations``, the last stage's loss code's own graph: a checkpointed last stage
    # keeps it from F to B only (a split B releases it; the recomputed stage lives on to W)
    loss_graph: int = 0
    # split backward (zero-bubble): of ``activations``, what a split B frees (the saved tensors
    # of the graph above every weight, e.g. the loss's: nothing W runs holds them)
    b_released: int = 0
    # split backward: the gradients B records for W (at every node whose children lead to a
    # weight, and of the outputs computed from weights alone), held from B to W
    w_grads: int = 0

    @property
    def stash_from_message(self) -> int:
        return self.activations if self.received_activations < 0 else self.received_activations


@dataclass(frozen=True)
class TieSizes:
    """Bytes of one tie (the tied parameters whose home stage is ``home``; see
    ``schedule/program.py``): weights, gradient buffer, the optimizer state of its owners.
    ``readers``: every stage that reads it (home included), as the plan's ``ties`` says."""

    readers: tuple[int, ...]
    params: int
    grads: int
    optimizer: int


@dataclass(frozen=True)
class ModelSizes:
    """Every stage's sizes plus every tie's (``{home stage: TieSizes}``; outside the stages)."""

    stages: tuple[StageSizes, ...]
    ties: Mapping[int, TieSizes] = field(default_factory=dict)
    # what the optimizer's step allocates for its duration, per byte of the gradients it
    # applies (runtime.optimizer_step_factor: 1.0 for a multi-tensor Adam, 0 otherwise)
    optimizer_step: float = 0.0

    @property
    def tie_map(self) -> dict[int, tuple[int, ...]]:
        """``{home: readers}``: what ``plan(..., ties=...)`` takes for the programs these
        sizes are for."""
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
    """One rank: the total's peak (``at_peak``, by category) and each category's own peak."""

    rank: int
    at_peak: Bytes
    category_peaks: Bytes

    @property
    def peak(self) -> int:
        return self.at_peak.total


# the weight-unit ops that change bytes (a serve sends what the owner holds)
_UNIT_OPS = frozenset({Op.FETCH_W, Op.FREE_W, Op.REDUCE_G, Op.RECV_G, Op.ALLREDUCE_G})


class _RankWalk:
    """The live bytes of one rank while its program runs, action by action."""

    def __init__(self, programs: Programs, sizes: ModelSizes, rank: int,
                 checkpointed: Sequence[bool], rules: OpRules | None = None) -> None:
        self.programs, self.sizes, self.rank = programs, sizes, rank
        self.checkpointed = checkpointed
        self.rules = rules = rules or OpRules.of(programs)
        owned = programs.owned_stages(rank)
        self.owned = set(owned)
        stages = sizes.stages
        training = not programs.forward_only
        ties = [sizes.ties[h] for h in programs.owned_ties(rank)]
        self.owned_ties = set(programs.owned_ties(rank))
        self.ties_of = rules.ties_read
        self.weights = sum(stages[s].params for s in owned) + sum(t.params for t in ties)
        self.gradients = (sum(stages[s].grads for s in owned) + sum(t.grads for t in ties)
                          if training else 0)
        self.optimizer = (sum(stages[s].optimizer for s in owned)
                          + sum(t.optimizer for t in ties) if training else 0)
        self.activations = 0
        self.communication = 0
        # fetched units holding a gradient not yet handed off
        self.fetched_grads: set[UnitKey] = set()
        self.posted: dict[Message, int] = {}  # activations, input-gradients
        self.grads_posted: dict[UnitKey, int] = {}  # peers' gradients not yet summed in
        self.stashed: dict[tuple[int, int | None], int] = {}  # (stage, micro) -> bytes held
        self.fed_by_message: set[tuple[int, int | None]] = set()

    def now(self) -> Bytes:
        return Bytes(self.weights, self.gradients, self.optimizer, self.activations,
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
        elif op is Op.RECV_ACT:
            self._post(Message.of(a), stages[s].message)
        elif op is Op.RECV_GRAD:  # the gradient of stage s's input: its producer's output
            self._post(Message.of(a),
                       max((stages[p].message for p in rules.act_from[s]), default=0))
        elif op in _UNIT_OPS:
            self._unit(a)
        # sends change nothing: a sent tensor is one the stash or a gradient buffer holds

    def _unit(self, a: Action) -> None:
        """A weight unit's op (a stage's or a tie's): fetched weights, a fetched unit's
        gradient handed off, an owner's received gradients."""
        op, unit = a.op, unit_of(a)
        params, grads = self._unit_bytes(unit)
        if op is Op.FETCH_W:
            self.weights += params
        elif op is Op.FREE_W:
            self.weights -= params
        elif op is Op.REDUCE_G:
            if unit in self.fetched_grads:
                self.fetched_grads.discard(unit)
                self.gradients -= grads
        elif op is Op.RECV_G:
            self.grads_posted[unit] = self.grads_posted.get(unit, 0) + grads
            self.communication += grads
        else:  # ALLREDUCE_G: the gradients received for it are summed in
            self.communication -= self.grads_posted.pop(unit, 0)

    def _unit_bytes(self, unit: UnitKey) -> tuple[int, int]:
        """(parameter, gradient) bytes of a stage or of the tie whose home it is."""
        index, tie = unit
        sizes = self.sizes.ties[index] if tie else self.sizes.stages[index]
        return sizes.params, sizes.grads

    def _graph(self, s: int, micro: int | None) -> int:
        """Bytes of the graph of ``F s micro`` (fed by a message, or locally)."""
        stage = self.sizes.stages[s]
        return stage.stash_from_message if (s, micro) in self.fed_by_message else stage.activations

    def _hold(self, s: int, micro: int | None, nbytes: int) -> None:
        self.activations += nbytes - self.stashed.get((s, micro), 0)
        self.stashed[(s, micro)] = nbytes

    def _weight_grads(self, s: int) -> None:
        """A weight-gradient job of stage ``s``: a fetched stage's gradient buffer, and those of
        the fetched ties it reads, start at their first use."""
        units = [((s, False), s in self.owned),
                 *(((h, True), h in self.owned_ties) for h in self.ties_of[s])]
        for unit, owned in units:
            if not owned and unit not in self.fetched_grads:
                self.fetched_grads.add(unit)
                self.gradients += self._unit_bytes(unit)[1]

    def _post(self, key: Message, nbytes: int) -> None:
        self.posted[key] = nbytes
        self.communication += nbytes

    def _consume(self, key: Message) -> bool:
        """Drop a posted receive's buffer; whether one was posted."""
        if key not in self.posted:
            return False
        self.communication -= self.posted.pop(key)
        return True


def rank_memory(programs: Programs, sizes: ModelSizes, rank: int,
                checkpointed: Sequence[bool] = (), rules: OpRules | None = None) -> RankMemory:
    """Walk one rank's program; the peak of the total and of each category (``rules``: the
    programs' :class:`OpRules`, if built already)."""
    walk = _RankWalk(programs, sizes, rank,
                     list(checkpointed) or [False] * programs.num_stages, rules)
    # plain tuples per action, a Bytes only at a new peak: the tuner walks every rank of
    # hundreds of plans, and building and summing a dataclass per action was most of its time
    best = _now(walk)
    highs = list(best)
    for action in programs.ranks[rank]:
        walk.apply(action)
        current = _now(walk)
        if sum(current) > sum(best):
            best = current
        highs = [max(high, value) for high, value in zip(highs, current, strict=True)]
    if sizes.optimizer_step and walk.gradients:
        # after the program: the optimizer's step, over this rank's owned weights, gradients
        # and state, plus its temporaries (counted as optimizer bytes)
        stepping = (walk.weights, walk.gradients,
                    walk.optimizer + int(sizes.optimizer_step * walk.gradients), 0, 0)
        if sum(stepping) > sum(best):
            best = stepping
        highs = [max(high, value) for high, value in zip(highs, stepping, strict=True)]
    return RankMemory(rank, Bytes(*best), Bytes(*highs))


def _now(walk: _RankWalk) -> tuple[int, int, int, int, int]:
    """The walk's bytes by category, in :data:`CATEGORIES`' order."""
    return (walk.weights, walk.gradients, walk.optimizer, walk.activations, walk.communication)


def predict_memory(programs: Programs, sizes: ModelSizes,
                   checkpointed: Sequence[bool] = (),
                   ranks: Sequence[int] | None = None) -> list[RankMemory]:
    """Every rank's predicted bytes for one step of ``programs`` (see the module docstring).

    ``checkpointed``: one bool per stage (``plan(...).checkpointed``); empty means none.
    ``ranks``: only these ranks, in this order (default: every rank). A rank's walk reads only
    its own program (the other facts it needs are the owners, the ties and the stage graph), so
    a job's ranks each predict their own bytes and gather them (a job's start-up at large W,
    where the programs are lowered per rank: ``lazy_ranks.py``) instead of each lowering
    every rank's program (a minute and gigabytes at W=1024)."""
    for rank in ranks or ():
        if not 0 <= rank < programs.world_size:
            raise ScheduleConfigError(
                f"rank {rank} is not one of the programs' {programs.world_size} ranks")
    if len(sizes.stages) != programs.num_stages:
        raise ScheduleConfigError(
            f"the sizes describe {len(sizes.stages)} stages but the programs have "
            f"{programs.num_stages}; measure the sizes on the partition the plan was made for "
            "(the same number of stages)"
        )
    for s, stage in enumerate(sizes.stages):
        for f in fields(stage):
            value = getattr(stage, f.name)
            if f.name == "received_activations" and value == -1:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ScheduleConfigError(
                    f"stage {s}'s {f.name} bytes must be a non-negative int, got {value!r}")
    check_tie_sizes(programs, sizes)
    if checkpointed and len(checkpointed) != programs.num_stages:
        raise ScheduleConfigError(
            f"checkpointed has {len(checkpointed)} flags for {programs.num_stages} stages; pass "
            "the plan's own plan(...).checkpointed")
    if ranks is None:
        programs.ranks.make_all()  # a reader of every rank: the full lowering at once
    rules = OpRules.of(programs)
    return [rank_memory(programs, sizes, r, checkpointed, rules)
            for r in (range(programs.world_size) if ranks is None else ranks)]


def check_tie_sizes(programs: Programs, sizes: ModelSizes) -> None:
    """The sizes describe exactly the programs' ties (same homes, same readers)."""
    if sizes.tie_map != dict(programs.ties):
        raise ScheduleConfigError(
            f"the sizes describe ties {sizes.tie_map} (home stage: reader stages) but the "
            f"programs were planned with ties {dict(programs.ties)}; plan with "
            "ties=sizes.tie_map (the partition's shared_parameters) so that tied weights are "
            "placed by the plan"
        )
    for h, tie in sizes.ties.items():
        for name in ("params", "grads", "optimizer"):
            value = getattr(tie, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ScheduleConfigError(
                    f"tie {h}'s {name} bytes must be a non-negative int, got {value!r}")


@dataclass(frozen=True)
class ResidentBytes:
    """One worker's parameter bytes: the stages it owns, and the most it holds at once."""

    owned: int
    peak: int


def resident_bytes(programs: Programs, stage_bytes: Sequence[int],
                   tie_bytes: Mapping[int, int] | None = None,
                   ranks: Sequence[int] | None = None) -> list[ResidentBytes]:
    """Per rank: owned parameter bytes and the peak of owned + fetched ones, read off the programs.

    ``stage_bytes``: every stage's parameter bytes (what the runtime's flat buffer of that stage
    holds; tied parameters are not part of any stage). ``tie_bytes``: ``{home: bytes}`` of
    every tie of the programs (None: ties count 0 bytes), owned with their home stage and
    fetched from their ``FETCH_W`` to their ``FREE_W``. This is the
    weights category of the bytes walk with nothing else sized; the runtime's
    ``peak_resident_param_bytes`` counter measures the same quantity on the real buffers, so for
    the same programs the two are equal. Unlike ``peak_resident_stages`` (a count) this weighs
    each stage by its size: which stages are resident together is decided by the programs.
    ``ranks``: only these ranks, in this order (default: every rank): only their programs are
    read (the text table's few shown workers, sampled first: :meth:`.LazyList.sample`; a
    rank's own row at a job's start-up).
    """
    sizes = list(stage_bytes)
    if len(sizes) != programs.num_stages or any(
        isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in sizes
    ):
        raise ScheduleConfigError(
            f"stage_bytes must be one int >= 0 per stage ({programs.num_stages}), got "
            f"{stage_bytes!r}"
        )
    ties = {h: int((tie_bytes or {}).get(h, 0)) for h in programs.ties}
    weights_only = ModelSizes(tuple(StageSizes(b, 0, 0, 0, 0) for b in sizes),
                              {h: TieSizes(r, ties[h], 0, 0) for h, r in programs.ties.items()})
    rules = OpRules.of(programs)
    return [ResidentBytes(owned=sum(sizes[s] for s in programs.owned_stages(rank))
                          + sum(ties[h] for h in programs.owned_ties(rank)),
                          peak=rank_memory(programs, weights_only, rank,
                                           rules=rules).category_peaks.weights)
            for rank in (range(programs.world_size) if ranks is None else ranks)]


def peaks(memories: Sequence[RankMemory]) -> list[int]:
    """The predicted peak total of every rank."""
    return [m.peak for m in memories]
