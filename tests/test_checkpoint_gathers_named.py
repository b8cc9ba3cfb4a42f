"""A save's gathers run as the engine's collectives, so a peer lost in one is named.

Found by probing (kill -9 of rank 0 while a checkpoint's optimizer state was being gathered):
the survivor ended with gloo's bare ``RuntimeError: Read error ... Connection reset by peer``,
no rank, no phase, not a ``RuntimeFault``, because the runtime's gathers for a full checkpoint
(the model, each optimizer; streamed: their descriptions and the stream to rank 0) were called
outside ``PipelineEngine.collective``. Here a pipeline whose runtime loses its peer in each of
them (the backend's ``RuntimeError``) and an engine whose ``collective`` does what the real
one does with a control group (``ControlGroup.run``: a ``RuntimeError`` becomes a
``RuntimeFault`` naming what was running): each save path must end in that fault, naming its
phase. One process, no launch: what is checked is which calls go through the collective.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import pytest
import torch

from lightning_gsched.engine.checkpoint import CheckpointService, CheckpointView
from lightning_gsched.errors import RuntimeFault

_T = TypeVar("_T")


class LostPeer:
    """A runtime whose every gather or stream finds its peer gone."""

    def __init__(self, streaming: bool) -> None:
        self.streaming = streaming

    def _lost(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Read error [127.0.0.1]:8614: Connection reset by peer")

    full_state_dict = full_optimizer_state = _lost
    streamed_state_dict = streamed_optimizer_state = stream = stream_kept = _lost


class Engine:
    def __init__(self, streaming: bool) -> None:
        self.runtime = LostPeer(streaming)
        self.deferred = streaming
        self.tensor_parallel_size = 1

    def collective(self, what: str, collective: Callable[[], _T]) -> _T:
        try:
            return collective()
        except RuntimeError as exc:
            raise RuntimeFault(f"rank 1 stopped in {what}: lost the connection to a peer "
                               f"({exc})") from exc


def _view(streaming: bool) -> CheckpointView:
    module = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    return CheckpointView(module, Engine(streaming), [optimizer], rank=1, world_size=2)


def test_a_gathered_save_names_the_gather_it_lost_a_peer_in() -> None:
    service, view = CheckpointService(default_io=object), _view(streaming=False)
    with pytest.raises(RuntimeFault, match="the checkpoint's gather of the model"):
        service.model_state(view, whole=dict)
    with pytest.raises(RuntimeFault, match="the checkpoint's gather of the optimizer state"):
        service.optimizer_state(view, view.optimizers[0])


def test_a_streamed_save_names_the_phase_it_lost_a_peer_in() -> None:
    service, view = CheckpointService(default_io=object), _view(streaming=True)
    with pytest.raises(RuntimeFault, match="the checkpoint's description of the model"):
        with service.saving(view):
            pass
    with pytest.raises(RuntimeFault, match="description of the optimizer state"):
        service.optimizer_state(view, view.optimizers[0])
    with pytest.raises(RuntimeFault, match="the checkpoint's stream to rank 0"):
        service.write(view, {}, "/tmp/unused.ckpt", None, hand_on=lambda c: None)
