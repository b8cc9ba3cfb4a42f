"""What GeneralParallel was asked for, turned into plans for training and for evaluation.

Why a module of its own: the arguments are checked at construction (:meth:`ScheduleConfig.check`),
the training plan is built at ``Trainer.fit`` setup (pure Python, so what needs the device count,
such as R dividing it, fails on every rank before any process talks to another),
and forward-only plans are built on demand for each evaluation batch size. Both must describe the
same stage ownership, so they come from one place.

``schedule="auto"`` is decided later, at the first batch (``engine.auto``: the tuner needs the
model and a real microbatch). Until then there is no plan; afterwards the config holds the pick
as an ordinary config (:meth:`ScheduleConfig.choose`) and every plan, training or evaluation, of
this and every later run with the same strategy is the pick's: one decision, read everywhere.

Tied weights are part of every plan (``plan(..., ties=...)``): the engine learns them from the
partition at the first batch and records them here (:meth:`ScheduleConfig.set_ties`), so every
plan from then on, training or evaluation, places them; the setup plan, made before the
partition exists, differs from that one only in its tie actions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from lightning_gsched.errors import GschedError, ScheduleConfigError, StrategyConfigError
from lightning_gsched.schedule import plan as make_plan
from lightning_gsched.schedule import validate
from lightning_gsched.schedule.library import resolve_shape
from lightning_gsched.schedule.plan import DEFAULT, Plan, check_arguments
from lightning_gsched.schedule.tune import TuneResult

AUTO = "auto"  # schedule="auto": the tuner picks schedule, S, B, R and checkpointing


@dataclass
class ScheduleConfig:
    """The schedule part of GeneralParallel's arguments (see its docstring)."""

    schedule: str | None = "fslpp"
    R: int | None = None
    microbatches: int | None = None
    stages: int | None = None
    order: str | Callable | None = None
    cap: int | Sequence[int] | str | None = DEFAULT  # plan()'s vocabulary, see docs/usage.md
    placement: Callable | None = None
    priority: Callable | None = None
    forward_cost: float | Sequence[float] = 1.0
    backward_cost: float | Sequence[float] = 2.0
    weight_cost: float | Sequence[float] | None = None
    split_backward: bool | None = None
    checkpoint_activations: bool | Sequence[bool] = False  # True, or one bool per stage
    fetch_window: int | None = None
    memory_budget: int | str | None = None  # bytes per rank for "auto" (an int after check())
    _eval_plans: dict[int, Plan] = field(default_factory=dict, repr=False)
    _chosen: ScheduleConfig | None = field(default=None, repr=False)
    choice_text: str = field(default="", repr=False)  # "auto": the ranked table and the pick
    tune_result: TuneResult | None = field(default=None, repr=False)  # "auto": every verdict
    # {home stage: reader stages}: the partition's tied weights (set_ties), in every plan
    ties: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False)

    @property
    def is_auto(self) -> bool:
        return self.schedule == AUTO

    @property
    def chosen(self) -> ScheduleConfig | None:
        """What ``"auto"`` picked, as the arguments one would have written (None before)."""
        return self._chosen

    def check(self) -> None:
        """Fail at construction for anything wrong whatever the number of devices.

        The same checks as ``plan()`` (one implementation: ``schedule.plan.check_arguments``,
        raising ScheduleConfigError): an unknown schedule name (close matches in the message), ``microbatches=0``, ``R="2"``,
        R on a schedule without groups, an unknown order or cap word, a cost that is not a
        finite number > 0 (or the wrong number of them when ``stages`` is given), a placement
        that is not callable, ``checkpoint_activations`` that is neither a bool nor a list of
        bools (or of the wrong length when ``stages`` is given). What needs the device count
        (R dividing it, S and B multiples, a cap list's length, per-stage costs or
        checkpointing flags against the schedule's default S) fails at setup, on every rank,
        before any process talks to another.

        ``schedule="auto"`` is checked by :meth:`_check_auto`; ``memory_budget`` (only allowed
        with it) becomes bytes here.
        """
        if self.memory_budget is not None:
            given, self.memory_budget = self.memory_budget, validate.byte_size(
                "memory_budget", self.memory_budget)
            if not self.is_auto:
                raise ScheduleConfigError(
                    f"memory_budget={given!r} is only used by schedule='auto' (the "
                    f"tuner picks the fastest plan under it), not by schedule={self.schedule!r}; "
                    "e.g. GeneralParallel('auto', memory_budget='20GiB'), or drop memory_budget "
                    "and check a schedule's bytes with `gsched plan ... --stage-bytes`"
                )
        if self.is_auto:
            self._check_auto()
            return
        check_arguments(self.schedule, self.stages, self.microbatches, self.R, self.order,
                        self.cap, self.forward_cost, self.backward_cost,
                        self.placement, self.priority, self.weight_cost, self.split_backward,
                        self.checkpoint_activations, self.fetch_window)

    def _check_auto(self) -> None:
        """``"auto"`` chooses schedule, order, cap and costs itself: refuse what would fix them.

        ``stages``, ``microbatches`` and ``R`` are kept as constraints of the search (only
        candidates with that S, that B; with R, the looped schedules with that R), and
        ``checkpoint_activations=True`` keeps only checkpointed candidates.
        """
        given = {"placement": self.placement is not None, "priority": self.priority is not None,
                 "order": self.order is not None, "cap": self.cap != DEFAULT,
                 "forward_cost": self.forward_cost != 1.0,
                 "backward_cost": self.backward_cost != 2.0,
                 "weight_cost": self.weight_cost is not None,
                 "split_backward": self.split_backward is not None,
                 "fetch_window": self.fetch_window is not None}
        conflicts = [f"{name}={getattr(self, name)!r}" for name, on in given.items() if on]
        if conflicts:
            raise ScheduleConfigError(
                f"schedule='auto' chooses the schedule, its order and cap, and measures the "
                f"stage costs itself; {', '.join(conflicts)} would decide part of that. Drop "
                f"{'it' if len(conflicts) == 1 else 'them'}, or name a schedule (e.g. "
                "schedule='1f1b') to set them yourself. With 'auto' you may fix stages=, "
                "microbatches=, R= and checkpoint_activations=True"
            )
        validate.optional_positive_int("stages", self.stages)
        validate.optional_positive_int("microbatches", self.microbatches, "8")
        validate.optional_positive_int("R", self.R, "2")
        if not isinstance(self.checkpoint_activations, bool):
            raise ScheduleConfigError(
                f"checkpoint_activations={self.checkpoint_activations!r} is not valid with "
                "schedule='auto': give True (only checkpointed candidates) or False (the "
                "tuner tries both); per-stage lists need a fixed schedule and S"
            )

    def _check_workers(self, workers: int) -> None:
        """What ``"auto"`` can check before the first batch: a fixed R divides W."""
        if self.R is not None and workers % self.R:
            raise ScheduleConfigError(
                f"R={self.R} does not divide the {workers} devices (num_nodes x devices), "
                f"W={workers}; choose R among "
                f"{[r for r in range(1, workers + 1) if workers % r == 0]}, or leave R to "
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
        they changed (plans made before, such as the setup plan, must be made again)."""
        tie_map = validate.ties(ties)
        if tie_map == self.ties:
            return False
        for config in (self, self._chosen):
            if config is not None:
                config.ties = tie_map
                config._eval_plans.clear()
        return True

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

    def setup_plan(self, workers: int) -> Plan | None:
        """The training plan a front end builds at setup (a bad config fails there, on every
        rank); None for an undecided ``"auto"``, whose plan comes at the first batch."""
        if self.is_auto and self._chosen is None:
            self._check_workers(workers)
            return None
        return self.training_plan(workers)

    def resolved(self, workers: int) -> tuple[int, int, int | None]:
        """(S, B, R) for ``workers`` ranks, filling the library's defaults (``plan()``'s own
        resolution, :func:`~lightning_gsched.schedule.library.resolve_shape`)."""
        if self.is_auto:
            return self._effective().resolved(workers)
        if self.placement is not None:
            return int(self.stages), int(self.microbatches), self.R  # type: ignore[arg-type]
        return resolve_shape(self.schedule, workers, self.stages,  # type: ignore[arg-type]
                             self.microbatches, self.R)

    def _plan_kwargs(self) -> dict[str, Any]:
        return dict(
            order=self.order, cap=self.cap, placement=self.placement,
            priority=self.priority,
            forward_cost=self.forward_cost, backward_cost=self.backward_cost,
            weight_cost=self.weight_cost, split_backward=self.split_backward,
            checkpoint_activations=self.checkpoint_activations,
            fetch_window=self.fetch_window, ties=self.ties,
        )

    def training_plan(self, workers: int) -> Plan:
        if self.is_auto:
            return self._effective().training_plan(workers)
        S, B, R = self.resolved(workers)
        return make_plan(self.schedule, workers=workers, stages=S, microbatches=B, R=R,
                         **self._plan_kwargs())

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
        kwargs = self._plan_kwargs()
        kwargs["cap"] = None  # nothing is stashed without backwards
        candidates = list(range(min(B_train, max(rows, 1)), 0, -1))
        candidates += list(range(max(rows, 1) + 1, max(B_train, rows) + 1))
        last_error: GschedError | None = None
        for B in candidates:
            try:
                result = make_plan(self.schedule, workers=workers, stages=S, microbatches=B, R=R,
                                   forward_only=True, **kwargs)
            except ScheduleConfigError as exc:
                last_error = exc
                continue
            self._eval_plans[rows] = result
            return result
        raise StrategyConfigError(
            f"no forward-only plan fits an evaluation batch of {rows} rows: {last_error}"
        )
