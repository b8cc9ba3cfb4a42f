"""The order in which a model is traced, and which of the successful traces is kept.

Real models rarely trace with plain torch.fx: transformers' mask code branches on sizes and
values, Lightning's demo builds masks with ``torch.ones(t, t)``, litgpt compares ``T`` with an
int. Two modes, each retried with *automatic leaves* (a submodule whose forward cannot be
traced runs whole, with real tensors, and the trace is repeated):

1. **symbolic**: shapes stay symbolic, so the stages accept any input shape. Kept unless the
   root forward fails, or an automatic leaf is *heavy*: it holds more parameters than one stage
   may (:func:`leaf_limit`), so no split of it can be balanced.
2. **static shapes** (:mod:`.concrete`): sizes of the example are baked in, which lets the tracer
   enter code that computes with sizes (and code that only branches on them). Tried when the
   symbolic trace fails or is too coarse, unless ``static_shapes=False``; kept if it succeeds
   with a lighter heaviest automatic leaf than the symbolic trace.

``static_shapes=True`` runs only the second mode, ``False`` only the first. A split that is still
unbalanced because of a heavy leaf is reported by :mod:`.balance_check` at partition time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from torch import nn

from lightning_gsched.partition.trace_errors import failure_site, failure_summary

# A stage may hold up to this many times an even share of the parameters (total / num_stages)
# before the split counts as unbalanced; an automatic leaf above it makes that unavoidable.
STAGE_SHARE_LIMIT = 1.5


def leaf_limit(num_stages: int | None) -> float | None:
    """Largest fraction of the parameters one leaf may hold and still allow a balanced split."""
    if num_stages is None or num_stages < 2:
        return None
    return STAGE_SHARE_LIMIT / num_stages


def parameter_shares(module: nn.Module, fqns: Sequence[str]) -> dict[str, float]:
    """Fraction of ``module``'s distinct parameter elements held by each submodule in ``fqns``."""
    total = sum(p.numel() for p in module.parameters())
    if total == 0:
        return {fqn: 0.0 for fqn in fqns}
    return {
        fqn: sum(p.numel() for p in module.get_submodule(fqn).parameters()) / total
        for fqn in fqns
    }


@dataclass
class Attempt:
    """One tracing mode, after retrying with automatic leaves: its trace or what stopped it."""

    static: bool
    auto_leaves: dict[str, str] = field(default_factory=dict)  # fqn -> why (with file:line)
    result: Any = None  # whatever the trace function returned, None if it failed
    failure: BaseException | None = None
    shares: dict[str, float] = field(default_factory=dict)  # auto leaf -> parameter fraction

    @property
    def mode(self) -> str:
        return "static shapes" if self.static else "symbolic"

    @property
    def succeeded(self) -> bool:
        return self.failure is None

    @property
    def heaviest_share(self) -> float:
        return max(self.shares.values(), default=0.0)

    def describe(self) -> str:
        """One line for the report and warnings: how this mode ended."""
        if self.failure is not None:
            return f"{self.mode}: failed, {failure_summary(self.failure)}"
        if not self.auto_leaves:
            return f"{self.mode}: traced everything"
        kept = ", ".join(
            f"{fqn!r} ({self.shares.get(fqn, 0.0):.0%} of parameters)" for fqn in self.auto_leaves
        )
        return f"{self.mode}: traced, keeping whole {kept}"


def run_attempt(
    trace: Callable[[frozenset[str]], Any], module: nn.Module, static: bool, auto_leaf: bool
) -> Attempt:
    """Trace with ``trace(auto_leaf_names)``, making each failing submodule a leaf and retrying.

    Stops at a failure in the root forward, or in a submodule when ``auto_leaf`` is False (or
    when making it a leaf did not help).
    """
    attempt = Attempt(static=static)
    while True:
        try:
            attempt.result = trace(frozenset(attempt.auto_leaves))
            break
        except Exception as exc:  # noqa: BLE001 - any failure while tracing is a trace failure
            path, cls = failure_site(exc)
            if auto_leaf and path and path not in attempt.auto_leaves:
                name = cls.__name__ if cls is not None else "?"
                attempt.auto_leaves[path] = f"{name}: {failure_summary(exc)}"
                continue
            attempt.failure = exc
            break
    attempt.shares = parameter_shares(module, list(attempt.auto_leaves))
    return attempt


def needs_static(symbolic: Attempt, limit: float | None) -> bool:
    """Whether the static-shape mode is worth trying after the symbolic attempt."""
    if not symbolic.succeeded:
        return True
    return limit is not None and symbolic.heaviest_share > limit


def choose(attempts: Sequence[Attempt]) -> Attempt | None:
    """The first successful attempt, unless a later one keeps a strictly lighter leaf whole."""
    best: Attempt | None = None
    for attempt in attempts:
        if not attempt.succeeded:
            continue
        if best is None or attempt.heaviest_share < best.heaviest_share:
            best = attempt
    return best
