"""What a step costs besides the stages' compute: messages, reductions and the runtime's own work,
which :func:`~.predict.predict_step_time` charges and the tuner ranks by. Pure numbers:
``runtime/calibration.py`` measures them on the job's process group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from lightning_gsched.errors import ScheduleConfigError


@dataclass(frozen=True)
class RuntimeCosts:
    """Seconds the runtime spends besides compute (all >= 0; bandwidths in bytes/second).

    A point-to-point message costs its sender ``send_time`` (gloo writes into the socket in the
    caller's thread; the bytes flow while it writes), is in flight ``message_time`` from the first
    byte's departure to the last one's arrival (finite: ``runtime.calibrate`` fits it or refuses),
    and costs its receiver ``recv_time`` where it is consumed. An all-reduce among n ranks is a
    ring's (each byte out and in ``(n - 1) / n`` times). ``job_cpu``: the executor's own work
    around each compute job; ``step_cpu``: fixed work per step on every worker."""

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
                    f"RuntimeCosts.{f.name} must be a non-negative number, got {value!r}")
        for name in ("bandwidth", "allreduce_bandwidth"):
            if getattr(self, name) == 0:
                raise ScheduleConfigError(
                    f"RuntimeCosts.{name} must be > 0 bytes/s (math.inf: bytes cost nothing)")

    def send_time(self, nbytes: float) -> float:  # the sender's CPU
        return self.send_cpu + nbytes * self.send_cpu_per_byte

    def recv_time(self, nbytes: float) -> float:  # the receiver's CPU
        return self.recv_cpu + nbytes * self.recv_cpu_per_byte

    def message_time(self, nbytes: float) -> float:  # in flight
        return self.latency + nbytes / self.bandwidth

    def allreduce_time(self, nbytes: float, members: int) -> float:
        if members <= 1:
            return 0.0
        return self.allreduce_latency + 2 * (members - 1) / members * nbytes / self.allreduce_bandwidth

    def with_changes(self, **changes: float) -> RuntimeCosts:
        """A copy with the fields not ``None`` (flags given) replaced."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def text(self) -> str:  # one line for startup texts and benchmark notes
        def rate(v: float) -> str:
            return "inf" if math.isinf(v) else f"{v / 1e9:.2f} GB/s"
        return (f"message {self.latency * 1e6:.0f} us + bytes at {rate(self.bandwidth)}, "
                f"CPU send {self.send_cpu * 1e6:.0f} us + {self.send_cpu_per_byte * 1e9:.2f} "
                f"ns/B, receive {self.recv_cpu * 1e6:.0f} us + "
                f"{self.recv_cpu_per_byte * 1e9:.2f} ns/B; "
                f"all-reduce {self.allreduce_latency * 1e6:.0f} us + bytes at "
                f"{rate(self.allreduce_bandwidth)}; {self.job_cpu * 1e6:.0f} us per job, "
                f"{self.step_cpu * 1e3:.1f} ms per step")


# `gsched tune` without a process group (and GeneralParallel("auto") on one process): what
# runtime/calibration.py measured with gloo on one machine (docs/memory.md, "gsched tune").
DEFAULT_COSTS = RuntimeCosts(
    latency=60e-6, bandwidth=2.7e9, send_cpu=30e-6, recv_cpu=40e-6, send_cpu_per_byte=0.2e-9,
    recv_cpu_per_byte=0.2e-9, allreduce_latency=250e-6, allreduce_bandwidth=1.0e9,
    job_cpu=200e-6, step_cpu=1.1e-3)
