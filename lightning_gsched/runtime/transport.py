"""Messages of a program: pytrees on ``p2p``, flat buffers on ``weights`` and ``grads``.

Sends never block (the programs were proven deadlock-free under that model): every send is an
``isend`` whose buffer :class:`SendReleaser` keeps until it completed. Receives are *posted* where
the program says and waited for where they are consumed.

A pytree message (activation or input-gradient) travels as its distinct non-empty tensors, one
message each, as they are (no header, pickling or copy), as torch.distributed.pipelining does
after shape inference. So the receiver must know the message's *spec* (:class:`wire.Spec`) when
it posts the receives (on gloo the bytes only flow once the receive is posted; on NCCL reading a
header would cost a sync). The programs send the same messages every step, with shapes that
follow from the step's *signature*, which every rank computes alike (by default the inputs'
shapes). Both ends remember, per (programs, signature), the specs of the last completed step
(least recently used dropped alike everywhere). A step is then *fast* (a known signature): the
receiver posts the tensor receives at the program's receive post; the sender checks its spec
against the remembered one and raises :class:`MessageShapeError` if it differs (a data-dependent
shape cannot be told to a receiver whose buffers are posted). Or it is *described* (a new
signature, or ``transport="described"``): each message is an ``int64 [meta_len]`` header, the
pickled spec, then the tensors; the receiver posts nothing ahead, a consumer's wait takes the
peer's pending messages in program order, the sender's. Empty tensors travel as nothing. Weights
and gradient reductions have sizes both ends know.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch

from lightning_gsched.errors import MessageShapeError, RuntimeConfigError, RuntimeFault
from lightning_gsched.runtime import wire
from lightning_gsched.runtime.channels import Channels
from lightning_gsched.runtime.counters import RuntimeCounters
from lightning_gsched.runtime.faults import Waiter
from lightning_gsched.schedule.program import Action

TRANSPORTS = ("auto", "described")
SIGNATURES_KEPT = 16  # (programs, signature) pairs remembered; older ones are described again
# a send's wait, raising a RuntimeFault that names the message (faults.Waiter.wait)
WaitFn = Callable[[Any, str], None]


@dataclass(eq=False)  # compared by identity, as any handle
class IncomingPytree:
    """A posted pytree receive: its tensors' receives are posted (fast path), or it waits in its
    peer's queue until a consumer takes it (described path)."""

    peer: int
    label: str  # "'RECV_ACT s0 b1 <-0' (action 2)"
    spec: wire.Spec | None = None
    buffers: list[torch.Tensor] | None = None
    works: list[Any] = field(default_factory=list)


# (peer, "in" | "out") -> the specs of its messages in this step, in order
_Specs = dict[tuple[int, str], list[wire.Spec]]


class Transport:
    """Sends and receives of one executor; counts messages' bytes into ``counters``. The specs of
    the last completed step are kept per (programs, signature), per (peer, direction), in message
    order (``known``): after :meth:`begin_step`, :attr:`fast` tells whether there are some (then
    ``_expected`` gives each message's spec); otherwise the step notes the specs in ``now`` and
    :meth:`end_step` makes them the expectation."""

    def __init__(self, channels: Channels, waiter: Waiter, device: torch.device,
                 transport: str = "auto") -> None:
        self.channels = channels
        self.waiter = waiter
        self.device = device
        self.rank = channels.rank
        self.described = transport == "described"
        self.counters = RuntimeCounters()
        # gloo's (CPU) send handles complete only in wait(): a thread waits for them
        self.threaded_sends = device.type == "cpu"
        self.sends = SendReleaser(waiter.wait, waiter.timeout, self.threaded_sends)
        self._pending: dict[int, deque[IncomingPytree]] = defaultdict(deque)
        # (id(programs), signature) -> (programs kept alive so their id is not reused, specs)
        self.known: OrderedDict[tuple[int, Hashable], tuple[Any, _Specs]] = OrderedDict()
        self.key: tuple[int, Hashable] = (0, None)
        self.programs: Any = None
        self.expect: _Specs | None = None
        self.now: _Specs = defaultdict(list)
        self.count: dict[tuple[int, str], int] = defaultdict(int)
        self.described_messages = 0  # messages sent or received on the described path

    def begin_step(self, programs: Any, signature: Hashable) -> None:
        """A run of ``programs`` with ``signature`` starts (the same on every rank)."""
        self.key = (id(programs), signature)
        self.programs = programs
        entry = None if self.described else self.known.get(self.key)
        if entry is not None:
            self.known.move_to_end(self.key)
        self.expect = None if entry is None else entry[1]
        self.now = defaultdict(list)
        self.count = defaultdict(int)

    def end_step(self) -> None:
        """The run completed on this rank: a described run's specs become the expectation."""
        if self.fast or self.described:
            return
        self.known[self.key] = (self.programs, dict(self.now))
        self.known.move_to_end(self.key)
        while len(self.known) > SIGNATURES_KEPT:
            self.known.popitem(last=False)

    @property
    def fast(self) -> bool:
        """Whether this step's pytrees travel without their spec."""
        return self.expect is not None

    def _expected(self, peer: int, direction: str) -> wire.Spec:
        """Fast path: the spec of the next message to/from ``peer``; advances the position."""
        assert self.expect is not None
        position = self.count[(peer, direction)]
        self.count[(peer, direction)] = position + 1
        specs = self.expect.get((peer, direction), [])
        if position >= len(specs):
            raise RuntimeConfigError(
                f"message {position} {'to' if direction == 'out' else 'from'} rank {peer} was "
                f"not in the last step of these programs ({len(specs)} messages); the programs "
                "changed under the executor. Plan once and pass the same programs every step.")
        return specs[position]

    def send_pytree(self, parts: wire.Split, peer: int, label: str, what: str = "message") -> None:
        spec = wire.spec_of(parts)
        if self.fast:
            expected = self._expected(peer, "out")
            if spec != expected:
                raise self._changed(spec, expected, peer, label, what)
        else:
            self.now[(peer, "out")].append(spec)
            meta = wire.encode_spec(spec)
            header = torch.tensor([len(meta)], dtype=torch.int64, device=self.device)
            body = torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.device)
            self._isend(header, peer, "p2p", label)
            self._isend(body, peer, "p2p", label)
            self.counters.bytes_sent += 8 + len(meta)
            self.described_messages += 1
        for t in parts.tensors:
            if t.numel():
                self._isend(wire.wire_tensor(t, self.device), peer, "p2p", label)
        self.counters.bytes_sent += spec.nbytes

    def post_pytree(self, peer: int, label: str) -> IncomingPytree:
        message = IncomingPytree(peer, label)
        if self.fast:  # the tensors flow while this rank computes
            self._post_tensors(message, self._expected(peer, "in"))
        else:
            self._pending[peer].append(message)
        return message

    def wait_pytree(self, message: IncomingPytree) -> tuple[Any, list[torch.Tensor]]:
        """The received pytree and its tensors (fresh leaves, requiring grad as the sender's)."""
        queue = self._pending[message.peer]
        while message.spec is None:
            self._take(queue.popleft())
        for work in message.works:
            self.waiter.wait(work, message.label)
        assert message.buffers is not None
        self.counters.bytes_received += message.spec.nbytes
        value, leaves = wire.received(message.spec, message.buffers)
        message.buffers, message.works = None, []
        return value, leaves

    def _post_tensors(self, message: IncomingPytree, spec: wire.Spec) -> None:
        message.spec = spec
        message.buffers = wire.empty_like_spec(spec, self.device)
        message.works = [self.channels.irecv(buf, message.peer, "p2p")
                         for buf in message.buffers if buf.numel()]

    def _take(self, message: IncomingPytree) -> None:
        """Described path: read a message's header and spec, post its tensors' receives."""
        header = torch.empty(1, dtype=torch.int64, device=self.device)
        what = f"the spec of {message.label}"
        self.waiter.wait(self.channels.irecv(header, message.peer, "p2p"), what)
        meta = torch.empty(int(header.item()), dtype=torch.uint8, device=self.device)
        self.waiter.wait(self.channels.irecv(meta, message.peer, "p2p"), what)
        spec = wire.decode_spec(meta.cpu().numpy().tobytes())
        self.now[(message.peer, "in")].append(spec)
        self.counters.bytes_received += 8 + meta.numel()
        self.described_messages += 1
        self._post_tensors(message, spec)

    def flush(self) -> None:
        """End of step: take every described message still pending (no receive lingers)."""
        for queue in self._pending.values():
            while queue:
                self._take(queue.popleft())

    def _changed(self, spec: wire.Spec, expected: wire.Spec, peer: int, label: str,
                 what: str) -> MessageShapeError:
        if spec.tensors != expected.tensors:
            change = f"its tensors were {expected.describe()} and are now {spec.describe()}"
        else:
            change = "its structure or plain values changed (the tensors did not)"
        message = (
            f"rank {self.channels.global_rank} failed at {label}: MessageShapeError: the {what} "
            f"sent to rank "
            f"{peer} differs from the same message in the last step with this step signature: "
            f"{change}. The receiver posted its receive for the old spec and cannot be told "
            "without a header. If the shape depends on the data, use the described transport: "
            "GeneralParallel(..., transport=\"described\") (or ProgramExecutor(..., "
            "transport=\"described\")); if it follows the inputs' shapes, every rank must be "
            "given every microbatch's inputs (or the same step(..., signature=...))")
        fault = MessageShapeError(message)
        fault.headline = message
        return fault

    def send_flat(self, tensor: torch.Tensor, peer: int, kind: str, label: str) -> None:
        if tensor.numel():
            self._isend(tensor, peer, kind, label)
        self.counters.bytes_sent += tensor.numel() * tensor.element_size()

    def post_flat(self, tensor: torch.Tensor, peer: int, kind: str) -> Any:
        """Post a receive into ``tensor``; None for an empty buffer (nothing to transfer)."""
        self.counters.bytes_received += tensor.numel() * tensor.element_size()
        return self.channels.irecv(tensor, peer, kind) if tensor.numel() else None

    def wait(self, work: Any, label: str) -> None:
        if work is not None:
            self.waiter.wait(work, label)

    def _isend(self, tensor: torch.Tensor, peer: int, kind: str, label: str) -> None:
        self.sends.add(self.channels.isend(tensor, peer, kind), (tensor,),
                       f"the peer to receive {label}")

    def drain_sends(self) -> None:
        """Wait for every send of the step (each buffer was released as its send completed)."""
        self.sends.drain()

    def drop_all(self) -> None:
        """Forget every handle (before aborting the channels: handles keep connections alive)."""
        self.sends.clear()
        self.sends = SendReleaser(self.waiter.wait, self.waiter.timeout, self.threaded_sends)
        self._pending.clear()
        self.known.clear()
        self.programs = None
        self.expect = None


class SendReleaser:
    """This rank's outstanding sends, each buffer held until its send completed.

    NCCL's handles report completion by themselves (``is_completed``), but gloo's point-to-point
    handles complete only inside ``wait()``: polled from the step's thread, every sent buffer would
    live to the step's end (under ``fsdp``, every fetched stage's gradient at once). So with
    ``threaded=True`` a thread of its own waits for the sends in issue order (``Work.wait``
    releases the GIL) and drops each buffer as its wait returns; with ``threaded=False`` each new
    send drops the completed ones at the head of the queue.
    """

    def __init__(self, wait: WaitFn, timeout: float, threaded: bool = True) -> None:
        self._wait = wait
        self._threaded = threaded
        self._timeout = float(timeout)
        self._queue: deque[tuple[Any, tuple[torch.Tensor, ...], str]] = deque()
        self._lock = threading.Condition()
        self._failure: RuntimeFault | None = None
        self._busy: str | None = None  # the label of the send the thread is waiting for
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, work: Any, buffers: tuple[torch.Tensor, ...], label: str) -> None:
        """Hold ``buffers`` until ``work`` (their send) completed."""
        if not self._threaded:
            while self._queue and self._queue[0][0].is_completed():
                self._queue.popleft()
            self._queue.append((work, buffers, label))
            return
        with self._lock:
            self._queue.append((work, buffers, label))
            self._lock.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gsched-send-release",
                                            daemon=True)
            self._thread.start()

    @property
    def held(self) -> int:
        """Sends not yet known complete (their buffers still held)."""
        with self._lock:
            return len(self._queue) + int(self._busy is not None)

    def drain(self) -> None:
        """Return once every send so far completed, bounded by the timeout; raise the first
        failure of one (as the step's own :class:`RuntimeFault`)."""
        if not self._threaded:
            while self._queue:
                work, _, label = self._queue[0]
                self._wait(work, label)
                self._queue.popleft()
            return
        deadline = time.monotonic() + self._timeout
        with self._lock:
            while (self._queue or self._busy is not None) and self._failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(timeout=min(left, 1.0))
            failure, self._failure = self._failure, None
            pending = [label for _, _, label in self._queue]
            if self._busy is not None:
                pending.insert(0, self._busy)
        if failure is not None:
            raise failure
        if pending:  # the thread's own wait (same timeout, started earlier) usually fails first
            raise RuntimeFault(f"waiting for {pending[0]}: the step's sends did not complete "
                               f"within {self._timeout:g} s ({len(pending)} outstanding)")

    def clear(self) -> None:
        """Forget every handle (the channels are being aborted); the thread ends."""
        with self._lock:
            self._queue.clear()
            self._closed = True
            self._lock.notify_all()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                work, buffers, label = self._queue.popleft()
                self._busy = label
            try:
                self._wait(work, label)
            except RuntimeFault as fault:
                with self._lock:
                    self._failure = self._failure or fault
            except Exception as exc:  # noqa: BLE001 - reported on the step's thread
                with self._lock:
                    self._failure = self._failure or RuntimeFault(
                        f"the send of {label} failed: {exc}")
            del work, buffers  # the buffer goes with its last reference, now
            with self._lock:
                self._busy = None
                self._lock.notify_all()


def label(action: Action, index: int) -> str:
    return f"'{action}' (action {index})"
