"""Process groups that share the default group's gloo device: no transport thread of their own.

Why: every gloo process group made the usual way gets a transport device of its own, and every
device owns a thread (``gloo_tcp_loop``) that wakes every 10 ms, idle or not, on the cores the
ranks compute on (docs/benchmarks.md, "the engine's gap, counted per thread"). A gloo device
serves any number of groups (each group keeps its own connections and its own timeout), so the
engine's internal groups (the runtime's channels, the checkpoint service's bounded exchange) are
made through a backend registered once per process, :data:`BACKEND`, that builds torch's own
``ProcessGroupGloo`` on the default group's device. They are gloo groups in every respect
(collectives, point to point, tags, timeouts, abort); only ``dist.get_backend(group)`` names
them :data:`BACKEND`. Every group the strategies make on a CPU gloo job is one: the runtime's
channels, the checkpoint service's exchange, the control group, the device mesh's dimensions
(:func:`mesh_backend_override`): a run adds no transport thread to the default group's.

What reads the name: Lightning's ``_sync_ddp`` (behind ``self.log(sync_dist=True)``,
``strategy.reduce``, ``fabric.all_reduce``) turns a mean into a sum and a division only where
``get_backend(group) == "gloo"`` (gloo has no AVG). The strategies therefore ask it for a sum
and divide themselves on our groups (:func:`lightning_reduce`); torch's own code
(DTensor, FSDP2, functional collectives) reads the backend object, which is gloo's.

Where the default group has no gloo device (NCCL), a group that follows the default backend is
made as before (:func:`new_group`), and one that must be gloo (host objects) shares a device
of our own (:func:`gloo_group`).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

BACKEND = "gsched_gloo"
_LOCK = threading.Lock()
_OWN_DEVICE: list[Any] = []  # a device of our own, made once, where the default has none


def _default_gloo_device() -> Any | None:
    """The transport device of the default group's gloo backend, or None (no default group,
    another backend, or a torch that does not expose it: ``options._devices`` is torch's)."""
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        devices = backend.options._devices  # type: ignore[attr-defined]  # torch's, gloo's
    except Exception:  # noqa: BLE001 - any of the above missing: no device to share
        return None
    if not isinstance(backend, dist.ProcessGroupGloo) or not devices:
        return None
    return devices[0]


def _device() -> Any:
    """The device our groups share: the default group's where it has one, else ours."""
    device = _default_gloo_device()
    if device is not None:
        return device
    with _LOCK:
        if not _OWN_DEVICE:
            _OWN_DEVICE.append(dist.ProcessGroupGloo.create_default_device())
        return _OWN_DEVICE[0]


def _make_backend(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """torch's gloo backend for one group, on the shared device (``register_backend``'s call)."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's
    options._devices = [_device()]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, options)


def _registered() -> str:
    """:data:`BACKEND`, registered with torch.distributed on first use in this process."""
    with _LOCK:
        if not hasattr(dist.Backend, BACKEND.upper()):
            dist.Backend.register_backend(BACKEND, _make_backend, devices=["cpu"])
    return BACKEND


def default_is_gloo() -> bool:
    """Whether the default group's one backend is gloo (a CPU job): then the groups that follow
    it share its device."""
    return dist.is_initialized() and dist.get_backend() == "gloo"


def shared_backend() -> str | None:
    """The backend for a group that follows the default's: :data:`BACKEND` on a gloo job, else
    None (``dist.new_group``'s default, the default group's backend)."""
    return _registered() if default_is_gloo() else None


def new_group(ranks: Sequence[int] | None = None, *, timeout: timedelta) -> Any:
    """``dist.new_group(ranks, timeout=timeout)`` on the default group's backend, sharing its
    gloo device on a gloo job (collective: every rank calls it, in the same order)."""
    return dist.new_group(list(ranks) if ranks is not None else None, timeout=timeout,
                          backend=shared_backend())


def mesh_backend(device_type: str) -> str | None:
    """The backend for a device mesh's groups: :data:`BACKEND` for a CPU mesh of a gloo job
    (they share the default group's device); None (torch's default) otherwise, e.g. a CUDA
    mesh, whose groups must carry device tensors."""
    return _registered() if device_type == "cpu" and default_is_gloo() else None


def mesh_backend_override(device_type: str, ndim: int) -> dict[int | str, Any] | None:
    """``init_device_mesh``'s ``backend_override`` with :func:`mesh_backend` for every
    dimension (None: torch's default groups)."""
    backend = mesh_backend(device_type)
    return None if backend is None else dict.fromkeys(range(ndim), backend)


def _mean_by_sum(group: Any, reduce_op: Any) -> bool:
    """Whether a mean over ``group`` must be asked of Lightning as a sum and divided after: a
    group of ours, which Lightning's ``_sync_ddp`` does not recognise as gloo (module doc).
    ``reduce_op`` as Lightning takes it: ``"mean"``/``"avg"`` in any case, or
    ``ReduceOp.AVG``."""
    if group is None or not dist.is_initialized():
        return False
    if isinstance(reduce_op, str):
        mean = reduce_op.lower() in ("mean", "avg")
    else:
        mean = reduce_op == dist.ReduceOp.AVG
    return mean and dist.get_backend(group) == BACKEND


def lightning_reduce(reduce: Callable[..., Any], tensor: Any, group: Any,
                     reduce_op: Any) -> Any:
    """``reduce(tensor, group=group, reduce_op=reduce_op)``, Lightning's reduction (a
    strategy's ``reduce`` or ``all_reduce``), except that a mean over one of our groups is asked
    for as a sum and divided here, in place, as ``_sync_ddp`` divides on a group named gloo (an
    integer tensor keeps its dtype)."""
    if not (isinstance(tensor, torch.Tensor) and _mean_by_sum(group, reduce_op)):
        return reduce(tensor, group=group, reduce_op=reduce_op)
    total = reduce(tensor, group=group, reduce_op="sum")
    size = dist.get_world_size(group)
    if not torch.is_floating_point(total):
        return total.copy_(total / size)
    return total.div_(size)


def gloo_group(ranks: Sequence[int] | None = None, *, timeout: timedelta) -> Any:
    """A gloo group whatever the default's backend (for host objects), sharing one device."""
    return dist.new_group(list(ranks) if ranks is not None else None, timeout=timeout,
                          backend=_registered())
