"""``ScheduleArguments``: what a schedule is asked for, validated once, whatever the W. ``plan()``,
the CLI, ``ScheduleConfig`` and both front ends take the same frozen arguments, which refuse
everything wrong whatever the number of workers with a ``ScheduleConfigError`` naming the
argument, the value and a valid one. What needs W (R dividing W, a placement's multiples, a
list's length against S) ``plan()`` checks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from lightning_gsched.errors import ScheduleConfigError
from lightning_gsched.schedule import validate
from lightning_gsched.schedule.data_parallel import check_data_parallel
from lightning_gsched.schedule.library import LIBRARY, check_R, get_schedule
from lightning_gsched.schedule.orders import CapSpec, PriorityFn, check_order
from lightning_gsched.schedule.placements import PlacementFn

DEFAULT = "default"
CAP_WORDS = ("auto", DEFAULT, "none")  # "none" = uncapped, as None


@dataclass(frozen=True)
class ScheduleArguments:
    """:func:`~lightning_gsched.schedule.plan`'s schedule arguments, kept as given (a config
    round-trips them; later errors quote them as written) except the counts, made ints."""

    schedule: str | None = "fslpp"
    stages: int | None = None
    microbatches: int | None = None
    R: int | None = None
    order: str | PriorityFn | None = None
    cap: CapSpec = DEFAULT
    forward_cost: float | Sequence[float] = 1.0
    backward_cost: float | Sequence[float] = 2.0
    placement: PlacementFn | None = None
    priority: PriorityFn | None = None
    weight_cost: float | Sequence[float] | None = None
    split_backward: bool | None = None
    checkpoint_activations: bool | Sequence[bool] = False
    fetch_window: int | None = None
    ties: Mapping[int, Iterable[int]] | Iterable[Iterable[int]] | None = None
    data_parallel_size: int = 1
    data_parallel: str = "replicate"
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        validate.optional_callable("placement", self.placement, "w(s, b, d) -> (weights_worker, "
                                   "compute_worker)")
        validate.optional_callable("priority", self.priority, "n(s, b, d) -> sortable key")
        S = validate.optional_positive_int("stages", self.stages)
        validate.optional_positive_int("microbatches", self.microbatches, "8")
        R = validate.optional_positive_int("R", self.R, "2")
        if self.placement is None:
            if not isinstance(self.schedule, str):
                raise ScheduleConfigError(
                    f"schedule={self.schedule!r} is not valid: give a library name (one of "
                    f"{', '.join(LIBRARY)}) or placement= (and priority=) callables for a custom "
                    "schedule; e.g. schedule='fslpp'")
            check_R(get_schedule(self.schedule), R)
        else:
            if self.schedule is not None and not isinstance(self.schedule, str):
                raise ScheduleConfigError(
                    f"schedule={self.schedule!r} is not valid: with a custom placement it is only "
                    "a label (a str) or None; e.g. schedule='mine'")
            if self.stages is None or self.microbatches is None:
                raise ScheduleConfigError(
                    "a custom placement needs explicit stages= and microbatches= (the library's "
                    "defaults are per schedule); e.g. stages=4, microbatches=8")
        check_order(self.order)
        if self.order is not None and self.priority is not None:
            raise ScheduleConfigError(
                f"order={self.order!r} and priority={self.priority!r} both set the priority "
                "n(s, b, d); give only one of them")
        validate.cap_form(self.cap, CAP_WORDS)
        validate.costs("forward_cost", self.forward_cost, S)
        validate.costs("backward_cost", self.backward_cost, S)
        if self.weight_cost is not None:
            validate.costs("weight_cost", self.weight_cost, S)
        if self.split_backward is not None:
            validate.flag("split_backward", self.split_backward)
        validate.stage_flags("checkpoint_activations", self.checkpoint_activations, S)
        validate.optional_positive_int("fetch_window", self.fetch_window, "1")
        validate.ties(self.ties, S)  # kept as given: plan() checks it against the resolved S
        check_data_parallel(self.schedule if self.placement is None else None,
                            self.data_parallel_size, self.data_parallel)
        validate.positive_int("tensor_parallel_size", self.tensor_parallel_size, "2")
        for name in ("stages", "microbatches", "R", "fetch_window", "data_parallel_size",
                     "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, int(value))

    @classmethod
    def names(cls) -> tuple[str, ...]:  # in order: a front end picks its keywords by them
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def defaults(cls) -> dict[str, Any]:  # "auto" refuses any argument moved off its default
        return {f.name: f.default for f in dataclasses.fields(cls)}

    def replace(self, **changes: Any) -> ScheduleArguments:  # validated again
        return dataclasses.replace(self, **changes)
