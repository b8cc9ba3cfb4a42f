"""The measuring pass (measure/stage_pass.py): each stage visited once for seconds and bytes.

* the pass runs each stage's forward exactly as often as it claims (counted with a forward
  pre-hook): ``warmup + repeats x kinds`` timed runs, then one byte run (two for a stage fed by
  a message), and its bytes equal those of separate runs made here the way the planner's sizes
  were measured before the pass (one forward for the stash, another forward and B for the split
  backward's bytes, another for the received input): the figures did not change;
* the memory report's sizes (``MemoryReport.predict`` as the build calls it), from a pass the
  tuner made with the loss on the same cut and microbatch (measure/build_passes.py), equal a
  bytes-only pass without the loss, while only the last stage runs again; another microbatch
  is measured anew.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_gsched.engine.memory_report import MemoryReport
from lightning_gsched.measure import measure_stage_bytes, measure_stages
from lightning_gsched.measure.build_passes import BuildPasses
from lightning_gsched.partition import partition
from lightning_gsched.runtime import wire
from lightning_gsched.runtime.footprint import SavedTensorBytes, held_until_w, weight_storages
from lightning_gsched.runtime.split_backward import backward_input
from lightning_gsched.schedule import plan
from models import gpt_inputs, make_gpt


class SavesOutputs(nn.Module):
    """Ops that save their own outputs (tanh, exp, sigmoid), a view handed to the next stage,
    and BatchNorm (buffers a measurement must restore)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn = nn.Linear(8, 16), nn.BatchNorm1d(16)
        self.b, self.c = nn.Linear(16, 16), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(torch.tanh(self.a(x)))
        h = self.b(h).exp()
        return self.c(h[:, :8]).sigmoid()


def _gpt() -> tuple[nn.Module, tuple[Any, ...], Callable[[Any], torch.Tensor]]:
    model = make_gpt()
    (idx,) = gpt_inputs(batch=2)
    return model, (idx,), lambda out: F.cross_entropy(out.reshape(-1, out.size(-1)),
                                                      idx.reshape(-1))


def _saves_outputs() -> tuple[nn.Module, tuple[Any, ...], Callable[[Any], torch.Tensor]]:
    torch.manual_seed(0)
    model = SavesOutputs()
    return model, (torch.randn(4, 8),), lambda out: (out * out).mean()


def _counted_forward(stage: nn.Module, call: tuple[Any, ...], counter: SavedTensorBytes,
                     loss_fn: Callable[[Any], torch.Tensor] | None) -> tuple[Any, int]:
    """A forward counted by ``counter`` (and the loss after it, counted apart, then added):
    its output (or loss) and the loss's own bytes."""
    with counter:
        out = stage(*call)
        if loss_fn is not None:
            with SavedTensorBytes(exclude=counter.exclude) as in_loss:
                loss = loss_fn(out)
            counter.storages.update(in_loss.storages)
            return loss, in_loss.nbytes
    return out, 0


def _separate_bytes(stages: list[nn.Module], args: tuple[Any, ...],
                    loss_fn: Callable[[Any], torch.Tensor] | None) -> list[tuple[int, ...]]:
    """(activations, received_activations, loss_graph, b_released, w_grads, message) per stage,
    each from its own run, as measured before the pass: a forward for the stash, a second
    forward and B for the split backward, a third forward for the received input."""
    out_sizes = []
    handed: wire.Split | None = None
    last = len(stages) - 1
    with torch.enable_grad():
        for s, stage in enumerate(stages):
            weights = weight_storages(stage)
            ending = loss_fn if s == last else None
            if handed is None:
                local, leaves = args, []
            else:
                leaves = wire.detached_leaves(handed.tensors)
                local = (wire.join(handed.structure, leaves),)
            stash = SavedTensorBytes(exclude=weights)
            out, loss_part = _counted_forward(stage, local, stash, ending)
            if handed is not None:
                leaves = wire.detached_leaves(handed.tensors)
                local = (wire.join(handed.structure, leaves),)
            split = SavedTensorBytes(exclude=weights)
            with split:
                again = stage(*local)
                if ending is not None:
                    roots, grads = [ending(again).reshape(())], None
                else:
                    roots = [t for t in wire.split(again).tensors if t.requires_grad]
                    grads = [torch.ones_like(t) for t in roots]
            del again
            _, pending = backward_input(roots, grads, leaves,
                                        [p for p in stage.parameters() if p.requires_grad])
            del roots, grads
            held = held_until_w(split, pending.held_tensors())
            kept = sum(split.alive_storages().values())
            released, w_grads = split.nbytes - kept, sum(held.values()) - kept
            del pending
            received = stash.nbytes
            if handed is not None:
                message, _ = wire.received_copy(handed, torch.device("cpu"))
                counted = SavedTensorBytes(exclude=weights)
                _counted_forward(stage, (message,), counted, ending)
                received = counted.nbytes
            parts = None if s == last else wire.split(out)
            out_sizes.append((stash.nbytes, received, loss_part, released, w_grads,
                              0 if parts is None else wire.spec_of(parts).nbytes))
            handed = parts
    return out_sizes


def _fields(sizes: Any) -> list[tuple[int, ...]]:
    return [(st.activations, st.received_activations, st.loss_graph, st.b_released, st.w_grads,
             st.message) for st in sizes.stages]


def _count_forwards(stages: list[nn.Module]) -> Counter[int]:
    calls: Counter[int] = Counter()
    for s, stage in enumerate(stages):
        stage.register_forward_pre_hook(lambda *_, s=s: calls.update([s]))
    return calls


@pytest.mark.parametrize("make", [_gpt, _saves_outputs], ids=["gpt", "saves_outputs"])
@pytest.mark.parametrize("S", [1, 3])
def test_each_stage_runs_the_claimed_times_and_the_bytes_equal_separate_runs(make, S) -> None:
    model, args, loss_fn = make()
    part = partition(model, S, args)
    stages = list(part.stages)
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    calls = _count_forwards(stages)
    warmup, repeats = 2, 2
    measured = measure_stages(stages, args, loss_fn=loss_fn, kinds=("whole", "split", "unlossed"),
                              repeats=repeats, warmup=warmup, sizes=True)
    # timed: warmup + 2 kinds x repeats (the last stage: 3 kinds); bytes: once, twice when fed
    # by a message
    want = {s: warmup + 2 * repeats + (repeats if s == S - 1 else 0) + (1 if s == 0 else 2)
            for s in range(S)}
    assert dict(calls) == want
    assert measured.times is not None and measured.split is not None
    assert all(t > 0 for t in measured.times.forward + measured.times.backward
               + measured.split.weight)
    assert measured.unlossed_last is not None and min(measured.unlossed_last) > 0
    assert all(p.grad is None for p in model.parameters())  # nothing left behind
    for name, value in model.state_dict().items():  # BatchNorm's statistics restored
        torch.testing.assert_close(value, buffers[name], rtol=0, atol=0)
    for loss in (loss_fn, None):
        reference = _separate_bytes(stages, args, loss)
        alone = measure_stage_bytes(stages, args, loss_fn=loss)
        assert _fields(alone) == reference
        if loss is loss_fn:
            assert measured.sizes == alone  # timing first changes no byte


def test_the_report_reuses_the_tuners_pass_of_its_cut_and_microbatch() -> None:
    model, args, loss_fn = _gpt()
    tuner = partition(model, 3, args, verify=False)  # the tuner's own cut, measured with the loss
    passes = BuildPasses()
    passes.record(tuner.stage_units, args, {},
                  measure_stages(tuner.stages, args, loss_fn=loss_fn, kinds=("whole",),
                                 repeats=1, warmup=0, sizes=True, optimizer_factor=2.0))
    built = partition(model, 3, args)  # the engine's partition of the same cut
    calls = _count_forwards(list(built.stages))
    same = tuple(a.clone() for a in args)  # the pick's microbatch: equal rows, another tensor
    trained = plan("1f1b", workers=3, ties=built.shared_parameters.values())
    report = MemoryReport()  # as the engine's build calls it (rank 0 of one)
    report.predict(built.stages, same, {}, trained, [torch.optim.Adam(model.parameters())],
                   passes=passes, stage_units=built.stage_units)
    assert passes.reused == 1 and report.predicted is not None
    assert dict(calls) == {2: 2}  # the last stage only: local and received input, no loss
    assert report.sizes == measure_stage_bytes(built.stages, same, optimizer_factor=2.0)
    calls.clear()
    other = (gpt_inputs(batch=3)[0],)  # another microbatch: measured anew
    sizes = passes.stage_bytes(built.stage_units, built.stages, other, {}, 2.0)
    assert passes.reused == 1 and dict(calls) == {0: 1, 1: 2, 2: 2}
    assert sizes == measure_stage_bytes(built.stages, other, optimizer_factor=2.0)
