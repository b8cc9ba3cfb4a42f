"""A steady-state step reads nothing from the device: no ``.item()``, ``.tolist()``, ``.cpu()``,
``.numpy()``, ``bool(t)``, ``float(t)``, ``int(t)`` in ``ModelRuntime.step`` from the second step on.

Why count on CPU: on CUDA each such call waits for the device's queue to drain, so one per
message (a header read) or per step stalls the pipeline; the calls are Python calls either way,
so wrapping the ``torch.Tensor`` methods counts them on any device. The first step of a step
signature exchanges message specs (the described path, which reads headers) and is not counted;
steps 2 and 3 repeat that signature. The model has no BatchNorm (whose running statistics are
folded on the host once per step by design, see docs/runtime.md).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from dist_harness import WorkerContext
from lightning_gsched.partition import partition
from lightning_gsched.runtime import ModelRuntime
from lightning_gsched.schedule import plan
from test_runtime_schedules import build, calls, global_batch, make_loss
from tie_helpers import with_ties

pytestmark = pytest.mark.distributed
SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


class SyncCounter:
    """Wraps the ``torch.Tensor`` methods that read a tensor's values on the host."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> SyncCounter:
        for name in SYNCS:
            original = getattr(torch.Tensor, name)
            self.saved[name] = original

            def counted(t: torch.Tensor, *args: Any, _name: str = name, _orig: Any = original,
                        **kwargs: Any) -> Any:
                self.calls[_name] += 1
                return _orig(t, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)


def sync_check(ctx: WorkerContext, schedule: str) -> dict[str, Any]:
    p = plan(schedule, workers=ctx.world_size, stages=2 if schedule == "ddp" else None)
    batch = global_batch("gpt", p.micro)
    loss_fn = make_loss("gpt", batch)
    model = build("gpt")
    args, kwargs, _ = batch[0]
    part = partition(model, p.stages, example_args=args, example_kwargs=kwargs)
    p = with_ties(p, part)  # the GPT's embedding and head are tied: the plan places them
    runtime = ModelRuntime(model, part.stages, p.programs, timeout=60)
    ex = runtime.executor
    optimizer = torch.optim.SGD(runtime.owned_parameters(), lr=0.01)
    counted: Counter[str] = Counter()
    first: dict[str, int] = {}
    fast = []
    computed_ok = []
    for step in range(3):
        seen: list[dict] = []
        with SyncCounter() as counter:
            result = runtime.step(calls(batch), loss_fn, 
                                  on_computed=lambda losses, box=seen: box.append(dict(losses)))
        # on_computed: once per step, when every loss of this rank is already computed
        computed_ok.append(len(seen) == 1 and seen[0].keys() == result.losses.keys()
                           and all(seen[0][b] is result.losses[b] for b in seen[0]))
        if step == 0:
            first = dict(counter.calls)
        else:
            counted.update(counter.calls)
            fast.append(ex.transport.fast)
        runtime.hand_over()
        optimizer.step()
        optimizer.zero_grad()
    groups = sorted(ex.channels.groups)
    devices = {str(f.device) for f in ex.flats}
    runtime.close()
    return {"computed_ok": computed_ok, "syncs": dict(counted), "first": first, "fast": fast, "groups": groups, "devices": devices,
            "device": str(ex.device)}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "fsdp", "ddp", "zb-h1"])
def test_steady_state_steps_never_read_the_device(worlds, schedule):
    results = worlds.get(2).run(sync_check, schedule)
    if schedule in ("gpipe", "1f1b", "zb-h1"):  # the counter sees the first step's header reads
        assert sum(sum(r["first"].values()) for r in results) > 0, results
    for rank, r in enumerate(results):
        assert all(r["computed_ok"]), rank
        assert r["syncs"] == {}, (rank, r["syncs"])
        assert all(r["fast"]), (rank, r["fast"])
        # one group per channel kind and direction (NCCL orders p2p within a communicator)
        assert r["groups"] == sorted((kind, up) for kind in ("grads", "p2p", "weights")
                                     for up in (False, True))
        assert r["devices"] <= {r["device"]}
