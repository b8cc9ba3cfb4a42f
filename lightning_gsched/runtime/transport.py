"""Messages of a program: pytrees on ``p2p``, flat buffers on ``weights`` and ``grads``.

Why this shape: sends never block (the programs were proven deadlock-free under that model), so
every send is an ``isend`` whose handle and buffer are kept until the end of the step. Receives
are *posted* where the program says and waited for where they are consumed.

A pytree message is a header (int64 ``[meta_len, payload_len]``) on ``p2p_head`` followed by
one payload on ``p2p_body``. The payload receive can only be posted once its header has arrived,
and gloo cannot poll a receive, so it is posted when the consumer first waits for the message;
headers posted earlier from the same peer are completed first, which keeps both groups FIFO in
the same order as the sender's. (Weights and gradients have sizes both ends know: one message.)
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

    def __init__(self, channels: Channels, peer: int, label: str, device: torch.device) -> None:
        self.peer = peer
        self.label = label  # "'RECV_ACT s0 b1 <-0' (posted at action 2)"
        self.header = torch.empty(wire.HEADER_LEN, dtype=torch.int64, device=device)
        self.head_work: Any = channels.irecv(self.header, peer, "p2p_head")
        self.body_work: Any = None
        self.payload: torch.Tensor | None = None
        self.meta_len = 0


class Transport:
    """Sends and receives of one executor; counts messages' bytes into ``counters``."""

    def __init__(self, channels: Channels, waiter: Waiter, device: torch.device) -> None:
        self.channels = channels
        self.waiter = waiter
        self.device = device
        self.counters = RuntimeCounters()
        self.sends: deque[tuple[Any, tuple, str]] = deque()  # (work, buffers kept alive, label)
        self._headers_pending: dict[int, deque[IncomingPytree]] = defaultdict(deque)

    # ------------------------------------------------------------------ pytrees (p2p)

    def send_pytree(self, parts: wire.Split, peer: int, label: str) -> None:
        header, payload = wire.encode(parts, self.device)
        self._isend(header, peer, "p2p_head", label)
        self._isend(payload, peer, "p2p_body", label)
        self.counters.bytes_sent += header.numel() * 8 + payload.numel()

    def post_pytree(self, peer: int, label: str) -> IncomingPytree:
        message = IncomingPytree(self.channels, peer, label, self.device)
        self._headers_pending[peer].append(message)
        return message

    def wait_pytree(self, message: IncomingPytree) -> tuple[Any, list[torch.Tensor]]:
        """The received pytree and its tensors (fresh leaves, requiring grad as the sender's)."""
        queue = self._headers_pending[message.peer]
        while message.body_work is None:
            self._post_body(queue.popleft())
        self.waiter.wait(message.body_work, message.label)
        assert message.payload is not None
        self.counters.bytes_received += message.header.numel() * 8 + message.payload.numel()
        value, tensors = wire.decode(message.meta_len, message.payload)
        message.payload = None
        return value, tensors

    def _post_body(self, message: IncomingPytree) -> None:
        self.waiter.wait(message.head_work, f"the header of {message.label}")
        meta_len, payload_len = (int(v) for v in message.header.tolist())
        message.meta_len = meta_len
        message.payload = torch.empty(payload_len, dtype=torch.uint8, device=self.device)
        message.body_work = self.channels.irecv(message.payload, message.peer, "p2p_body")

    def flush_headers(self) -> None:
        """End of step: post every payload still waiting for its header (nothing may linger)."""
        for queue in self._headers_pending.values():
            while queue:
                self._post_body(queue.popleft())

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


def label(action: Action, index: int) -> str:
    return f"'{action}' (action {index})"
