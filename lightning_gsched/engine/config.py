"""What GeneralParallel was asked for, turned into plans for training and for evaluation.

Why a module of its own: the arguments are checked at construction
(:meth:`ScheduleConfig.from_keywords`, one :class:`ScheduleArguments`), what needs the device
count (such as R dividing it) at ``Trainer.fit`` setup without building a plan
(:meth:`ScheduleConfig.check`: pure Python, so it fails on every rank before any process talks
to another), the training plan once at the first batch, with the partition's tied weights, and
forward-only plans on demand for each evaluation batch size. Both must describe the
same stage ownership, so they come from one place.

``schedule="auto"`` is decided later, at the first batch (``engine.auto``: the tuner needs the
model and a real microbatch). Until then there is no plan; afterwards the config holds the pick
as an ordinary config (:meth:`ScheduleConfig.choose`) and every plan, training or evaluation, of
this and every later run with the same strategy is the pick's: one decision, read everywhere.

Tied weights are part of every plan (``plan(..., ties=...)``): the engine learns them from the
partition at the first batch and records them here (:meth:`ScheduleConfig.set_ties`), so every
plan from then on, training or evaluation, places them. The training plan is made after that,
once; only an evaluation plan made before the first build (to cut an evaluation batch) is made
again with the ties.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_gsched.engine.workers import Workers
from lightning_gsched.errors import GschedError, ScheduleConfigError, StrategyConfigError
from lightning_gsched.schedule import validate
from lightning_gsched.schedule.arguments import ScheduleArguments
from lightning_gsched.schedule.data_parallel import pipeline_size, tensor_parallel_workers
from lightning_gsched.schedule.first_stage import first_stage_costs
from lightning_gsched.schedule.plan import (
    Plan,
    check_plan_arguments,
    pipeline_workers,
    plan_arguments,
    resolve_arguments,
    splits_backward,
)
from lightning_gsched.schedule.replicas import ReplicaLayout
from lightning_gsched.schedule.tune import TuneResult

AUTO = "auto"  # schedule="auto": the tuner picks schedule, G and mode, S, B, R, cap, ckpt
# what profile_costs=True measures instead
COST_ARGUMENTS = ("forward_cost", "backward_cost", "weight_cost")
# what "auto" lets a user fix (constraints of the search); every other argument it decides
AUTO_CONSTRAINTS = ("schedule", "stages", "microbatches", "R", "checkpoint_activations",
                    "data_parallel_size", "tensor_parallel_size")
# data_loading: who loads which rows (engine/workers.py): DDP's share per rank, or each
# data-parallel replica's whole batch on every one of its ranks
DATA_LOADINGS = ("per_rank", "per_replica")
# tensor_parallel_size="auto" searches T among these that divide W (a tensor-parallel group is
# meant to stay inside a node, whose devices are commonly 8 at most)
TENSOR_PARALLEL_AUTO = (1, 2, 4, 8)


@dataclass(frozen=True)
class AutoRequest:
    """What ``schedule="auto"`` was asked for: the search's constraints and the memory budget.

    ``microbatches``: B per data-parallel replica, as ``plan()`` counts it; ``data_parallel_size``:
    G (None: the tuner searches the divisors of W, and the mode); ``tensor_parallel_size``: T,
    the user's (the tuner plans the W / T workers, profiling the stages sharded T ways).
    ``tensor_parallel_search``: the T values to search instead (a list, or ``"auto"``:
    :data:`TENSOR_PARALLEL_AUTO`); empty when T is given. With a search, every rank loads its
    own share of the data whatever T is picked (:attr:`ScheduleConfig.rows_per_rank`)."""

    stages: int | None = None
    microbatches: int | None = None
    R: int | None = None
    checkpoint: bool = False  # True: only checkpointed candidates
    memory_budget: int | None = None  # bytes per rank
    data_parallel_size: int | None = None
    tensor_parallel_size: int = 1
    tensor_parallel_search: tuple[int, ...] | str = ()

    def tensor_parallel_candidates(self, ranks: int) -> tuple[int, ...]:
        """The T values the tuner tries for ``ranks`` ranks: the given T alone, the listed
        ones, or for ``"auto"`` those of :data:`TENSOR_PARALLEL_AUTO` that divide ``ranks``."""
        search = self.tensor_parallel_search
        if isinstance(search, str):  # "auto"
            return tuple(T for T in TENSOR_PARALLEL_AUTO if ranks % T == 0)
        return search or (self.tensor_parallel_size,)


def _moved_costs(values: dict[str, Any]) -> list[str]:
    """``"name=value"`` for each cost argument in ``values`` off its default: what
    ``profile_costs`` refuses beside it, and what keeps the engine's default split-backward
    costs from applying (:meth:`ScheduleConfig.plan_first_stage_backward_in_w`)."""
    defaults = ScheduleArguments.defaults()
    return [f"{name}={values[name]!r}" for name in COST_ARGUMENTS
            if name in values and values[name] != defaults[name]]


@dataclass
class ScheduleConfig:
    """The schedule part of GeneralParallel's arguments (see its docstring).

    ``arguments`` holds a fixed schedule's arguments (one validated :class:`ScheduleArguments`,
    not a copy of its fields); ``auto`` holds what ``schedule="auto"`` was asked for. Exactly
    one of them is set. Build it with :meth:`from_keywords`, which checks everything.
    """

    arguments: ScheduleArguments | None = None
    auto: AutoRequest | None = None
    _eval_plans: dict[int, Plan] = field(default_factory=dict, repr=False)
    _chosen: ScheduleConfig | None = field(default=None, repr=False)
    choice_text: str = field(default="", repr=False)  # "auto": the ranked table and the pick
    tune_result: TuneResult | None = field(default=None, repr=False)  # "auto": every verdict
    # {home stage: reader stages}: the partition's tied weights (set_ties), in every plan
    ties: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False)
    # a named schedule planned with its stages' seconds, timed at the build (set_costs)
    profile_costs: bool = False
    data_loading: str = "per_rank"  # DATA_LOADINGS; see :meth:`workers`

    def __post_init__(self) -> None:
        assert (self.arguments is None) != (self.auto is None), "arguments or auto, not both"

    @classmethod
    def from_keywords(cls, memory_budget: Any = None, profile_costs: Any = False,
                      data_loading: Any = "per_rank", **given: Any) -> ScheduleConfig:
        """Fail at construction for anything wrong whatever the number of devices.

        ``given``: :class:`ScheduleArguments`' keywords; a fixed schedule's are checked by it
        (the same checks, and messages, as ``plan()``). What needs the device count (R dividing
        it, S and B multiples, a cap list's length, per-stage costs or checkpointing flags
        against the schedule's default S) fails at setup, on every rank, before any process
        talks to another. ``schedule="auto"`` is checked by :meth:`_auto_request`;
        ``memory_budget`` (only allowed with it) becomes bytes here. ``profile_costs``: see
        :meth:`set_costs`; it replaces the cost arguments, so it refuses them and ``"auto"``
        (which profiles the stages itself). ``data_loading="per_replica"``: see
        :attr:`per_replica`; it needs the replicas when the DataLoader is made, so with
        ``"auto"`` a fixed G (2 or more) and T.
        """
        schedule = given.get("schedule", "fslpp")
        validate.one_of("data_loading", data_loading, DATA_LOADINGS, ScheduleConfigError)
        if validate.flag("profile_costs", profile_costs, ScheduleConfigError):
            given_costs = _moved_costs(given)
            if schedule == AUTO or given_costs:
                what = ("schedule='auto' plans with the costs it profiles anyway"
                        if schedule == AUTO else
                        f"it measures what {', '.join(given_costs)} would set")
                fix = "drop profile_costs" if schedule == AUTO else \
                    "drop profile_costs, or drop the cost arguments"
                raise ScheduleConfigError(
                    f"profile_costs=True plans with the stages' seconds timed at the first "
                    f"batch, but {what}; {fix}")
        budget = None
        if memory_budget is not None:
            budget = validate.byte_size("memory_budget", memory_budget)
            if schedule != AUTO:
                raise ScheduleConfigError(
                    f"memory_budget={memory_budget!r} is only used by schedule='auto' (the "
                    f"tuner picks the fastest plan under it), not by schedule={schedule!r}; "
                    "e.g. GeneralParallel('auto', memory_budget='20GiB'), or drop memory_budget "
                    "and check a schedule's bytes with `gsched plan ... --stage-bytes`"
                )
        if schedule == AUTO:
            request = _auto_request(given, budget)
            if data_loading == "per_replica" and (request.data_parallel_size is None
                                                  or request.tensor_parallel_search):
                raise ScheduleConfigError(
                    "data_loading='per_replica' deals the DataLoader one share per "
                    "data-parallel replica, which must be known when the DataLoader is made, "
                    "before schedule='auto' picks at the first batch; fix the replicas "
                    "(data_parallel_size= 2 or more, and one tensor_parallel_size), or keep "
                    "data_loading='per_rank'")
            return cls(auto=request, data_loading=str(data_loading))
        searched = given.get("tensor_parallel_size", 1)
        if searched == AUTO or isinstance(searched, (list, tuple)):
            raise ScheduleConfigError(
                f"tensor_parallel_size={searched!r} asks for a search over T, which "
                f"schedule='auto' does (the tuner tries each T at the first batch); with "
                f"schedule={schedule!r} give one T (e.g. tensor_parallel_size=2)")
        return cls(arguments=ScheduleArguments(**given), profile_costs=bool(profile_costs),
                   data_loading=str(data_loading))

    @property
    def is_auto(self) -> bool:
        return self.auto is not None

    @property
    def schedule(self) -> str | None:
        """The schedule asked for: ``"auto"``, a library name or a custom label."""
        return AUTO if self.arguments is None else self.arguments.schedule

    @property
    def memory_budget(self) -> int | None:
        """``"auto"``'s budget in bytes per rank (None: no limit, or not ``"auto"``)."""
        return None if self.auto is None else self.auto.memory_budget

    @property
    def chosen(self) -> ScheduleConfig | None:
        """What ``"auto"`` picked, as the arguments one would have written (None before)."""
        return self._chosen

    def _check_workers(self, workers: int) -> None:
        """What ``"auto"`` can check before the first batch: T (each T searched) divides W, a
        fixed G divides the W / T workers, and a fixed R divides them (or, with a fixed G, each
        replica's)."""
        assert self.auto is not None
        R, G = self.auto.R, self.auto.data_parallel_size
        candidates = self.auto.tensor_parallel_candidates(workers)
        for T in candidates:
            tensor_parallel_workers(workers, T)  # every T to try divides W
        if len(candidates) > 1:  # a fixed G or R is a constraint of each T's search
            return
        workers = tensor_parallel_workers(workers, candidates[0])
        if G is not None:
            try:
                pipeline_size(workers, G)
            except ScheduleConfigError as exc:
                raise ScheduleConfigError(f"{exc}, or leave data_parallel_size to "
                                          "schedule='auto'") from None
        P = workers // (G or 1)
        T = self.auto.tensor_parallel_size
        unit = "devices" if T == 1 else f"workers of tensor_parallel_size={T} ranks"
        count = "num_nodes x devices" if T == 1 else "num_nodes x devices / T"
        if R is not None and P % R:
            where = f"the {workers} {unit} ({count}), W={workers}" \
                if G is None else f"the {P} {unit} of each of the data_parallel_size={G} replicas"
            raise ScheduleConfigError(
                f"R={R} does not divide {where}; choose R among "
                f"{[r for r in range(1, P + 1) if P % r == 0]}, or leave R to "
                "schedule='auto'"
            )

    def choose(self, chosen: ScheduleConfig, text: str, result: TuneResult) -> None:
        """Record what ``"auto"`` picked (``chosen``: a checked library config), the text that
        says why and the tuner's verdicts; every plan from now on is the pick's."""
        assert self.is_auto and not chosen.is_auto
        self._chosen, self.choice_text, self.tune_result = chosen, text, result

    def set_ties(self, ties: Any) -> bool:
        """Record the partition's tied weights (``{home: readers}`` or stage groups, e.g.
        ``partition.shared_parameters.values()``); every later plan places them. True when
        they changed (evaluation plans made before must be made again)."""
        tie_map = validate.ties(ties)
        if tie_map == self.ties:
            return False
        for config in (self, self._chosen):
            if config is not None:
                config.ties = tie_map
                config._eval_plans.clear()
        return True

    def set_costs(self, costs: dict[str, list[float]]) -> None:
        """Plan with measured per-stage seconds from now on (``profile_costs=True``: the
        engine's build times the stages on rank 0 and gives every rank the same figures,
        :mod:`.profiled_costs`): ``forward_cost``, ``backward_cost`` and, for a split backward,
        ``weight_cost``. Evaluation plans made before are made again."""
        assert self.arguments is not None, "'auto' holds its pick's costs"
        self.arguments = self.arguments.replace(**costs)
        self._eval_plans.clear()

    def plan_first_stage_backward_in_w(self, workers: int) -> None:
        """A named schedule splitting backwards at the default costs: plan with the first
        stage's B free and its W the whole backward, which is what the runtime runs, where that
        order is the faster one (:mod:`~lightning_gsched.schedule.first_stage`). Given or
        profiled costs, and ``"auto"``'s (profiled), are left as they are."""
        if self.is_auto or self.profile_costs or not self.splits_backward():
            return
        if _moved_costs({name: getattr(self._arguments(), name) for name in COST_ARGUMENTS}):
            return
        S, B, R = self.resolved(workers)
        costs = first_stage_costs(self._arguments().replace(stages=S, microbatches=B, R=R,
                                                            ties=self.ties), workers)
        if costs is not None:
            self.set_costs(costs)
            self.choice_text = ("planned at the default costs with the first stage's B free "
                                "and its W the whole backward (the model's input gets no "
                                "gradient)")

    def splits_backward(self) -> bool:
        """Whether the decided schedule's training plans split each backward into B and W."""
        return splits_backward(self._effective()._arguments())

    def _effective(self) -> ScheduleConfig:
        if not self.is_auto:
            return self
        if self._chosen is None:
            raise StrategyConfigError(
                "schedule='auto' is decided at the first batch (the tuner profiles the model on "
                "a real microbatch); there is no plan before it. Read the plan after the first "
                "step: strategy.engine.train_plan"
            )
        return self._chosen

    def check(self, workers: int) -> None:
        """What a front end checks at setup, on every rank, before any process talks to
        another: everything ``plan()`` checks before it simulates, for ``workers`` ranks
        (:func:`~lightning_gsched.schedule.plan.check_plan_arguments`; an undecided
        ``"auto"``: a fixed G and R divide W). No plan is built: the training plan is made once,
        at the first batch, with the partition's tied weights (:meth:`training_plan`)."""
        if self.is_auto and self._chosen is None:
            self._check_workers(workers)
            return
        config = self._effective()
        _, B, R = config.resolved(workers)
        # S as the user gave it (None: the schedule's), so that plan() says where its default
        # came from (data_parallel='shard' grows it; a per-stage list's error says so)
        check_plan_arguments(config._arguments().replace(microbatches=B, R=R,
                                                         ties=config.ties), workers)

    @property
    def decided(self) -> bool:
        """A schedule is known: a fixed one, or ``"auto"``'s pick."""
        return not self.is_auto or self._chosen is not None

    @property
    def data_parallel_size(self) -> int:
        """G of the decided schedule (a fixed one, or ``"auto"``'s pick): the replicas the
        device mesh's ``"data_parallel"`` dimension counts."""
        return self._effective()._arguments().data_parallel_size

    @property
    def tensor_parallel_size(self) -> int:
        """T: each pipeline worker is T ranks sharing its stages' layers (``"auto"``: the
        user's, or with a search the pick's, 1 before it: every rank its own worker)."""
        if self._chosen is not None:
            return self._chosen.tensor_parallel_size
        if self.arguments is None:
            assert self.auto is not None
            return self.auto.tensor_parallel_size
        return self.arguments.tensor_parallel_size

    @property
    def rows_per_rank(self) -> bool:
        """Every rank loads its own share of the data and a worker's batch is its T ranks'
        (T searched by ``"auto"``, so that the pick never changes the global batch); else a
        worker's T ranks load one share, as Lightning's ModelParallelStrategy deals it."""
        return self.auto is not None and bool(self.auto.tensor_parallel_search)

    @property
    def per_replica(self) -> bool:
        """``data_loading="per_replica"``: every rank of a data-parallel replica loads the
        replica's whole batch (torchtitan's layout, and torch pipelining's where the first
        and the last stage read the batch), so a training step moves no rows and asks no
        rank for its batch size before its first computation; the ranks' batches are
        checked to agree in the step's loss exchange instead (engine/engine.py). Else DDP's:
        each rank (a tensor-parallel worker) loads its own share (:mod:`.rows`)."""
        return self.data_loading == "per_replica"

    def workers(self, ranks: int, rank: int) -> Workers:
        """``ranks`` processes as this config's workers, ``rank`` this one's: the decided T (a
        T that ``"auto"`` searches is 1 until the pick), the rows dealt per rank or per
        worker (:attr:`rows_per_rank`), or per replica (:attr:`per_replica`). Derived at each
        use, so it follows the pick."""
        T = self.tensor_parallel_size
        replicas = self._loading_replicas(ranks) if self.per_replica else None
        return Workers(ranks, rank, T, self.rows_per_rank, replicas)

    def _loading_replicas(self, ranks: int) -> ReplicaLayout:
        """Where the replicas sit, known before ``"auto"``'s pick too: ``data_loading=
        "per_replica"`` with ``"auto"`` fixes G and T (:meth:`from_keywords`), and every
        plan places data-parallel replicas pipeline-major (:meth:`replicas`)."""
        if self.decided:
            return self.replicas(ranks)
        assert self.auto is not None and self.auto.data_parallel_size is not None
        workers = tensor_parallel_workers(ranks, self.auto.tensor_parallel_size)
        G = self.auto.data_parallel_size
        return ReplicaLayout(pipeline_size(workers, G), G)

    def tensor_parallel_candidates(self, ranks: int) -> tuple[int, ...]:
        """The T values ``"auto"`` tries at the first batch (the decided T otherwise)."""
        if self.auto is None or self._chosen is not None:
            return (self.tensor_parallel_size,)
        return self.auto.tensor_parallel_candidates(ranks)

    def resolved(self, workers: int) -> tuple[int, int, int | None]:
        """(S, B, R) for ``workers`` ranks, filling the library's defaults (``plan()``'s own
        resolution, :func:`~lightning_gsched.schedule.plan.resolve_arguments`; B per
        data-parallel replica)."""
        if self.is_auto:
            return self._effective().resolved(workers)
        return resolve_arguments(self._arguments(), workers)

    def training_micro(self, workers: int) -> int:
        """How many microbatches a training step cuts the global batch into: B per replica
        times the data-parallel replicas."""
        config = self._effective() if self.is_auto else self
        return config.resolved(workers)[1] * config._arguments().data_parallel_size

    def replicas(self, workers: int) -> ReplicaLayout:
        """Where the data-parallel replicas sit among ``workers`` ranks: every plan's
        ``Plan.replicas``, known without a plan, so the first batch's rows can be cut by replica
        (engine/rows.py) before the training plan exists."""
        W, P = pipeline_workers((self._effective() if self.is_auto else self)._arguments(),
                                workers)
        return ReplicaLayout(P, W // P)

    def _arguments(self) -> ScheduleArguments:
        assert self.arguments is not None, "an undecided 'auto' has no arguments"
        return self.arguments

    def training_plan(self, workers: int) -> Plan:
        if self.is_auto:
            return self._effective().training_plan(workers)
        S, B, R = self.resolved(workers)
        return plan_arguments(self._arguments().replace(stages=S, microbatches=B, R=R,
                                                        ties=self.ties), workers)

    def eval_plan(self, workers: int, rows: int) -> Plan:
        """A forward-only plan for a global evaluation batch of ``rows`` rows.

        Prefers the training B (microbatches may then be uneven), else the largest valid
        B <= rows; only if the schedule allows no B <= rows, the smallest valid one (some
        microbatches are then empty).
        """
        if self.is_auto:
            return self._effective().eval_plan(workers, rows)
        if rows in self._eval_plans:
            return self._eval_plans[rows]
        S, B_train, R = self.resolved(workers)
        per = max(rows // self._arguments().data_parallel_size, 1)  # B is per replica
        candidates = list(range(min(B_train, per), 0, -1))
        candidates += list(range(per + 1, max(B_train, per) + 1))
        last_error: GschedError | None = None
        for B in candidates:
            try:
                # cap=None: nothing is stashed without backwards
                arguments = self._arguments().replace(stages=S, microbatches=B, R=R, cap=None,
                                                      ties=self.ties)
                result = plan_arguments(arguments, workers, forward_only=True)
            except ScheduleConfigError as exc:
                last_error = exc
                continue
            self._eval_plans[rows] = result
            return result
        raise StrategyConfigError(
            f"no forward-only plan fits an evaluation batch of {rows} rows: {last_error}"
        )


def _auto_request(given: dict[str, Any], budget: int | None) -> AutoRequest:
    """``"auto"`` chooses schedule, data-parallel mode, order, cap and costs itself: refuse
    what would fix them.

    ``stages``, ``microbatches``, ``R`` and ``data_parallel_size`` are kept as constraints of
    the search (only candidates with that S, that B per replica, that G; with R, the looped
    schedules with that R), and ``checkpoint_activations=True`` keeps only checkpointed
    candidates. ``data_parallel`` is not one: the search tries both modes at every G > 1.
    """
    defaults = ScheduleArguments.defaults()
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise TypeError(f"unexpected schedule arguments {unknown}")
    conflicts = [f"{name}={value!r}" for name, value in given.items()
                 if name not in AUTO_CONSTRAINTS and value != defaults[name]]
    if conflicts:
        raise ScheduleConfigError(
            f"schedule='auto' chooses the schedule, its data-parallel mode, order and cap, and "
            f"measures the stage costs itself; {', '.join(conflicts)} would decide part of "
            f"that. Drop {'it' if len(conflicts) == 1 else 'them'}, or name a schedule (e.g. "
            "schedule='1f1b') to set them yourself. With 'auto' you may fix stages=, "
            "microbatches=, R=, data_parallel_size=, tensor_parallel_size= and "
            "checkpoint_activations=True"
        )
    stages = validate.optional_positive_int("stages", given.get("stages"))
    micro = validate.optional_positive_int("microbatches", given.get("microbatches"), "8")
    R = validate.optional_positive_int("R", given.get("R"), "2")
    G = _data_parallel_size(given.get("data_parallel_size", 1))
    checkpoint = given.get("checkpoint_activations", False)
    if not isinstance(checkpoint, bool):
        raise ScheduleConfigError(
            f"checkpoint_activations={checkpoint!r} is not valid with "
            "schedule='auto': give True (only checkpointed candidates) or False (the "
            "tuner tries both); per-stage lists need a fixed schedule and S"
        )
    T, search = _tensor_parallel_request(given.get("tensor_parallel_size", 1))
    return AutoRequest(stages, micro, R, checkpoint, budget, G, T, search)


def _tensor_parallel_request(size: Any) -> tuple[int, tuple[int, ...] | str]:
    """``"auto"``'s T: one given (T, no search), or a search: a list of T values (T = 1 until
    the pick) or ``"auto"``."""
    if size == AUTO:
        return 1, AUTO
    if isinstance(size, (list, tuple)):
        if not size:
            raise ScheduleConfigError(
                "tensor_parallel_size=[] names no T to search; list the sizes to try, e.g. "
                "[1, 2, 4], or give one")
        sizes = tuple(dict.fromkeys(validate.positive_int("tensor_parallel_size", T, "2")
                                    for T in size))
        return (1, sizes) if len(sizes) > 1 else (sizes[0], ())
    return validate.positive_int("tensor_parallel_size", size, "2"), ()


def _data_parallel_size(size: Any) -> int | None:
    """G fixed by the user, or None when left to the search. The argument's default (1) is
    read as "search": the front ends pass every keyword, so "auto" cannot tell it from a
    written 1 (``gsched tune --dp 1`` can: it keeps one pipeline over all W)."""
    G = validate.positive_int("data_parallel_size", size, "2")
    return None if G == 1 else G
