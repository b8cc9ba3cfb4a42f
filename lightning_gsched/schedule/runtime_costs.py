"""What a step costs besides the stages' compute: messages, reductions and the runtime's own work.

Why a model of its own: the simulator orders jobs by compute costs alone, but the runtime that
executes the programs spends time on every message (the sender's and the receiver's CPU, the
latency of the link, the bytes at its bandwidth), on every all-reduce, on every compute job (the
executor's Python around a forward or backward: dispatch, stash, autograd set-up) and once per
step. :func:`~lightning_gsched.schedule.predict.predict_step_time` charges these to the workers
where the runtime spends them; the tuner ranks candidates with the same numbers, so a plan of
many small jobs and messages is no longer predicted as fast as its compute alone.

Pure numbers (no torch): ``runtime/calibration.py`` measures them on the job's own process group;
``gsched tune`` without a process group uses :data:`DEFAULT_COSTS` or its flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from lightning_gsched.errors import ScheduleConfigError


@dataclass(frozen=True)
class RuntimeCosts:
    """Seconds the runtime spends besides compute (all >= 0; bandwidths in bytes/second).

    Point-to-point message (activation, input-gradient, weight fetch, gradient hand-off):

    * ``send_cpu + bytes * send_cpu_per_byte``: the sender's CPU to issue it (gloo writes a
      message into the socket in the caller's thread when it can); the sending worker's clock
      advances by it at the ``SEND_*`` action, and the message leaves after the fixed
      ``send_cpu``: the bytes flow while the sender writes them;
    * ``latency + bytes / bandwidth``: in flight, from the sender's first byte to the last
      byte's arrival (the sender's per-byte CPU lies inside it; the receiver's is charged after
      it). Finite: :func:`~lightning_gsched.runtime.calibrate` fits it or refuses;
    * ``recv_cpu + bytes * recv_cpu_per_byte``: the receiver's CPU (posting the receive,
      reading the bytes, waiting, bookkeeping), charged where the message is consumed: after it
      has arrived, before the consuming job starts.

    All-reduce among ``n`` ranks of ``bytes``: ``allreduce_latency + 2 (n - 1) / n * bytes /
    allreduce_bandwidth`` (a ring moves each byte out and in ``(n - 1) / n`` times), started
    when every member has reached it, asynchronous to compute.

    ``job_cpu``: the executor's own work around each compute job (F, B or W), added to the
    job's profiled compute. ``step_cpu``: fixed work per step on every worker (starting and
    finishing the step), added once at the end.
    """

    latency: float = 0.0
    bandwidth: float = math.inf
    send_cpu: float = 0.0
    recv_cpu: float = 0.0
    send_cpu_per_byte: float = 0.0
    recv_cpu_per_byte: float = 0.0
    allreduce_latency: float = 0.0
    allreduce_bandwidth: float = math.inf
    job_cpu: float = 0.0
    step_cpu: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ScheduleConfigError(
                    f"RuntimeCosts.{f.name} must be a non-negative number, got {value!r}"
                )
        for name in ("bandwidth", "allreduce_bandwidth"):
            if getattr(self, name) == 0:
                raise ScheduleConfigError(
                    f"RuntimeCosts.{name} must be > 0 bytes/s (math.inf: bytes cost nothing)"
                )

    def send_time(self, nbytes: float) -> float:
        """The sender's CPU seconds for one message of ``nbytes``."""
        return self.send_cpu + nbytes * self.send_cpu_per_byte

    def recv_time(self, nbytes: float) -> float:
        """The receiver's CPU seconds for one message of ``nbytes``."""
        return self.recv_cpu + nbytes * self.recv_cpu_per_byte

    def message_time(self, nbytes: float) -> float:
        """Seconds one message of ``nbytes`` is in flight (sender and receiver CPU apart)."""
        return self.latency + nbytes / self.bandwidth

    def allreduce_time(self, nbytes: float, members: int) -> float:
        """Seconds of an all-reduce of ``nbytes`` among ``members`` ranks (0 for one rank)."""
        if members <= 1:
            return 0.0
        return self.allreduce_latency + 2 * (members - 1) / members * nbytes / self.allreduce_bandwidth

    def with_changes(self, **changes: float) -> "RuntimeCosts":
        """A copy with some fields replaced (``None`` values are ignored: flags not given)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def text(self) -> str:
        """One line for startup texts and benchmark notes."""
        def rate(v: float) -> str:
            return "inf" if math.isinf(v) else f"{v / 1e9:.2f} GB/s"
        return (f"message {self.latency * 1e6:.0f} us + bytes at {rate(self.bandwidth)}, "
                f"CPU send {self.send_cpu * 1e6:.0f} us + {self.send_cpu_per_byte * 1e9:.2f} "
                f"ns/B, receive {self.recv_cpu * 1e6:.0f} us + "
                f"{self.recv_cpu_per_byte * 1e9:.2f} ns/B; "
                f"all-reduce {self.allreduce_latency * 1e6:.0f} us + bytes at "
                f"{rate(self.allreduce_bandwidth)}; {self.job_cpu * 1e6:.0f} us per job, "
                f"{self.step_cpu * 1e3:.1f} ms per step")


ZERO_COSTS = RuntimeCosts()

# `gsched tune` without a process group (and GeneralParallel("auto") on one process): the
# figures runtime/calibration.py measured with gloo between two processes of one 2-core AMD EPYC
# VM (see docs/memory.md, "gsched tune"); pass measured ones for another machine.
DEFAULT_COSTS = RuntimeCosts(
    latency=60e-6, bandwidth=2.7e9, send_cpu=30e-6, recv_cpu=40e-6, send_cpu_per_byte=0.2e-9,
    recv_cpu_per_byte=0.2e-9,
    allreduce_latency=250e-6, allreduce_bandwidth=1.0e9, job_cpu=200e-6, step_cpu=1.1e-3,
)
