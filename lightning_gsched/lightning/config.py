"""What GeneralParallel was asked for, turned into plans for training and for evaluation.

Why a module of its own: the arguments are checked at construction (:meth:`ScheduleConfig.check`),
the training plan is built at ``Trainer.fit`` setup (pure Python, so what needs the device count,
such as R dividing it, fails on every rank before any process talks to another),
and forward-only plans are built on demand for each evaluation batch size. Both must describe the
same stage ownership, so they come from one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from lightning_gsched.errors import GschedError, ScheduleConfigError, StrategyConfigError
from lightning_gsched.schedule import plan as make_plan
from lightning_gsched.schedule.library import resolve_shape
from lightning_gsched.schedule.plan import DEFAULT, Plan, check_arguments


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
    _eval_plans: dict[int, Plan] = field(default_factory=dict, repr=False)

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
        """
        check_arguments(self.schedule, self.stages, self.microbatches, self.R, self.order,
                        self.cap, self.forward_cost, self.backward_cost,
                        self.placement, self.priority, self.weight_cost, self.split_backward,
                        self.checkpoint_activations, self.fetch_window)

    def resolved(self, workers: int) -> tuple[int, int, int | None]:
        """(S, B, R) for ``workers`` ranks, filling the library's defaults (``plan()``'s own
        resolution, :func:`~lightning_gsched.schedule.library.resolve_shape`)."""
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
            fetch_window=self.fetch_window,
        )

    def training_plan(self, workers: int) -> Plan:
        S, B, R = self.resolved(workers)
        return make_plan(self.schedule, workers=workers, stages=S, microbatches=B, R=R,
                         **self._plan_kwargs())

    def eval_plan(self, workers: int, rows: int) -> Plan:
        """A forward-only plan for a global evaluation batch of ``rows`` rows.

        Prefers the training B (microbatches may then be uneven), else the largest valid
        B <= rows; only if the schedule allows no B <= rows, the smallest valid one (some
        microbatches are then empty).
        """
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
