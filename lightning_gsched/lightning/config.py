"""What GeneralParallel was asked for, turned into plans for training and for evaluation.

Why a module of its own: the training plan is built at ``Trainer.fit`` setup (pure Python, so a
bad schedule, R or microbatch count fails on every rank before any process talks to another),
and forward-only plans are built on demand for each evaluation batch size. Both must describe the
same stage ownership, so they come from one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from lightning_gsched.errors import GschedError, ScheduleConfigError, StrategyConfigError
from lightning_gsched.schedule import plan as make_plan
from lightning_gsched.schedule.library import LIBRARY, get_schedule, resolve_R
from lightning_gsched.schedule.plan import Plan

UNCAPPED = "none"


@dataclass
class ScheduleConfig:
    """The schedule part of GeneralParallel's arguments (see its docstring)."""

    schedule: str | None = "fslpp"
    R: int | None = None
    microbatches: int | None = None
    stages: int | None = None
    order: str | Callable | None = None
    cap: int | Sequence[int] | str | None = None
    placement: Callable | None = None
    priority: Callable | None = None
    forward_cost: float | Sequence[float] = 1.0
    backward_cost: float | Sequence[float] = 2.0
    _eval_plans: dict[int, Plan] = field(default_factory=dict, repr=False)

    def check_name(self) -> None:
        """Fail at construction for an unknown library name (close matches in the message)."""
        if self.placement is None:
            if self.schedule is None:
                raise StrategyConfigError(
                    "GeneralParallel needs a schedule name (one of "
                    f"{', '.join(LIBRARY)}) or placement= (and priority=) callables"
                )
            get_schedule(self.schedule)
        elif self.stages is None or self.microbatches is None:
            raise StrategyConfigError(
                "a custom placement= needs explicit stages= and microbatches= "
                "(the library defaults are per schedule)"
            )

    def resolved(self, workers: int) -> tuple[int, int, int | None]:
        """(S, B, R) for ``workers`` ranks, filling the library's defaults."""
        if self.placement is not None:
            return int(self.stages), int(self.microbatches), self.R  # type: ignore[arg-type]
        spec = get_schedule(self.schedule)  # type: ignore[arg-type]
        R = resolve_R(spec, workers, self.R)
        if R is not None and workers % R:
            raise ScheduleConfigError(
                f"R={R} does not divide the {workers} devices (num_nodes x devices); choose R "
                f"among {[r for r in range(1, workers + 1) if workers % r == 0]}"
            )
        S = self.stages if self.stages is not None else spec.stages(workers, R or 1)
        B = self.microbatches if self.microbatches is not None else spec.micro(workers, R or 1)
        return S, B, R

    def _plan_kwargs(self) -> dict[str, Any]:
        cap: Any = "default" if self.cap is None else (None if self.cap == UNCAPPED else self.cap)
        return dict(
            order=self.order, cap=cap, placement=self.placement, priority=self.priority,
            forward_cost=self.forward_cost, backward_cost=self.backward_cost,
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
