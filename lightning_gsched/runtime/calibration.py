"""Measure the planner's :class:`RuntimeCosts` on the job's own process group, in about a second.

Why: what a message, an all-reduce or the executor's work around a job costs depends on the
machine, the backend and the load, so the planner predicts with numbers measured where the job
runs. Every rank takes part and returns the same numbers (averaged with one all-reduce), so ranks
plan alike. Measured, with bare single-tensor messages as the runtime sends activations:

* ping-pong between rank pairs (0, 1), (2, 3), ... up to 16 MiB (so the per-byte slope stands
  above the noise): half the round trip is one message, fitted to ``a + bytes * wall_per_byte``;
* streams of messages of two sizes, receives posted first: process CPU time (every thread, gloo's
  included: on a CPU job they take cycles from compute) per ``isend`` + wait and per ``irecv`` +
  wait, fitted to ``cpu + bytes * cpu_per_byte`` on each end. ``latency`` is ``a`` less both
  ends' fixed CPU; ``bandwidth`` the ping-pong slope less the *receiver's* per-byte CPU, which
  the model charges after the flight, not the sender's, which overlaps the flight (subtracting
  both came out negative in most runs). So one isolated message costs exactly the measured line;
  a slope within noise after retries raises :class:`~lightning_gsched.errors.CalibrationError`;
* all-reduces of a few sizes: ``allreduce_latency`` (the smallest size's time) and
  ``allreduce_bandwidth`` (the larger sizes' slope above it, in ring bytes);
* the executor on a trivial one-layer stage (data-parallel programs of k = 1 and 8 forwards and
  backwards per rank, beside the layer's forward+backward timed alone): ``job_cpu`` is the step's
  growth per job beyond that compute, ``step_cpu`` its fixed part beyond the all-reduce. It needs
  no model, runs before anything is planned (the tuner needs it), and separates the runtime's own
  work from compute exactly; work growing with a real model is the stage profile's.
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import Work

from lightning_gsched.errors import CalibrationError, RuntimeConfigError
from lightning_gsched.schedule.runtime_costs import RuntimeCosts

PING_BYTES = (4, 1 << 18, 1 << 22, 1 << 24)
# up to 4 MiB: a gradient all-reduce is often many MiB, and a per-byte cost fitted from 1 MiB
# (where the fixed cost still weighs) came out several times too high
ALLREDUCE_BYTES = (4, 1 << 20, 1 << 22)
STREAM_BYTES = (4, 1 << 18)
STREAM = 16  # messages per CPU sample
ATTEMPTS = 3  # measurements of the message and all-reduce costs before refusing to fit them


def _fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``seconds = a + bytes * b``; both clamped at >= 0."""
    mx, my = (sum(column) / len(points) for column in zip(*points, strict=True))
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = max(sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0, 0.0)
    return max(my - b * mx, 0.0), b


def _medians(runs: Sequence[Callable[[], Any]], warmups: int, repeats: int,
             clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """The median seconds (by ``clock``) of each of ``runs``, which take turns within every
    repeat, so a burst of load from other processes lands on all alike instead of bending a fit."""
    for _ in range(warmups):  # connection set-up, allocation, a peer still starting
        for run in runs:
            run()
    samples: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, column in zip(runs, samples, strict=True):
            start = clock()
            run()
            column.append(clock() - start)
    return [statistics.median(column) for column in samples]


def _started(work: Work | None) -> Work:
    assert work is not None  # None only on a rank outside the group
    return work


def _buffers(sizes: Sequence[int]) -> list[torch.Tensor]:
    return [torch.zeros(max(1, nbytes // 4)) for nbytes in sizes]


def _ping_pong(peer: int, first: bool, sizes: Sequence[int], group: Any, repeats: int
               ) -> list[float]:
    """One-way seconds of one message of each size: half the median round trip."""

    def round_trip(buf: torch.Tensor) -> None:
        for sending in (first, not first):
            _started((dist.isend if sending else dist.irecv)(buf, peer, group=group)).wait()

    return [t / 2 for t in _medians([partial(round_trip, b) for b in _buffers(sizes)], 3, repeats)]


def _stream_cpu(peer: int, sender: bool, nbytes: int, group: Any, repeats: int) -> float:
    """Process CPU seconds per message of ``nbytes`` on this side of a stream of ``STREAM``."""
    bufs = _buffers([nbytes] * STREAM)
    flag = torch.zeros(1)

    def stream() -> None:
        if sender:
            _started(dist.irecv(flag, peer, group=group)).wait()  # the receiver has posted all
            works = [_started(dist.isend(b, peer, group=group)) for b in bufs]
        else:
            works = [_started(dist.irecv(b, peer, group=group)) for b in bufs]
            _started(dist.isend(flag, peer, group=group)).wait()
        for w in works:
            w.wait()

    # the handshake message's CPU is in the sample too: a small share of STREAM messages
    return _medians([stream], 1, repeats, time.process_time)[0] / STREAM


def fit_allreduce(times: Sequence[float], world: int) -> tuple[float, float]:
    """(latency, seconds per ring byte) from the all-reduce times of :data:`ALLREDUCE_BYTES`: the
    smallest size's time, and the larger sizes' least-squares slope through it (one line's
    intercept would follow the noisy large sizes, even below zero: free all-reduces)."""
    ring = 2 * (world - 1) / world
    latency = times[0]
    extra = [(ring * (nbytes - ALLREDUCE_BYTES[0]), t - latency)
             for nbytes, t in zip(ALLREDUCE_BYTES[1:], times[1:], strict=True)]
    sxx = sum(x * x for x, _ in extra)
    per_byte = max(sum(x * y for x, y in extra) / sxx, 0.0) if sxx else 0.0
    return latency, per_byte


def _executor_costs(world: int, repeats: int) -> tuple[float, float]:
    """(job_cpu, step_cpu) from the executor on a trivial stage; see the module docstring."""
    from lightning_gsched.runtime.executor import ProgramExecutor
    from lightning_gsched.schedule.plan import plan

    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    # one forward + backward, outside the executor
    compute = _medians([lambda: layer(x).sum().backward()], 1, repeats)[0]
    steps = {}
    for k in (1, 8):
        programs = plan("ddp", workers=world, microbatches=world * k).programs
        executor = ProgramExecutor([layer], programs, sync_weights=False)
        inputs: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {
            b: ((x,), {}) for b in executor.first_stage_micros}
        try:
            run = partial(executor.step, inputs, lambda out, b: out.sum())
            steps[k] = _medians([run], 1, repeats)[0]
        finally:
            executor.close()
    per_micro = (steps[8] - steps[1]) / 7  # one F + one B in the executor
    return max(per_micro - compute, 0.0) / 2, max(steps[1] - per_micro, 0.0)


def _measure_messages(group: Any, repeats: int) -> list[float]:
    """The raw figures (collective): [ping one-way per size..., send cpu, per byte, recv cpu,
    per byte, all-reduce per size...], averaged over the pairs (pair figures) or the ranks
    (all-reduces), so every rank holds the same list and takes the same fit-or-refuse decision."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    peer = rank ^ 1
    n_pair = len(PING_BYTES) + 4
    values = [0.0] * (n_pair + 1 + len(ALLREDUCE_BYTES))
    if peer < world:
        first = rank < peer
        values[:len(PING_BYTES)] = _ping_pong(peer, first, PING_BYTES, group, 2 * repeats)
        sends, recvs = [], []  # ``first`` sends first, then both swap roles: both ends measured
        for nbytes in STREAM_BYTES:
            mine = _stream_cpu(peer, first, nbytes, group, repeats)
            theirs = _stream_cpu(peer, not first, nbytes, group, repeats)
            sends.append((float(nbytes), mine if first else theirs))
            recvs.append((float(nbytes), theirs if first else mine))
        values[len(PING_BYTES):n_pair] = [*_fit(sends), *_fit(recvs)]
        values[n_pair] = 1.0
    # median seconds of one all-reduce of each size (warm-up: gloo sets up buffers per size)
    values[n_pair + 1:] = _medians([partial(dist.all_reduce, buf, group=group)
                                    for buf in _buffers(ALLREDUCE_BYTES)], 1, 2 * repeats)
    box = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(box, group=group)
    values = box.tolist()
    pairs = values[n_pair]
    return [v / (pairs if i < n_pair else world) for i, v in enumerate(values) if i != n_pair]


def fit_message_costs(values: Sequence[float], world: int) -> RuntimeCosts:
    """:func:`_measure_messages`' figures as :class:`RuntimeCosts`, or :class:`CalibrationError`."""
    n_ping = len(PING_BYTES)
    ping = values[:n_ping]
    send, send_per_byte, recv, recv_per_byte = values[n_ping:n_ping + 4]
    _, wall_per_byte = _fit([(float(b), t) for b, t in zip(PING_BYTES, ping, strict=True)])
    # the fixed part from the two smallest sizes (small per-byte share), the least disturbed (load
    # only adds time): a least-squares intercept follows the large sizes, noisier than it
    a = min(t - b * wall_per_byte for b, t in zip(PING_BYTES[:2], ping[:2], strict=True))
    link_per_byte = wall_per_byte - recv_per_byte
    if link_per_byte <= 0:
        raise CalibrationError(
            f"calibrate(): the point-to-point bandwidth cannot be fitted: one-way times "
            f"{', '.join(f'{t * 1e6:.0f} us' for t in ping)} for "
            f"{', '.join(str(b) for b in PING_BYTES)} bytes give {wall_per_byte * 1e9:.3f} ns "
            f"per byte, not above the receiver's CPU per byte ({recv_per_byte * 1e9:.3f} ns); "
            "the machine was too busy to measure it. Rerun on a quieter machine, raise "
            "repeats, or pass RuntimeCosts(bandwidth=...) yourself")
    ar_latency, ar_per_byte = fit_allreduce(values[n_ping + 4:], world)
    if ar_per_byte <= 0:
        raise CalibrationError(
            f"calibrate(): the all-reduce bandwidth cannot be fitted: "
            f"{', '.join(f'{t * 1e6:.0f} us' for t in values[n_ping + 4:])} for "
            f"{', '.join(str(b) for b in ALLREDUCE_BYTES)} bytes do not grow with size; "
            "rerun on a quieter machine, raise repeats, or pass "
            "RuntimeCosts(allreduce_bandwidth=...) yourself")
    return RuntimeCosts(
        # the fixed part of one message beyond both ends' fixed CPU (clamped: CPU measured in
        # all threads may exceed the wall time it overlaps; a latency of 0 is still finite)
        latency=max(a - send - recv, 0.0), bandwidth=1 / link_per_byte,
        send_cpu=send, recv_cpu=recv, send_cpu_per_byte=send_per_byte,
        recv_cpu_per_byte=recv_per_byte, allreduce_latency=ar_latency,
        allreduce_bandwidth=1 / ar_per_byte)


def calibrate(group: Any = None, repeats: int = 5, executor: bool = True) -> RuntimeCosts:
    """Measure :class:`RuntimeCosts` on ``group`` (default: the whole job); collective. Every
    rank returns the same finite costs, or raises :class:`CalibrationError` alike (decided on
    figures averaged over ranks) when the message or all-reduce figures do not fit after
    :data:`ATTEMPTS` measurements. ``executor``: also measure ``job_cpu``/``step_cpu`` (a group
    of every rank only; builds one executor's process groups twice), all that a one-rank job
    measures. A group made with a timeout (the strategies' control group: ``step_timeout``)
    bounds every wait of the measurement by it."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeConfigError(
            "calibrate() needs torch.distributed initialized on every rank "
            "(dist.init_process_group); without a job, use schedule.runtime_costs.DEFAULT_COSTS")
    world = dist.get_world_size(group)
    messages = RuntimeCosts()
    for attempt in range(ATTEMPTS if world > 1 else 0):  # one rank: no messages
        try:
            messages = fit_message_costs(_measure_messages(group, repeats), world)
            break
        except CalibrationError:
            if attempt == ATTEMPTS - 1:
                raise
    job = step = 0.0
    if executor and world == dist.get_world_size():
        box = torch.tensor(_executor_costs(world, repeats), dtype=torch.float64)
        if world > 1:
            dist.all_reduce(box, group=group)
        job, step = (v / world for v in box.tolist())
    return messages.with_changes(job_cpu=job, step_cpu=step)
