"""What a rank's program does, counted: the one record the planner predicts and the runtime meets.

The planner reads these numbers off the programs (:mod:`.metrics`); the runtime counts them as it
executes them (``RuntimeCounters`` extends this class), so a test compares them field by field. A
new op's counter is the ``counter`` (``tie_counter``) of its :class:`~.program.OpSpec` and a field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from lightning_gsched.schedule.program import OPS, Op


@dataclass
class ActionCounts:
    """Messages of one step on one rank (counted when a send is issued or a receive posted), its
    peak stash and its peak weight residency. ``peak_activations``: the most (stage, microbatch)
    stashes held at once. ``peak_resident_stages``: owned stages plus fetched ones, raised at
    ``FETCH_W`` and lowered at ``FREE_W`` (ties are not stages: they move ``tie_*`` counters)."""

    activation_recvs: int = 0
    activation_sends: int = 0
    input_grad_recvs: int = 0
    input_grad_sends: int = 0
    weight_fetches: int = 0
    weight_serves: int = 0
    grad_sends: int = 0
    grad_recvs: int = 0
    allreduces: int = 0
    tie_fetches: int = 0
    tie_serves: int = 0
    tie_grad_sends: int = 0
    tie_grad_recvs: int = 0
    tie_allreduces: int = 0
    peak_activations: int = 0
    owned_stages: int = 0
    peak_resident_stages: int = 0

    def count(self, op: Op, tie: bool = False) -> None:
        """Add one action of ``op`` (on a tie: ``tie``) to its counter, if any."""
        name = OPS[op].counter_of(tie)
        if name is not None:
            setattr(self, name, getattr(self, name) + 1)

    def planned(self) -> dict[str, int]:
        """The fields the planner predicts, by name (what a test compares)."""
        return {name: getattr(self, name) for name in PLANNED}

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


PLANNED: tuple[str, ...] = tuple(f.name for f in fields(ActionCounts))

# every counter an op names exists here (checked at import: a typo in the table fails at once)
_missing = {name for spec in OPS.values() for name in (spec.counter, spec.tie_counter)
            if name} - set(PLANNED)
if _missing:  # pragma: no cover - a programming error in the op table
    raise ImportError(f"op table names counters that ActionCounts lacks: {sorted(_missing)}")
