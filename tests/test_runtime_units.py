"""Single-process tests of the runtime's parts: the wire format, flat buffers, checks, errors."""

from __future__ import annotations

import dataclasses
import threading
from collections import namedtuple
from dataclasses import fields

import pytest
import torch
from torch import nn

from lightning_gsched.errors import GschedError, RuntimeConfigError, RuntimeFault
from lightning_gsched.runtime import wire
from lightning_gsched.runtime.compute import StageCompute
from lightning_gsched.runtime.counters import RuntimeCounters
from lightning_gsched.runtime.flat import FlatGrads, FlatStage
from lightning_gsched.runtime.layout import build_flat_stages, check_programs, check_ties, tie_map
from lightning_gsched.schedule import WorkerMetrics, plan

# --------------------------------------------------------------------------- wire


def roundtrip(value):
    """What a receiver rebuilds: the spec through the described path's bytes, then one fresh
    buffer per tensor filled with what the sender puts on the wire."""
    cpu = torch.device("cpu")
    parts = wire.split(value)
    spec = wire.decode_spec(wire.encode_spec(wire.spec_of(parts)))
    assert spec == wire.spec_of(parts)
    buffers = wire.empty_like_spec(spec, cpu)
    for buf, t in zip(buffers, parts.tensors, strict=True):
        sent = wire.wire_tensor(t, cpu)
        assert sent.is_contiguous() and not sent.requires_grad
        buf.copy_(sent)
    return wire.received(spec, buffers)


def test_pytree_roundtrip_keeps_structure_values_dtypes_and_grad_flags():
    h = torch.randn(3, 4, requires_grad=True)
    value = (
        h * 2,  # non-leaf, requires grad
        {"mask": torch.rand(4, 4) > 0.5, "ids": torch.arange(5), "none": None},
        [torch.randn(4, 3).t(), torch.tensor(2.5, dtype=torch.float64), torch.empty(0, 7)],
        torch.Size([2, 8]),
        7,
        "text",
    )
    got, tensors = roundtrip(value)
    assert got[3] == torch.Size([2, 8]) and got[4] == 7 and got[5] == "text"
    assert got[1]["none"] is None
    assert torch.equal(got[0], value[0].detach()) and got[0].requires_grad and got[0].is_leaf
    assert got[1]["mask"].dtype == torch.bool and torch.equal(got[1]["mask"], value[1]["mask"])
    assert torch.equal(got[1]["ids"], value[1]["ids"]) and not got[1]["ids"].requires_grad
    assert torch.equal(got[2][0], value[2][0])  # non-contiguous on the way in
    assert got[2][1].dtype == torch.float64 and got[2][1].shape == ()
    assert got[2][2].shape == (0, 7)
    assert len(tensors) == 6


def test_the_same_tensor_twice_arrives_as_one_object():
    x = torch.randn(2, 2, requires_grad=True)
    y = x + 1
    got, tensors = roundtrip((y, [y, x]))
    assert got[0] is got[1][0]
    assert len(tensors) == 2


def test_split_order_pairs_outputs_with_received_grads():
    """The i-th tensor of split() on the sender is the i-th tensor the receiver rebuilds."""
    a, b = torch.randn(2), torch.randn(3)
    parts = wire.split({"b": b, "a": [a, 1]})
    leaves = wire.detached_leaves(parts.tensors)
    rebuilt = wire.join(parts.structure, leaves)
    assert rebuilt["b"] is leaves[0] and rebuilt["a"][0] is leaves[1]


def test_specs_tell_shape_dtype_flag_and_value_changes_apart():
    x = torch.randn(2, 3)
    base = wire.spec_of(wire.split((x, 1)))
    assert wire.spec_of(wire.split((torch.zeros(2, 3), 1))) == base  # values do not matter
    assert base.nbytes == 2 * 3 * 4
    for changed in [(torch.randn(3, 3), 1), (x.double(), 1), (x.requires_grad_(), 1),
                    (torch.randn(2, 3), 2), (torch.randn(2, 3), True), [torch.randn(2, 3), 1],
                    (torch.randn(2, 3), 1, None)]:
        assert wire.spec_of(wire.split(changed)) != base, changed


Pair = namedtuple("Pair", "left right")  # module level: picklable


def test_exotic_structures_are_pickled_with_tensors_by_reference():
    t = torch.randn(2)
    parts = wire.split(Pair(t, {"k": (t, 3)}))
    assert parts.structure[0] == "pickle" and parts.tensors == [t]
    got, _ = roundtrip(Pair(t, {"k": (t, 3)}))
    assert isinstance(got, Pair) and got.right["k"][0] is got.left and got.right["k"][1] == 3
    assert torch.equal(got.left, t)


def test_unpicklable_stage_output_is_a_clear_error():
    with pytest.raises(RuntimeConfigError, match="cannot send the output of stage 2.*picklable"):
        wire.split((torch.ones(1), threading.Lock()), what="output of stage 2")


# --------------------------------------------------------------------------- flat buffers


def small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))


def test_owned_stage_params_are_views_of_one_buffer():
    model = small_model()
    before = [p.detach().clone() for p in model.parameters()]
    flat = FlatStage(0, list(model.parameters()), owned=True)
    assert flat.flat is not None and flat.flat.numel() == sum(p.numel() for p in before)
    base = flat.flat.untyped_storage().data_ptr()
    for p, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, old)
        assert p.untyped_storage().data_ptr() == base
    with torch.no_grad():
        flat.flat.zero_()
    assert all(float(p.detach().abs().sum()) == 0 for p in model.parameters())


def test_free_releases_memory_and_refetch_serves_a_pending_backward():
    """Forward under one fetch, free, refetch, backward: the gradient is the plain one."""
    model, reference = small_model(), small_model()
    x = torch.randn(5, 4)
    reference(x).square().sum().backward()
    values = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])

    flat = FlatStage(0, list(model.parameters()), owned=False)
    assert all(p.numel() == 0 for p in model.parameters())  # released at construction
    flat.fetch_buffer().copy_(values)  # what the receive writes
    flat.materialize()
    loss = model(x).square().sum()
    flat.free()
    assert flat.resident_bytes() == 0 and not flat.resident
    assert all(p.numel() == 0 and p.untyped_storage().nbytes() == 0 for p in model.parameters())
    flat.fetch_buffer().copy_(values)  # fetched again for the backward
    flat.materialize()
    flat.zero_grads()
    loss.backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    grad = flat.take_grads()
    assert grad.numel() == flat.grads.numel and all(p.grad is None for p in model.parameters())


def test_flat_grads_fold_in_a_replaced_grad():
    lin = nn.Linear(2, 2)
    grads = FlatGrads(list(lin.parameters()), torch.float32, torch.device("cpu"))
    grads.zero()
    lin.weight.grad = torch.ones(2, 2)  # someone replaced the view
    flat = grads.sync()
    assert float(flat.sum()) == 4.0
    assert lin.weight.grad.data_ptr() == flat.data_ptr()


def test_tied_parameters_leave_the_stage_buffers():
    """Tied parameters form one unit per home stage (the lowest reader), held by its owners
    only: released (empty) on a rank that does not own the home stage."""
    shared = nn.Linear(3, 3)
    stages = [nn.Sequential(shared, nn.Linear(3, 3)), nn.Sequential(nn.Linear(3, 3), shared)]
    flats, ties, _ = build_flat_stages(stages, owned={0, 1}, owned_ties={0})
    assert list(ties) == [0] and ties[0].params == [shared.weight, shared.bias]
    assert ties[0].owned and ties[0].resident and shared.weight.numel() == 9
    assert all(shared.weight is not p for f in flats for p in f.params)
    assert [len(f.params) for f in flats] == [2, 2]
    assert tie_map(stages) == {0: (0, 1)}
    _, ties, _ = build_flat_stages(stages, owned={1}, owned_ties=set())
    assert not ties[0].resident and shared.weight.numel() == 0


def test_ties_group_by_home_stage():
    """Two tied weights with the same lowest reader are one tie (readers united); another home
    is another tie; the programs must plan exactly these ties."""
    a, b, c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    stages = [nn.Sequential(a, b), nn.Sequential(a, c), nn.Sequential(b), nn.Sequential(c)]
    assert tie_map(stages) == {0: (0, 1, 2), 1: (1, 3)}
    check_ties(stages, plan("gpipe", workers=2, stages=4, ties=[(0, 1), (0, 2), (1, 3)]).programs)
    with pytest.raises(RuntimeConfigError, match=r"plan with ties=\{0: \(0, 1, 2\), 1: \(1, 3\)\}"):
        check_ties(stages, plan("gpipe", workers=2, stages=4).programs)


def test_mixed_dtypes_in_a_stage_are_rejected():
    stage = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    with pytest.raises(RuntimeConfigError, match="one flat buffer per stage"):
        FlatStage(0, list(stage.parameters()), owned=True)


# --------------------------------------------------------------------------- checks and errors


def test_programs_must_match_the_stages():
    programs = plan("gpipe", workers=2).programs
    with pytest.raises(RuntimeConfigError, match="programs are for 2 stages but 3"):
        check_programs([nn.Linear(1, 1)] * 3, programs)
    # plan() refuses such a graph; check_programs stays as the runtime's own guard
    dag = dataclasses.replace(plan("gpipe", workers=2, stages=4).programs,
                              edges=[(0, 1), (0, 2), (1, 3), (2, 3)])
    with pytest.raises(RuntimeConfigError, match="chain of stages"):
        check_programs([nn.Linear(1, 1)] * 4, dag)


def test_executor_needs_an_initialized_process_group():
    from lightning_gsched.runtime import ProgramExecutor

    with pytest.raises(RuntimeConfigError, match="init_process_group"):
        ProgramExecutor([nn.Linear(1, 1)], plan("ddp", workers=1).programs)


def test_executor_refuses_an_unknown_transport():
    from lightning_gsched.runtime import ProgramExecutor

    with pytest.raises(RuntimeConfigError, match="transport='fast' is not one of"):
        ProgramExecutor([nn.Linear(1, 1)], plan("ddp", workers=1).programs, transport="fast")


def test_loss_must_be_a_scalar():
    compute = StageCompute([nn.Linear(2, 3)], num_micro=1)
    with pytest.raises(RuntimeConfigError, match="scalar tensor"):
        compute.forward(0, 0, (torch.randn(4, 2),), {}, [], lambda out, b: out)


def test_counters_cover_the_planner_metrics_by_name():
    planner = {f.name for f in fields(WorkerMetrics)} - {"worker", "busy"}
    assert set(RuntimeCounters.PLANNED) == planner
    assert set(RuntimeCounters().planned()) == planner


def test_runtime_errors_are_gsched_errors():
    assert issubclass(RuntimeFault, GschedError) and issubclass(RuntimeFault, RuntimeError)
    assert issubclass(RuntimeConfigError, GschedError) and issubclass(
        RuntimeConfigError, ValueError
    )


def test_every_op_of_the_ir_has_exactly_one_runtime_handler():
    """The runtime runs each op through one table (runtime/executor.py HANDLERS): an op the IR
    gains without a handler would fail at its first action, in the middle of a job."""
    from lightning_gsched.runtime.step_run import HANDLERS, StepRun
    from lightning_gsched.schedule.program import Op

    assert set(HANDLERS) == set(Op)
    for op, handler in HANDLERS.items():
        assert getattr(StepRun, handler.__name__) is handler, op
