"""``profile_costs=True``: a named schedule planned with its stages' measured seconds.

Why: the planner's greedy orders jobs by their costs. At a library schedule's default costs
(every stage alike) jobs look interchangeable that are not: on the benchmark GPT the first
stage's weight gradient (the embedding's) costs twice the others' and its input gradient
nothing, and zbv planned at the defaults ran about 2.4% slower than planned at the measured
costs, the order differing only in its warm-up (docs/benchmarks.md, "where zbv's gap is").
``schedule="auto"`` always plans with the costs it profiles; this gives a named schedule the same.

Why rank 0 measures alone: timings differ between ranks and runs, and ranks planning from
different figures could order their jobs differently and wait for messages that never come.
Rank 0 times each stage on the first microbatch (:func:`~lightning_gsched.measure.profile_stages`,
with B and W apart where the plan splits backwards, as the runtime runs them) and one broadcast
gives every rank the same seconds, or the same error.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from lightning_gsched.engine.control import Collective
from lightning_gsched.engine.rank_zero import RankZeroFailure, decided_by_rank_zero
from lightning_gsched.errors import StrategyConfigError
from lightning_gsched.measure import profile_stages


@contextmanager
def profiling(module: nn.Module,
              forward_context: Callable[[], AbstractContextManager[Any]] | None
              ) -> Iterator[None]:
    """The user's forward context around a profile of ``module``'s stages; the ``.grad`` their
    backwards touch given back (the tuner's profiles and :func:`profiled_costs` alike)."""
    grads = [(p, p.grad) for p in module.parameters()]
    try:
        with forward_context() if forward_context is not None else nullcontext():
            yield
    finally:
        for p, grad in grads:
            p.grad = grad


def profiled_costs(module: nn.Module, stages: Sequence[nn.Module], args: tuple[Any, ...],
                   kwargs: dict[str, Any], loss_fn: Callable[[Any], torch.Tensor] | None, *,
                   split_backward: bool, rank: int, world_size: int, group: Any,
                   collective: Collective,
                   forward_context: Callable[[], AbstractContextManager[Any]] | None = None
                   ) -> dict[str, list[float]]:
    """Every rank's ``forward_cost``, ``backward_cost`` (and ``weight_cost`` with
    ``split_backward``) in seconds per microbatch: rank 0 times ``stages`` on ``args`` /
    ``kwargs`` (the loss ``loss_fn`` on the last), the others receive its figures
    (collective, through the engine's ``collective(what, call)``)."""

    def timed() -> dict[str, list[float]]:
        with profiling(module, forward_context):
            times = profile_stages(stages, args, kwargs, loss_fn, split_backward=split_backward)
        return {name: [float(v) for v in values] for name, values in times.plan_costs().items()}

    def failure(failed: RankZeroFailure) -> StrategyConfigError:
        return StrategyConfigError(
            f"profile_costs=True: rank 0 could not time the stages on the first microbatch "
            f"({failed.text}); pass forward_cost/backward_cost/weight_cost yourself, or drop "
            "profile_costs")

    return decided_by_rank_zero("the profiled costs' broadcast", timed, rank=rank,
                                world_size=world_size, group=group, collective=collective,
                                failure=failure)


def costs_text(costs: dict[str, list[float]]) -> str:
    """The startup line saying which costs the plan was made with (milliseconds)."""
    parts = [f"{name.removesuffix('_cost')} [{', '.join(f'{1e3 * v:.2f}' for v in values)}]"
             for name, values in costs.items()]
    return ("planned with the stages' costs timed on rank 0 (profile_costs=True), ms per "
            "microbatch: " + "; ".join(parts))
