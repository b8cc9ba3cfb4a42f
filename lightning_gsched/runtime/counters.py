"""What one rank actually did in one step, counted as it happened.

The first twelve fields have the names and meaning of the planner's per-worker metrics
(:class:`lightning_gsched.schedule.metrics.WorkerMetrics`, read off the same programs by
``program_counts``), so a test can compare them field by field: equality shows the runtime
executed exactly the planned communication and held exactly the planned memory. The other fields
are facts the planner does not model (bytes, tied-parameter and running-statistics reductions).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar


@dataclass
class RuntimeCounters:
    """Counters of one step on one rank.

    Message counts are incremented when the send is issued or the receive is posted.
    ``peak_activations`` is the most stashed (forward done, backward pending) microbatch-stages;
    ``peak_resident_stages`` counts owned stages plus fetched ones, raised when a fetch is posted
    and lowered when it is freed (exactly as the planner counts). Bytes are those of
    point-to-point messages (headers included); all-reduces are counted separately.
    """

    activation_recvs: int = 0
    activation_sends: int = 0
    input_grad_recvs: int = 0
    input_grad_sends: int = 0
    weight_fetches: int = 0
    weight_serves: int = 0
    grad_sends: int = 0
    grad_recvs: int = 0
    allreduces: int = 0
    peak_activations: int = 0
    owned_stages: int = 0
    peak_resident_stages: int = 0
    # not planned, measured
    bytes_sent: int = 0
    bytes_received: int = 0
    allreduce_bytes: int = 0
    shared_allreduces: int = 0  # end-of-step all-reduce of tied-parameter gradients
    shared_allreduce_bytes: int = 0
    stats_allreduces: int = 0  # end-of-step all-reduce of running statistics (BatchNorm)
    stats_allreduce_bytes: int = 0
    peak_resident_param_bytes: int = 0  # stage buffers (owned + fetched), tied params excluded

    PLANNED: ClassVar[tuple[str, ...]] = (
        "activation_recvs",
        "activation_sends",
        "input_grad_recvs",
        "input_grad_sends",
        "weight_fetches",
        "weight_serves",
        "grad_sends",
        "grad_recvs",
        "allreduces",
        "peak_activations",
        "owned_stages",
        "peak_resident_stages",
    )

    def planned(self) -> dict[str, int]:
        """The fields the planner predicts, by the planner's names."""
        return {name: getattr(self, name) for name in self.PLANNED}

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
