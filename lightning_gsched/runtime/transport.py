"""Messages of a program: pytrees on ``p2p``, flat buffers on ``weights`` and ``grads``.

Why this shape: sends never block (the programs were proven deadlock-free under that model), so
every send is an ``isend`` whose handle and buffer are kept until the end of the step. Receives
are *posted* where the program says and waited for where they are consumed.

A pytree message is a header (int64 ``[meta_len, payload_len]``) on ``p2p_head`` and one
payload message on ``p2p_body``. The receiver cannot know a payload's size before its header
arrives, and on gloo a payload's bytes only start to flow once its receive is posted (the
sender waits for the receiver's "ready"), so a payload received only when the consumer waits
puts its whole transfer on the critical path. Hence *expected sizes*: the programs send the
same sequence of messages every step, so both ends remember the payload sizes of the last
completed step of the same programs, per peer and position. From the second step on, the
receiver posts the payload receive together with the header receive, into a buffer of the
expected size, and the transfer overlaps the receiver's compute. If a payload's size changed
(another batch shape), the sender still fills the expected-size receive (with filler bytes) and
sends the real payload on ``p2p_late``; the header tells the receiver which case it is. Every
message thus puts exactly one message on ``p2p_body``, and both ends agree on the expectation
because they derive it from the same history, so both channels stay FIFO-consistent. Headers
posted earlier from the same peer are completed first, keeping the order of the sender's.
(Weights and gradients have sizes both ends know: one message.)
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Any

import torch

from lightning_gsched.runtime import wire
from lightning_gsched.runtime.channels import Channels
from lightning_gsched.runtime.counters import RuntimeCounters
from lightning_gsched.runtime.faults import Waiter
from lightning_gsched.schedule.program import Action


class IncomingPytree:
    """A posted pytree receive: the header is in flight, the payload follows it."""

    def __init__(self, channels: Channels, peer: int, label: str, device: torch.device,
                 expected: int | None) -> None:
        self.peer = peer
        self.label = label  # "'RECV_ACT s0 b1 <-0' (posted at action 2)"
        self.header = torch.empty(wire.HEADER_LEN, dtype=torch.int64, device=device)
        self.head_work: Any = channels.irecv(self.header, peer, "p2p_head")
        self.expected = expected
        self.header_done = False
        self.body_work: Any = None
        self.payload: torch.Tensor | None = None
        if expected is not None:  # the payload flows while this rank computes
            self.payload = torch.empty(expected, dtype=torch.uint8, device=device)
            self.body_work = channels.irecv(self.payload, peer, "p2p_body")
        self.meta_len = 0


class PayloadSizes:
    """Payload sizes per (programs, peer, direction), in message order; see the module doc.

    ``begin`` starts a step of some programs; ``expected`` tells the size the message at the
    current position had in the last *completed* step of the same programs (None in the first);
    ``commit`` (end of a successful step) makes this step's sizes the new expectation.
    """

    def __init__(self) -> None:
        self.last: dict[tuple[int, int, str], list[int]] = {}
        self.keep: dict[int, Any] = {}  # programs by id, so an id is never reused meanwhile
        self.key = 0
        self.now: dict[tuple[int, str], list[int]] = defaultdict(list)
        self.count: dict[tuple[int, str], int] = defaultdict(int)

    def begin(self, programs: Any) -> None:
        self.key = id(programs)
        self.keep[self.key] = programs
        self.now = defaultdict(list)
        self.count = defaultdict(int)

    def expected(self, peer: int, direction: str) -> int | None:
        """Expectation for the next message to/from ``peer``; advances the position."""
        position = self.count[(peer, direction)]
        self.count[(peer, direction)] = position + 1
        last = self.last.get((self.key, peer, direction))
        return last[position] if last is not None and position < len(last) else None

    def record(self, peer: int, direction: str, size: int) -> None:
        self.now[(peer, direction)].append(size)

    def commit(self) -> None:
        for (peer, direction), sizes in self.now.items():
            self.last[(self.key, peer, direction)] = sizes

    def clear(self) -> None:
        self.last.clear()
        self.keep.clear()


class Transport:
    """Sends and receives of one executor; counts messages' bytes into ``counters``."""

    def __init__(self, channels: Channels, waiter: Waiter, device: torch.device) -> None:
        self.channels = channels
        self.waiter = waiter
        self.device = device
        self.counters = RuntimeCounters()
        self.sends: deque[tuple[Any, tuple, str]] = deque()  # (work, buffers kept alive, label)
        self._headers_pending: dict[int, deque[IncomingPytree]] = defaultdict(deque)
        self.sizes = PayloadSizes()
        self.late_payloads = 0  # payloads whose size differed from the expectation (counted)

    def begin_step(self, programs: Any) -> None:
        """A run of ``programs`` starts: expectations come from their last completed run."""
        self.sizes.begin(programs)

    def end_step(self) -> None:
        """The run completed on this rank: its payload sizes become the next expectation."""
        self.sizes.commit()

    # ------------------------------------------------------------------ pytrees (p2p)

    def send_pytree(self, parts: wire.Split, peer: int, label: str) -> None:
        header, payload = wire.encode(parts, self.device)
        expected = self.sizes.expected(peer, "out")
        self.sizes.record(peer, "out", payload.numel())
        self._isend(header, peer, "p2p_head", label)
        if expected is None or expected == payload.numel():
            self._isend(payload, peer, "p2p_body", label)
        else:  # fill the receive posted at the expected size, then the real payload
            filler = torch.empty(expected, dtype=torch.uint8, device=self.device)
            self._isend(filler, peer, "p2p_body", label)
            self._isend(payload, peer, "p2p_late", label)
            self.late_payloads += 1
        self.counters.bytes_sent += header.numel() * 8 + payload.numel()

    def post_pytree(self, peer: int, label: str) -> IncomingPytree:
        expected = self.sizes.expected(peer, "in")
        message = IncomingPytree(self.channels, peer, label, self.device, expected)
        self._headers_pending[peer].append(message)
        return message

    def wait_pytree(self, message: IncomingPytree) -> tuple[Any, list[torch.Tensor]]:
        """The received pytree and its tensors (fresh leaves, requiring grad as the sender's)."""
        queue = self._headers_pending[message.peer]
        while not message.header_done:
            self._take_header(queue.popleft())
        self.waiter.wait(message.body_work, message.label)
        assert message.payload is not None
        self.counters.bytes_received += message.header.numel() * 8 + message.payload.numel()
        value, tensors = wire.decode(message.meta_len, message.payload)
        message.payload = None
        return value, tensors

    def _take_header(self, message: IncomingPytree) -> None:
        """Read a header; post the payload receive unless the expected one already holds it."""
        self.waiter.wait(message.head_work, f"the header of {message.label}")
        meta_len, payload_len = (int(v) for v in message.header.tolist())
        self.sizes.record(message.peer, "in", payload_len)
        message.meta_len = meta_len
        message.header_done = True
        if message.expected == payload_len:
            return
        kind = "p2p_body"
        if message.expected is not None:  # the sender filled the expected receive: drain it
            self.waiter.wait(message.body_work, f"the filler of {message.label}")
            kind = "p2p_late"
            self.late_payloads += 1
        message.payload = torch.empty(payload_len, dtype=torch.uint8, device=self.device)
        message.body_work = self.channels.irecv(message.payload, message.peer, kind)

    def flush_headers(self) -> None:
        """End of step: read every header still pending (no payload receive may linger)."""
        for queue in self._headers_pending.values():
            while queue:
                self._take_header(queue.popleft())

    # ------------------------------------------------------------------ flat buffers

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

    # ------------------------------------------------------------------ sends

    def _isend(self, tensor: torch.Tensor, peer: int, kind: str, label: str) -> None:
        self._prune_sends()
        self.sends.append((self.channels.isend(tensor, peer, kind), (tensor,), label))

    def _prune_sends(self) -> None:
        """Release buffers of sends that already completed, where the backend can tell (NCCL).

        Gloo's point-to-point handles only complete in ``wait()``, so there every send buffer
        is held until :meth:`drain_sends` at the end of the step.
        """
        while self.sends and self.sends[0][0].is_completed():
            self.sends.popleft()

    def drain_sends(self) -> None:
        """Wait for every send of the step (their buffers are released afterwards)."""
        while self.sends:
            work, _, label = self.sends[0]
            self.waiter.wait(work, f"the peer to receive {label}")
            self.sends.popleft()

    def drop_all(self) -> None:
        """Forget every handle (before aborting the channels: handles keep connections alive)."""
        self.sends.clear()
        self._headers_pending.clear()
        self.sizes.clear()


def label(action: Action, index: int) -> str:
    return f"'{action}' (action {index})"
