"""A tensor-parallel plan resolved on the stages of a split model: which modules each stage
shards, and every refused plan named before anything is sharded.

One process: torch's fake process group stands in for T ranks (its collectives move no data),
which is all that resolving, checking and sharding need; the numerics are checked where real
ranks run.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dist_harness import WorkerContext
from lightning_gsched.errors import ScheduleConfigError, StrategyConfigError
from lightning_gsched.partition import partition
from lightning_gsched.partition.tensor_parallel import (
    TensorParallelPlanError,
    assign_plan,
    explain_sharded_failure,
    kept_whole,
    name_matches,
    parallelize_stages,
    shard_specs,
    with_kept_whole,
)
from models import ShardableAttention, gpt_inputs, make_gpt
from tie_helpers import held_parameters, with_ties

T = 2


@pytest.fixture
def tp_mesh() -> Iterator[object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=T)
    try:
        yield init_device_mesh("cpu", (T,), mesh_dim_names=("tensor_parallel",))
    finally:
        dist.destroy_process_group()


def split_gpt(shardable: bool = False) -> tuple[nn.Module, list[nn.Module]]:
    model = make_gpt(0, shardable=shardable)
    part = partition(model, 2, gpt_inputs(), verify=False)
    return model, list(part.stages)


MLP_PLAN = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}


def test_patterns_follow_parallelize_module() -> None:
    assert name_matches("blocks.*.mlp.0", "blocks.12.mlp.0")
    assert not name_matches("blocks.*.mlp.0", "blocks.1.mlp.0.weight")  # same number of parts
    assert not name_matches("blocks.*", "blocks.1.mlp")
    assert name_matches("blocks.1?.attn", "blocks.12.attn")


def test_each_stage_gets_the_entries_naming_its_modules(tp_mesh: object) -> None:
    model, stages = split_gpt()
    before = {n: p.shape for n, p in model.named_parameters()}
    assigned = parallelize_stages(stages, MLP_PLAN, tp_mesh)  # type: ignore[arg-type]
    # every block's two MLP layers, each in the stage that computes the block, none twice
    names = [n for found in assigned for n in found]
    assert sorted(names) == sorted(f"blocks.{i}.mlp.{j}" for i in range(3) for j in (0, 2))
    for stage, found in zip(stages, assigned, strict=True):
        mine = dict(stage.named_modules())
        assert all(n in mine for n in found)
    # the stages hold the model's own modules: the model is sharded in place, under its names,
    # each sharded parameter a plain Parameter holding this rank's shard
    specs = shard_specs(model)
    assert sorted(specs) == sorted(f"blocks.{i}.mlp.{j}.{k}" for i in range(3)
                                   for j in (0, 2) for k in ("weight", "bias"))
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter, name
        spec = specs.get(name)
        if spec is None:
            assert p.shape == before[name], name
            continue
        assert spec.shape == before[name]
        if name.endswith("mlp.2.bias"):  # a row-wise layer's bias is replicated
            assert spec.dim is None and p.shape == before[name]
        else:  # column-wise: output rows (weight and bias); row-wise: input columns
            assert spec.dim == (1 if name.endswith("mlp.2.weight") else 0), name
            assert p.shape[spec.dim] == before[name][spec.dim] // T, name


def test_styles_by_name_and_by_object_are_the_same(tp_mesh: object) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    _, stages = split_gpt()
    names = [list(dict(s.named_modules())) for s in stages]
    by_name = assign_plan(MLP_PLAN, names)
    by_object = assign_plan({"blocks.*.mlp.0": ColwiseParallel(),
                             "blocks.*.mlp.2": RowwiseParallel()}, names)
    assert [{n: type(s) for n, s in st.items()} for st in by_name] == \
        [{n: type(s) for n, s in st.items()} for st in by_object]


def test_a_function_plan_is_called_once_per_stage(tp_mesh: object) -> None:
    _, stages = split_gpt()
    seen: list[tuple[nn.Module, object]] = []
    parallelize_stages(stages, lambda stage, mesh: seen.append((stage, mesh)), tp_mesh)  # type: ignore[arg-type]
    assert [s for s, _ in seen] == stages and all(m is tp_mesh for _, m in seen)


@pytest.mark.parametrize("plan, words", [
    ({"blocks.*.mlp.9": "colwise"}, ["'blocks.*.mlp.9' matches no module", "blocks."]),
    # a name without the holder's prefix (under the Trainer: 'model.'): the prefixed pattern
    ({"*.mlp.0": "colwise"}, ["'*.mlp.0' matches no module", "Did you mean 'blocks.*.mlp.0'?"]),
    ({"blocks.*.ln1": "colwise"}, ["ColwiseParallel to 'blocks.0.ln1', a LayerNorm",
                                   "nn.Linear and nn.Embedding"]),
    ({"blocks.*.mlp.0": "diagonal"}, ["'diagonal' is not a tensor-parallel style", "'colwise'"]),
    ({"blocks.*.mlp.0": "colwise", "blocks.0.mlp.?": "rowwise"},
     ["'blocks.0.mlp.0' is matched by two tensor_parallel_plan patterns"]),
])
def test_a_refused_plan_names_the_problem_and_shards_nothing(
        tp_mesh: object, plan: dict[str, str], words: list[str]) -> None:
    model, stages = split_gpt()
    with pytest.raises(TensorParallelPlanError) as info:
        parallelize_stages(stages, plan, tp_mesh)  # type: ignore[arg-type]
    for w in words:
        assert w in str(info.value), str(info.value)
    assert not shard_specs(model)
    assert [p.shape for p in model.parameters()] == [p.shape for p in make_gpt(0).parameters()]


def test_a_size_the_degree_does_not_divide_is_refused(tp_mesh: object) -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 4))
    with pytest.raises(TensorParallelPlanError, match=r"'0' \(Linear, out_features=3\) cannot "
                                                      r"be split column-wise into "
                                                      r"tensor_parallel_size=2"):
        parallelize_stages([model], {"0": "colwise", "2": "rowwise"}, tp_mesh)  # type: ignore[arg-type]


def test_colwise_on_an_embedding_leaving_its_output_sharded_is_refused(tp_mesh: object) -> None:
    """``ColwiseParallel()`` (or ``"colwise"``) on an ``nn.Embedding`` shards the embedding
    dimension and leaves the output sharded there, which the norm after it read as the whole
    activation (a LayerNorm shape error at the build, with the generic causes): refused up front
    naming both fixes; with the output gathered whole, or row-wise, it shards."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    def model() -> nn.Module:
        return nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8))

    for style in ("colwise", ColwiseParallel()):
        whole = model()
        with pytest.raises(TensorParallelPlanError) as info:
            parallelize_stages([whole], {"0": style}, tp_mesh)  # type: ignore[arg-type]
        message = str(info.value)
        assert "'0' (an Embedding) ColwiseParallel" in message, message
        assert "sharded on the last dimension" in message
        assert "ColwiseParallel(output_layouts=Replicate())" in message
        assert "RowwiseParallel(input_layouts=Replicate())" in message
        assert not shard_specs(whole)
    for fits in (ColwiseParallel(output_layouts=Replicate()), "rowwise"):
        sharded = model()
        parallelize_stages([sharded], {"0": fits}, tp_mesh)  # type: ignore[arg-type]
        assert sharded(torch.randint(0, 10, (2, 3))).shape == (2, 3, 8)


# A whole transformer block tensor-parallel, as Megatron shards it: q, k, v and the MLP's first
# layer column-wise (each rank computes its heads and its slice of the hidden layer), the
# attention's output projection and the MLP's second layer row-wise (partial sums all-reduced)
BLOCK_PLAN = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise",
              "blocks.*.attn.v": "colwise", "blocks.*.attn.proj": "rowwise",
              "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}


def gpt_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))


def assert_shard_gradient(name: str, grad: torch.Tensor, full: torch.Tensor, spec: Any,
                          degree: int, index: int) -> None:
    """``grad`` (a rank's, local) equals its slice of the one-device gradient ``full``.

    Tolerance: float32 roundoff of the reordered sums only: a row-wise layer adds T partial sums
    (all-reduce) where one device adds all terms in one kernel; the longest reduction is
    4 * dim * rows = 2,048 terms, whose worst-case relative error is ~1e-4."""
    mine = full if spec is None or spec.dim is None else full.chunk(degree, spec.dim)[index]
    torch.testing.assert_close(grad, mine, rtol=1e-4, atol=1e-6,
                               msg=lambda m: f"{name}: {m}")


def sharded_stages_check(ctx: WorkerContext) -> dict[str, Any]:
    """Both ranks run the two stages of a tensor-parallel GPT in turn; each local gradient is
    compared with its slice of the gradient of the unsplit, unsharded model (same process)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("tensor_parallel",))
    (idx,) = gpt_inputs()
    reference = make_gpt(0, shardable=True)
    gpt_loss(reference(idx), idx).backward()
    model = make_gpt(0, shardable=True)
    stages = partition(model, 2, (idx,), verify=False).stages
    parallelize_stages(stages, BLOCK_PLAN, mesh)
    carried = stages[0](idx)
    # what a stage sends is plain tensors (a row-wise layer's in-flight all-reduce waited for)
    assert all(type(v) is torch.Tensor for v in carried if isinstance(v, torch.Tensor))
    loss = gpt_loss(stages[1](carried), idx)
    loss.backward()
    specs = shard_specs(model)
    wanted = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter and type(p.grad) is torch.Tensor, name  # plain tensors
        assert_shard_gradient(name, p.grad, wanted[name].grad, specs.get(name), ctx.world_size,
                              ctx.rank)
    return {"loss": loss.item(), "reference": gpt_loss(reference(idx), idx).item(),
            "sharded": sorted(n for n, s in specs.items() if s.dim is not None)}


def test_sharded_stages_train_like_one_device(worlds: Any) -> None:
    results = worlds.get(T).run(sharded_stages_check)
    for r in results:
        assert abs(r["loss"] - r["reference"]) <= 1e-5 * abs(r["reference"]), r
    # every block's q, k, v, proj and MLP weights, and the column-wise layers' biases
    expected = {f"blocks.{i}.{layer}" for i in range(3)
                for layer in ("attn.q.weight", "attn.k.weight", "attn.v.weight",
                              "attn.proj.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight")}
    assert all(set(r["sharded"]) == expected for r in results), results


class HeadNormAttention(ShardableAttention):
    """Normalises each head of q (as Qwen3's q_norm does): the norm reads this rank's heads."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        k, v = (layer(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                for layer in (self.k, self.v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).flatten(2))


def head_norm_gpt() -> nn.Module:
    model = make_gpt(0, shardable=True)
    gen = torch.Generator().manual_seed(3)
    for block in model.blocks:
        block.attn.__class__ = HeadNormAttention
        block.attn.q_norm = nn.LayerNorm(block.attn.head_dim)
        with torch.no_grad():  # not the identity, so every gradient reaching it counts
            block.attn.q_norm.weight.copy_(torch.rand(block.attn.head_dim, generator=gen) + 0.5)
    return model


def head_norm_check(ctx: WorkerContext) -> dict[str, Any]:
    """A norm over each head of a column-wise q: left whole by the plan, the build's gradient
    check refuses it on every rank; styled ``"head_norm"``, the check passes and every rank's
    gradient equals its slice of one device's (the norm's whole)."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_gsched.partition.replicated_grads import check_replicated_gradients

    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("tensor_parallel",))
    (idx,) = gpt_inputs()
    out: dict[str, Any] = {}
    for styled in (False, True):
        plan = {**BLOCK_PLAN, **({"blocks.*.attn.q_norm": "head_norm"} if styled else {})}
        model = head_norm_gpt()
        stages = list(partition(model, 2, (idx,), verify=False).stages)
        parallelize_stages(stages, plan, mesh)
        try:
            check_replicated_gradients(stages, (idx,), {}, mesh.get_group())
        except TensorParallelPlanError as exc:
            out[styled] = str(exc)
            continue
        out[styled] = None
        reference = head_norm_gpt()
        gpt_loss(reference(idx), idx).backward()
        gpt_loss(stages[1](stages[0](idx)), idx).backward()
        specs, wanted = shard_specs(model), dict(reference.named_parameters())
        for name, p in model.named_parameters():
            assert_shard_gradient(name, p.grad, wanted[name].grad, specs.get(name),
                                  ctx.world_size, ctx.rank)
    return out


def test_a_parameter_left_whole_that_reads_a_shard_is_refused(worlds: Any) -> None:
    for out in worlds.get(T).run(head_norm_check):
        assert out[True] is None, out
        assert out[False] is not None and "'blocks.0.attn.q_norm.weight'" in out[False], out
        assert "'head_norm'" in out[False] and "gradient differs" in out[False], out
        assert "q_norm.bias" in out[False], out  # its bias too: it adds to each head


def test_code_that_needs_global_sizes_is_named_by_the_module_before_it(tp_mesh: object) -> None:
    """The test GPT splits its fused qkv by the full width: on a column-wise shard the split
    yields two pieces, and the error names the layer whose output it was reading."""
    model, stages = split_gpt()
    parallelize_stages(stages, {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise"},
                       tp_mesh)  # type: ignore[arg-type]
    (idx,) = gpt_inputs()
    with pytest.raises(TensorParallelPlanError) as info:
        explain_sharded_failure(stages[0], T, lambda: stages[0](idx))
    message = str(info.value)
    assert "right after 'blocks.0.attn.qkv' ran (a module the plan shards)" in message, message
    assert "IndexError" in message and "write -1 for the sharded dimension" in message
    # code written for shards runs, and its result comes back unchanged
    _, shardable = split_gpt(shardable=True)
    parallelize_stages(shardable, BLOCK_PLAN, tp_mesh)  # type: ignore[arg-type]
    carried = explain_sharded_failure(shardable[0], T, lambda: shardable[0](idx))
    assert isinstance(carried, tuple) and carried



def test_the_split_keeps_the_plans_modules_and_their_holders_whole(tp_mesh: object) -> None:
    """The test GPT's attention joins its heads with the count read from a tensor's shape (as
    transformers' code does): right on a shard when run as written. A stage traced with the
    example's sizes fixed (``static_shapes=True``, the mode transformers' models need) replays
    the global count and fails once sharded; with what :func:`kept_whole` names (the styled
    modules and their holders, never a container) kept whole, the sharded stage runs."""
    plan = {**BLOCK_PLAN, "blocks.0": "sequence_input", "ln_f": "sequence"}
    kept = kept_whole(make_gpt(0, shardable=True), plan)
    blocks = [f"blocks.{i}" for i in range(3)]
    assert set(kept) == {"blocks.0", "ln_f"} | {
        f"{b}.{m}" for b in blocks for m in ("attn", "attn.q", "attn.k", "attn.v", "attn.proj",
                                             "mlp.0", "mlp.2")}, kept  # not blocks, mlp, root
    assert kept_whole(make_gpt(0), lambda stage, mesh: None) == ()  # a function: not known
    (idx,) = gpt_inputs()
    for leaves in ((), kept_whole(make_gpt(0, shardable=True), BLOCK_PLAN)):
        part = partition(make_gpt(0, shardable=True), 2, (idx,), verify=False,
                         static_shapes=True, leaf_modules=leaves)
        first = part.stages[0]
        parallelize_stages(list(part.stages), BLOCK_PLAN, tp_mesh)  # type: ignore[arg-type]
        if not leaves:
            with pytest.raises(TensorParallelPlanError, match=(
                    r"right after 'blocks.0.attn.v'.*traced into 'blocks.0.attn'.*"
                    r"leaf_modules=\('ShardableAttention',\)")):
                explain_sharded_failure(first, T, partial(first, idx))
            continue
        assert "blocks.0.attn" in first.called_modules()  # type: ignore[operator]
        carried = explain_sharded_failure(first, T, partial(first, idx))
        # the residual stream handed on at its whole width (the mask goes with it)
        assert [tuple(c.shape) for c in carried if c.dim() == 3] == [(*idx.shape, 32)], carried


def test_a_style_on_a_module_the_split_runs_inline_is_refused(tp_mesh: object) -> None:
    """A style on a block the trace went into (its code inlined in the stage, its hooks never
    run) is refused naming the block and ``leaf_modules``; kept whole by ``leaf_modules``, the
    stages call it and the style applies."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    def prepare() -> Any:
        return PrepareModuleInput(input_layouts=(Replicate(), None),
                                  desired_input_layouts=(Shard(1), None), use_local_output=True)

    _, stages = split_gpt(shardable=True)
    with pytest.raises(TensorParallelPlanError, match=r"'blocks.0' \(GPTBlock\) with "
                                                      r"PrepareModuleInput.*leaf_modules="
                                                      r"\('GPTBlock',\)"):
        parallelize_stages(stages, {"blocks.0": prepare()}, tp_mesh)  # type: ignore[arg-type]
    kept = partition(make_gpt(0, shardable=True), 2, gpt_inputs(), verify=False,
                     leaf_modules=("GPTBlock",))
    assert "blocks.0" in kept.stages[0].called_modules()  # type: ignore[operator]
    parallelize_stages(list(kept.stages), {"blocks.0": prepare()}, tp_mesh)  # type: ignore[arg-type]


def test_sequence_parallel_styles_by_name() -> None:
    """The names a YAML plan uses for sequence parallelism are torch's styles with the
    sequence layouts (or ours, for the first block's input), and an unknown name lists them."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    from lightning_gsched.partition.sequence_input import SequenceGather, SequenceInput
    from lightning_gsched.partition.tensor_parallel import STYLE_NAMES, style_of

    gather = style_of("colwise_from_sequence", "p")
    assert type(gather) is ColwiseParallel and gather.input_layouts == (Shard(1),)
    assert gather.output_layouts == (Shard(-1),)  # its output stays sharded by columns
    scatter = style_of("rowwise_to_sequence", "p")
    assert type(scatter) is RowwiseParallel and scatter.output_layouts == (Shard(1),)
    assert scatter.input_layouts == (Shard(-1),)
    assert type(style_of("sequence", "p")) is SequenceParallel
    cut = style_of("sequence_input", "p")
    assert type(cut) is SequenceInput and cut.dim == 1
    gather_once = style_of("sequence_gather", "p")
    assert type(gather_once) is SequenceGather and gather_once.dim == 1
    join = style_of("sequence_output", "p")
    assert type(join) is PrepareModuleOutput
    assert join.output_layouts == (Shard(1),) and join.desired_output_layouts == (Replicate(),)
    assert style_of("COLWISE_FROM_SEQUENCE", "p").input_layouts == (Shard(1),)
    with pytest.raises(TensorParallelPlanError) as info:
        style_of("sequence_in", "blocks.0")
    assert all(repr(name) in str(info.value) for name in STYLE_NAMES), str(info.value)


class _TwoInputs(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, mask


def test_sequence_input_cuts_the_first_input_and_passes_the_rest(tp_mesh: object) -> None:
    """``"sequence_input"`` on a module called with two inputs (what ``PrepareModuleInput``
    could only do with one layout per input): this rank's (0 of 2) half of the sequence of the
    first, the second unchanged; a first input without a sequence dimension, or with one that
    does not split evenly, is refused."""
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_gsched.partition.sequence_input import SequenceInputError
    from lightning_gsched.partition.tensor_parallel import style_of

    module = parallelize_module(_TwoInputs(), tp_mesh,  # type: ignore[arg-type]
                                style_of("sequence_input", ""))
    x, mask = torch.arange(2 * 6 * 3.0).reshape(2, 6, 3), torch.ones(6, 6, dtype=torch.bool)
    got, passed = module(x, mask)
    assert torch.equal(got, x[:, :3]) and passed is mask
    with pytest.raises(SequenceInputError, match="_TwoInputs.*dimension 1.*shape \\(4,\\)"):
        module(torch.ones(4), mask)
    # 5 positions do not split into 2 equal parts, which the sequence-sharded styles assume
    with pytest.raises(SequenceInputError, match="has 5 .*divisible by 2"):
        module(torch.ones(2, 5, 3), mask)


def test_sequence_gather_hands_on_the_whole_sequence_replicated(tp_mesh: object) -> None:
    """``"sequence_gather"``: the first input (this rank's part, plain) becomes a ``DTensor``
    of the whole sequence, replicated, which the plain column-wise layers inside read without
    gathering again; the second input passes unchanged. (The fake group moves no data: the
    values are checked by the launched sequence-parallel training.)"""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_gsched.partition.tensor_parallel import style_of

    module = parallelize_module(_TwoInputs(), tp_mesh,  # type: ignore[arg-type]
                                style_of("sequence_gather", ""))
    mask = torch.ones(6, 6, dtype=torch.bool)
    got, passed = module(torch.ones(2, 3, 4), mask)
    assert isinstance(got, DTensor) and got.placements == (Replicate(),)
    assert got.shape == (2, 6, 4) and got.to_local().shape == (2, 6, 4) and passed is mask


class _Attention(nn.Module):
    """Named by its first parameter, as transformers' attention: ``forward(hidden_states, ...)``."""

    def forward(self, hidden_states: torch.Tensor,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return hidden_states, mask


class _ByKeyword(nn.Module):
    """transformers' decoder layer: ``self.self_attn(hidden_states=hidden_states, ...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attention()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self.self_attn(mask=mask, hidden_states=x)


@pytest.mark.parametrize("name", ["sequence_gather", "sequence_input"])
def test_sequence_styles_take_the_first_input_passed_by_keyword(tp_mesh: object,
                                                                name: str) -> None:
    """A module called with its first input by keyword only (transformers' decoder layer calls
    its attention ``self.self_attn(hidden_states=..., ...)``): the style takes the forward's
    first parameter from the keywords (it used to say the module "got nothing"); a call that
    passes neither it nor a positional input is refused naming the keywords it saw."""
    from torch.distributed.tensor import DTensor, Replicate

    from lightning_gsched.partition.sequence_input import SequenceInputError

    stage = _ByKeyword()
    parallelize_stages([stage], {"self_attn": name}, tp_mesh)  # type: ignore[arg-type]
    mask = torch.ones(6, 6, dtype=torch.bool)
    got, passed = stage(torch.arange(2 * 6 * 4.0).reshape(2, 6, 4), mask)
    if name == "sequence_gather":  # this rank's part (2, 6, 4) of 2 ranks' (2, 12, 4)
        assert isinstance(got, DTensor) and got.placements == (Replicate(),)
        assert got.shape == (2, 12, 4)
    else:
        assert not isinstance(got, DTensor)
        assert torch.equal(got, torch.arange(2 * 6 * 4.0).reshape(2, 6, 4)[:, :3])
    assert passed is mask
    with pytest.raises(SequenceInputError,
                       match=r"_Attention.*'hidden_states', the first parameter of its forward"
                             r".*no positional input and keyword arguments 'mask'"):
        stage.self_attn(mask=mask)
    with pytest.raises(SequenceInputError, match=r"keyword 'hidden_states'.*shape \(4,\)"):
        stage.self_attn(hidden_states=torch.ones(4))


def test_sequence_parallel_on_a_tiny_llama_by_name(tp_mesh: object) -> None:
    """The plan docs/tensor_parallel.md gives for transformers' Llama, by name, on a tiny
    ``LlamaForCausalLM`` split in two: the decoder layer passes ``hidden_states`` to its
    attention by keyword, which ``"sequence_gather"`` takes, and the sharded stages run. (The
    fake group moves no data: values are checked where real ranks run.)"""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    layers = "model.layers"
    plan = {f"{layers}.0": "sequence_input", f"{layers}.*.input_layernorm": "sequence",
            f"{layers}.*.post_attention_layernorm": "sequence",
            f"{layers}.*.self_attn": "sequence_gather",
            f"{layers}.*.self_attn.q_proj": "colwise", f"{layers}.*.self_attn.k_proj": "colwise",
            f"{layers}.*.self_attn.v_proj": "colwise",
            f"{layers}.*.self_attn.o_proj": "rowwise_to_sequence",
            f"{layers}.*.mlp": "sequence_gather", f"{layers}.*.mlp.gate_proj": "colwise",
            f"{layers}.*.mlp.up_proj": "colwise", f"{layers}.*.mlp.down_proj": "rowwise_to_sequence",
            f"{layers}.1": "sequence_output"}
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    part = partition(model, 2, (ids,), verify=False,
                     leaf_modules=with_kept_whole((), model, plan))
    stages = list(part.stages)
    parallelize_stages(stages, plan, tp_mesh)  # type: ignore[arg-type]
    carried = stages[0](ids)
    out = stages[1](carried)
    logits = out["logits"] if isinstance(out, dict) else out.logits
    assert logits.shape == (2, 8, 64)


def test_an_uneven_cut_by_prepare_module_input_is_refused(tp_mesh: object) -> None:
    """torch's own ``PrepareModuleInput`` cutting a whole input by sequence (a plan written with
    objects, as torchtitan's): a length T does not divide is refused before torch cuts it
    (its unequal parts made the next gather abort the process); an even one is cut as before."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    stage = nn.Sequential()
    stage.add_module("block", _TwoInputs())
    cut = PrepareModuleInput(input_layouts=(Replicate(), None),
                             desired_input_layouts=(Shard(1), None), use_local_output=True)
    parallelize_stages([stage], {"block": cut}, tp_mesh)  # type: ignore[arg-type]
    mask = torch.ones(4, 4, dtype=torch.bool)
    assert stage.block(torch.ones(2, 4, 3), mask)[0].shape == (2, 2, 3)
    with pytest.raises(TensorParallelPlanError,
                       match=r"'block'.*input 0 of shape \(2, 5, 3\).*5 does not divide"):
        stage.block(torch.ones(2, 5, 3), mask)


def test_sequence_input_goes_when_the_stage_is_made_whole(tp_mesh: object) -> None:
    """Applied to a stage by the plan, ``"sequence_input"``'s hook is recorded with torch's
    styles' own and removed when the shards are forgotten: a forward after the run sees the
    whole input again."""
    from lightning_gsched.partition.tensor_parallel import forget_shards

    stage = nn.Sequential()
    stage.add_module("block", _TwoInputs())
    parallelize_stages([stage], {"block": "sequence_input"}, tp_mesh)  # type: ignore[arg-type]
    x, mask = torch.ones(2, 4, 3), torch.ones(4, 4, dtype=torch.bool)
    assert stage.block(x, mask)[0].shape == (2, 2, 3)
    forget_shards(stage)
    assert not stage.block._forward_pre_hooks
    assert stage.block(x, mask)[0] is x


def test_a_sequence_style_beside_whole_activation_styles_is_explained(tp_mesh: object) -> None:
    """``"sequence"`` on the norms with the names ``colwise``/``rowwise`` for the rest: the
    norms' outputs are split by sequence where the projections expect whole activations, and
    the check's error says so, naming the sequence-sharded patterns."""
    from lightning_gsched.partition.tensor_parallel import sequence_patterns

    plan = {**BLOCK_PLAN, "blocks.*.ln1": "sequence", "blocks.*.ln2": "sequence"}
    assert sequence_patterns(plan) == ["blocks.*.ln1", "blocks.*.ln2"]  # type: ignore[arg-type]
    assert sequence_patterns(BLOCK_PLAN) == []  # type: ignore[arg-type]
    _, stages = split_gpt(shardable=True)
    parallelize_stages(stages, plan, tp_mesh)  # type: ignore[arg-type]
    (idx,) = gpt_inputs()
    with pytest.raises(TensorParallelPlanError) as info:
        explain_sharded_failure(stages[0], T, lambda: stages[0](idx),
                                sequence_patterns(plan))  # type: ignore[arg-type]
    message = str(info.value)
    assert "'blocks.*.ln1', 'blocks.*.ln2' by sequence" in message, message
    assert "ColwiseParallel(input_layouts=Shard(1))" in message



def pipelined_sharded_check(ctx: WorkerContext, schedule: str) -> dict[str, Any]:
    """W=4 as P=2 pipeline workers x T=2 tensor-parallel ranks (rank = worker * 2 + t): the
    runtime runs worker w's program on both of its ranks, each on its shards, messages going to
    the same t of the peer worker (Channels(tensor_parallel_size=2)). Each local gradient is
    compared with its slice of the one-device gradient of the mean loss over the microbatches."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_gsched.runtime import ProgramExecutor
    from lightning_gsched.runtime.channels import Channels
    from lightning_gsched.schedule import plan

    T_ = 2
    mesh = init_device_mesh("cpu", (ctx.world_size // T_, T_),
                            mesh_dim_names=("pipeline", "tensor_parallel"))
    planned = plan(schedule, workers=ctx.world_size // T_, microbatches=4,
                   stages=4 if schedule == "zbv" else 2)
    micro = {b: gpt_inputs(seed=10 + b)[0] for b in range(planned.micro)}
    reference = make_gpt(0, shardable=True)
    for idx in micro.values():
        (gpt_loss(reference(idx), idx) / len(micro)).backward()
    model = make_gpt(0, shardable=True)
    part = partition(model, planned.stages, (micro[0],), verify=False)
    parallelize_stages(part.stages, BLOCK_PLAN, mesh["tensor_parallel"])
    programs = with_ties(planned, part).programs
    ex = ProgramExecutor(part.stages, programs, timeout=60,
                         channels=Channels(programs, timeout=60, tensor_parallel_size=T_))
    ex.step({b: ((idx,), {}) for b, idx in micro.items()},
            lambda out, b: gpt_loss(out, micro[b]))
    specs, wanted, t = shard_specs(model), dict(reference.named_parameters()), ctx.rank % T_
    name_of = {id(p): n for n, p in model.named_parameters()}
    checked = []
    for p in held_parameters(ex):
        name = name_of[id(p)]
        assert_shard_gradient(name, p.grad, wanted[name].grad, specs.get(name), T_, t)
        checked.append(name)
    ex.close()
    return {"worker": ex.rank, "checked": len(checked)}


# 1f1b: owned stages; zbv: two stages per worker in a V and the split backward (B, then W);
# fsdp: every worker fetches the other's stage, flat buffers of local shards
@pytest.mark.parametrize("schedule", ["1f1b", "zbv", "fsdp"])
def test_pipeline_of_tensor_parallel_workers_trains_like_one_device(worlds: Any,
                                                                     schedule: str) -> None:
    results = worlds.get(4).run(pipelined_sharded_check, schedule)
    assert [r["worker"] for r in results] == [0, 0, 1, 1]
    assert all(r["checked"] > 0 for r in results), results


# ---------------------------------------------------------------------------- the front ends' checks


def test_the_front_ends_refuse_a_size_without_a_plan_and_a_plan_without_a_size() -> None:
    from lightning_gsched import GeneralParallel
    from lightning_gsched.fabric import GeneralParallelFabric

    for front_end in (GeneralParallel, GeneralParallelFabric):
        with pytest.raises(TensorParallelPlanError, match="needs a tensor_parallel_plan"):
            front_end("1f1b", tensor_parallel_size=2)
        with pytest.raises(TensorParallelPlanError, match="tensor_parallel_size=1"):
            front_end("1f1b", tensor_parallel_plan={"blocks.*.attn.q": "colwise"})
        with pytest.raises(TensorParallelPlanError, match="not a tensor-parallel style"):
            front_end("1f1b", tensor_parallel_size=2, tensor_parallel_plan={"x": "diagonal"})


def test_a_size_that_does_not_divide_the_ranks_is_refused_at_setup() -> None:
    from lightning_gsched import GeneralParallel

    strategy = GeneralParallel("1f1b", tensor_parallel_size=4,
                               tensor_parallel_plan={"blocks.*.attn.q": "colwise"})
    with pytest.raises(ScheduleConfigError, match=r"tensor_parallel_size=4 does not divide "
                                                  r"the W=6 ranks.*\[1, 2, 3, 6\]"):
        strategy.schedule_config.check(6)
    replicas = GeneralParallel("1f1b", tensor_parallel_size=2, data_parallel_size=4,
                               tensor_parallel_plan={"blocks.*.attn.q": "colwise"})
    with pytest.raises(ScheduleConfigError, match=r"W / tensor_parallel_size = 2 workers.*"
                                                  r"data_parallel_size=4 does not divide"):
        replicas.schedule_config.check(4)
    assert strategy.schedule_config.training_plan(8).workers == 2  # W / T


def test_auto_keeps_the_users_tensor_parallel_size_and_checks_it() -> None:
    """``"auto"`` with T: T is the user's (the tuner plans the W / T workers), checked at
    setup like a named schedule's; a cut by each rank's own timings is refused before any
    collective (worker 0's ranks profile each cut together, so they must cut alike)."""
    from lightning_gsched import GeneralParallel
    from lightning_gsched.engine.auto import TensorParallelTuning, choose_schedule
    from lightning_gsched.engine.options import PartitionOptions

    plan = {"blocks.*.attn.q": "colwise"}
    config = GeneralParallel("auto", tensor_parallel_size=2,
                             tensor_parallel_plan=plan).schedule_config
    assert config.tensor_parallel_size == 2 and config.is_auto
    config.check(8)
    with pytest.raises(ScheduleConfigError, match="tensor_parallel_size=2 does not divide the W=7"):
        config.check(7)
    fixed_g = GeneralParallel("auto", data_parallel_size=3, tensor_parallel_size=2,
                              tensor_parallel_plan=plan).schedule_config
    with pytest.raises(ScheduleConfigError, match="data_parallel_size=3 does not divide the W=4"):
        fixed_g.check(8)  # G must divide the W / T = 4 workers
    fixed_r = GeneralParallel("auto", R=3, tensor_parallel_size=2,
                              tensor_parallel_plan=plan).schedule_config
    with pytest.raises(ScheduleConfigError,
                       match="R=3 does not divide the 4 workers of tensor_parallel_size=2 ranks"):
        fixed_r.check(8)
    model = make_gpt(0, shardable=True)
    args = gpt_inputs(2)
    with pytest.raises(StrategyConfigError, match="balance='time'"):
        choose_schedule(model, config, PartitionOptions(balance="time"), args, {}, loss_fn=None,
                        global_rows=8, optimizers=[], world_size=4, rank=0,
                        tensor_parallel=TensorParallelTuning((2,), plan, "cpu", 10.0))


def test_auto_searches_a_list_of_sizes_or_auto() -> None:
    """``tensor_parallel_size=[1, 2]`` or ``"auto"`` under ``"auto"``: a search (T is 1 until
    the pick, every rank loads its own share), each T checked to divide W at setup; one value
    in a list is that T; a named schedule refuses a search, and a search needs a plan."""
    from lightning_gsched import GeneralParallel
    from lightning_gsched.engine.options import sampler_kwargs

    plan = {"blocks.*.attn.q": "colwise"}
    searched = GeneralParallel("auto", tensor_parallel_size=[1, 2],
                               tensor_parallel_plan=plan).schedule_config
    assert searched.rows_per_rank and searched.tensor_parallel_size == 1
    assert searched.tensor_parallel_candidates(8) == (1, 2)
    searched.check(6)
    assert sampler_kwargs(4, 3, searched) == {"num_replicas": 4, "rank": 3}  # each rank its own
    fixed = GeneralParallel("auto", tensor_parallel_size=2, tensor_parallel_plan=plan)
    assert sampler_kwargs(4, 3, fixed.schedule_config) == {"num_replicas": 2, "rank": 1}
    with pytest.raises(ScheduleConfigError, match=r"tensor_parallel_size=4 does not divide the "
                                                  r"W=6"):
        GeneralParallel("auto", tensor_parallel_size=[1, 4],
                        tensor_parallel_plan=plan).schedule_config.check(6)
    every = GeneralParallel("auto", tensor_parallel_size="auto",
                            tensor_parallel_plan=plan).schedule_config
    assert every.rows_per_rank
    assert every.tensor_parallel_candidates(12) == (1, 2, 4)
    assert every.tensor_parallel_candidates(16) == (1, 2, 4, 8)
    one = GeneralParallel("auto", tensor_parallel_size=[2], tensor_parallel_plan=plan)
    assert one.schedule_config.tensor_parallel_size == 2 and not one.schedule_config.rows_per_rank
    with pytest.raises(ScheduleConfigError, match="schedule='auto' does"):
        GeneralParallel("1f1b", tensor_parallel_size=[1, 2], tensor_parallel_plan=plan)
    with pytest.raises(TensorParallelPlanError, match="needs a tensor_parallel_plan"):
        GeneralParallel("auto", tensor_parallel_size=[1, 2])
    with pytest.raises(ScheduleConfigError, match=r"names no T"):
        GeneralParallel("auto", tensor_parallel_size=[], tensor_parallel_plan=plan)


def test_the_search_over_sizes_takes_the_fastest_fitting_pick() -> None:
    """The fastest fitting pick over every T tried wins and its text says what each T gave; a
    T that could not be planned is skipped with its reason; none planned is an error naming
    each T's reason."""
    from types import SimpleNamespace

    from lightning_gsched.engine.auto import best_over_sizes

    def pick(schedule: str, ms: float) -> Any:
        result = SimpleNamespace(best=SimpleNamespace(step_time=ms / 1e3))
        return (SimpleNamespace(schedule=schedule), f"{schedule}'s table", result)

    chosen, text, _ = best_over_sizes({1: pick("ddp", 12.0), 2: pick("1f1b", 9.5),
                                       4: "TensorParallelPlanError: 6 heads"})
    assert chosen.schedule == "1f1b"
    assert "T=1: ddp, predicted 12.0 ms" in text and "T=2: 1f1b, predicted 9.5 ms" in text
    assert "T=4: skipped (TensorParallelPlanError: 6 heads)" in text
    assert "picked T=2" in text and text.endswith("1f1b's table")
    alone = pick("zbv", 3.0)
    assert best_over_sizes({2: alone}) is alone  # one T: its pick as it is
    with pytest.raises(ScheduleConfigError, match=r"T=1: no fit; T=2: no cut"):
        best_over_sizes({1: "no fit", 2: "no cut"})


def test_ranks_map_to_workers_and_a_worker_must_load_one_batch() -> None:
    """W=6 as 3 workers of T=2: rank 3 is worker 1's t=1, its peers the t=1 ranks; a list
    gathered over ranks keeps each worker's t=0 entry; ranks of one worker that loaded
    different rows are named."""
    from lightning_gsched.engine.workers import Workers

    workers = Workers(6, 3, 2)
    assert (workers.count, workers.worker, workers.reports) == (3, 1, False)
    assert workers.peers() == [1, 3, 5]
    assert Workers(6, 4, 2).reports and Workers(4, 2, 1).peers() == [0, 1, 2, 3]
    assert workers.batch_rows([4, 4, 2, 2, 3, 3], [7] * 6) == ([4, 2, 3], [7, 7, 7])
    with pytest.raises(StrategyConfigError, match=r"ranks \[2, 3\] of pipeline worker 1 "
                                                  r"loaded different batches \(\[2, 1\] rows\)"):
        workers.batch_rows([4, 4, 2, 1, 3, 3], [7] * 6)
    assert workers.shares_batches and not Workers(6, 3, 2, rows_per_rank=True).shares_batches
    assert workers.batch_rows([4] * 6, [7] * 6, [1, 1, 5, 5, 9, 9]) == ([4] * 3, [7] * 3)
    with pytest.raises(StrategyConfigError, match=r"ranks \[4, 5\] of pipeline worker 2 loaded "
                                                  r"different batches \(as many rows, other "
                                                  r"values\).*rank = global rank // T"):
        workers.batch_rows([4] * 6, [7] * 6, [1, 1, 5, 5, 9, 8])
    # rows dealt per rank (a searched T): the row arithmetic's positions are the ranks, a
    # worker's batch its ranks' rows in t order, a microbatch read by each of its ranks
    per_rank = Workers(6, 3, 2, rows_per_rank=True)
    assert (per_rank.positions, per_rank.position, per_rank.worker) == (6, 3, 1)
    assert per_rank.members([1, 2]) == [2, 3, 4, 5] and per_rank.peers() == list(range(6))
    assert per_rank.by_position([["a"], ["b"], ["c"]]) == [["a"], ["a"], ["b"], ["b"], ["c"],
                                                          ["c"]]
    assert per_rank.batch_rows([4, 4, 2, 1, 3, 3], [7] * 6) == ([4, 4, 2, 1, 3, 3], [7] * 6)


def test_a_batch_fingerprint_tells_loaded_shares_apart() -> None:
    """:func:`content_fingerprint` is equal for equal batches (any dtype, also a copy laid out
    otherwise) and differs when one row, one value or the order of rows differs."""
    from lightning_gsched.engine.batches import content_fingerprint

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50_000, (16, 300), generator=gen)  # more than the sample's 4096
    batch = {"x": tokens, "img": torch.randn(16, 3, 8, 8, generator=gen).bfloat16(),
             "mask": torch.rand(16, 300, generator=gen) > 0.5, "flag": 1}
    same = {k: v.t().contiguous().t() if torch.is_tensor(v) and v.dim() == 2 else v
            for k, v in batch.items()}  # equal values, another memory layout
    fingerprint = int(content_fingerprint(batch))
    assert int(content_fingerprint(same)) == fingerprint
    other_row = dict(batch, x=torch.cat([tokens[:15], tokens[:1]]))
    one_value = dict(batch, img=batch["img"].clone())
    one_value["img"][0, 0, 0, 0] += 1
    swapped = dict(batch, x=tokens.flip(0))
    for changed in (other_row, one_value, swapped):
        assert int(content_fingerprint(changed)) != fingerprint


def test_a_batch_stamp_survives_a_float64_exchange() -> None:
    """:func:`batch_stamp` (``data_loading="per_replica"``'s after-step check) gives numbers
    that a float64 all-reduce carries exactly (integers below 2**52), equal for equal batches
    and different for another row count, layout or values."""
    from lightning_gsched.engine.batches import batch_stamp, rows_and_layouts

    gen = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 50_000, (8, 65), generator=gen), torch.randn(8, 4, generator=gen))

    def numbers(b: tuple[torch.Tensor, ...]) -> list[float]:
        rows, layouts, _ = rows_and_layouts(b, 1)  # as the step's start reads them
        stamp = batch_stamp(b, rows[0], layouts[0])
        packed = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in stamp])
        return packed.tolist()  # what the exchange's one host read returns

    mine = numbers(batch)
    assert all(v == int(v) and 0 <= v < 2**52 for v in mine)
    assert mine[0] == 8 and numbers(tuple(t.clone() for t in batch)) == mine
    changed = batch[1].clone()
    changed[3, 2] += 1
    for other in ((batch[0][:6], batch[1][:6]), (batch[0], batch[1].double()),
                  (batch[0], changed)):
        assert numbers(other) != mine


def test_the_tuners_table_counts_ranks_and_workers_with_tensor_parallelism() -> None:
    """``"auto"`` with T tunes W / T workers; its table must not read as a run on W / T ranks."""
    from lightning_gsched.schedule.tune import TuneResult

    plain = TuneResult([], None, 2, 8).table().splitlines()[0]
    sharded = TuneResult([], None, 2, 8, tensor_parallel_size=2).table().splitlines()[0]
    assert plain.startswith("gsched tune: W=2, global batch 8 rows"), plain
    assert sharded.startswith("gsched tune: W=4 (2 workers of T=2 ranks), global batch 8 rows"), \
        sharded


def test_rowwise_by_name_on_an_embedding_takes_its_token_ids_whole(tp_mesh: object) -> None:
    """torch's ``RowwiseParallel()`` takes its input as this rank's slice of the last dimension;
    on an embedding, whose input is token ids whole on every rank, it would gather T copies
    into a sequence T times as long and train on it silently. The name fits the style to the
    module; a style object that does this is refused, naming the fix."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    ids = torch.randint(0, 64, (2, 4))
    stage = nn.Sequential(nn.Embedding(64, 32))
    parallelize_stages([stage], {"0": "rowwise"}, tp_mesh)  # type: ignore[arg-type]
    assert tuple(stage(ids).shape) == (2, 4, 32)
    with pytest.raises(TensorParallelPlanError, match=r"'0' \(an Embedding\).*"
                       r"RowwiseParallel\(input_layouts=Replicate\(\)\)"):
        parallelize_stages([nn.Sequential(nn.Embedding(64, 32))], {"0": RowwiseParallel()},
                           tp_mesh)  # type: ignore[arg-type]


class _LightningLike(nn.Module):
    """A root holding the network as ``self.model``, as a LightningModule does."""

    def __init__(self) -> None:
        super().__init__()
        self.model = make_gpt(0, shardable=True)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)  # type: ignore[no-any-return]


def test_a_module_whose_style_gives_its_output_whole_keeps_no_holder_whole() -> None:
    """Kept whole, the holder of ``model.wte`` would be the whole network (one unit: no split).
    A column-wise style with a ``Replicate`` output hands its holder whole sizes, so only the
    styled module is kept, and the model still splits; a sharded output keeps the holder."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    root = _LightningLike()
    whole = {"model.wte": ColwiseParallel(output_layouts=Replicate())}
    assert kept_whole(root, whole) == ("model.wte",)
    part = partition(root, 2, gpt_inputs(), verify=False, leaf_modules=kept_whole(root, whole))
    assert len(part.stages) == 2
    assert kept_whole(root, {"model.wte": "colwise"}) == ("model.wte", "model")
    assert "model.blocks.0.attn" in kept_whole(  # row-wise output whole, the q's shard not
        root, {"model.blocks.*.attn.q": "colwise", "model.blocks.*.attn.proj": "rowwise"})


@pytest.mark.parametrize("tie, plan, refusal", [
    ("module", {"head": "colwise"}, r"'head', whose weight is tied to 'wte'"),
    ("functional", {"wte": "rowwise"},
     r"'wte' \(Embedding\), whose weight a stage reads directly as a tensor"),
])
def test_a_style_on_a_tied_weight_is_refused_naming_the_tie(tp_mesh: object, tie: str,
                                                            plan: dict, refusal: str) -> None:
    """Tied embeddings: sharded for one module, the one Parameter would be sharded for the
    other, whose code reads it whole (the embedding looks up every token; the head projects to
    the whole vocabulary). Refused before anything is sharded, naming the tie, where the
    sharded run used to fail later with advice about head counts (a module tie), or call the
    last stage's read-only Embedding "a ModuleShell" (a functional one)."""
    part = partition(make_gpt(0, tie=tie), 2, gpt_inputs(), verify=False)
    with pytest.raises(TensorParallelPlanError, match=refusal):
        parallelize_stages(list(part.stages), plan, tp_mesh)  # type: ignore[arg-type]


def sharded_output_check(ctx: WorkerContext) -> dict[str, Any]:
    """An untied head styled column-wise: by name its output stays sharded (each rank its slice
    of the vocabulary), with ``output_layouts=Replicate()`` it is whole. The build's check run,
    per plan: its refusal, or None."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    from lightning_gsched.partition.replicated_grads import check_replicated_gradients

    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("tensor_parallel",))
    (idx,) = gpt_inputs()
    out: dict[str, Any] = {}
    for label, head in (("sharded", "colwise"),
                        ("whole", ColwiseParallel(output_layouts=Replicate()))):
        model = make_gpt(0, shardable=True, tie="module")
        model.head.weight = nn.Parameter(model.wte.weight.detach().clone())  # untied
        stages = list(partition(model, 2, (idx,), verify=False).stages)
        parallelize_stages(stages, {**BLOCK_PLAN, "head": head}, mesh)
        try:
            check_replicated_gradients(stages, (idx,), {}, mesh.get_group())
            out[label] = None
        except TensorParallelPlanError as exc:
            out[label] = str(exc)
    return out


def test_a_model_output_a_style_leaves_sharded_is_refused(worlds: Any) -> None:
    """The loss reads the model's output whole; left sharded it would fail inside the user's
    loss as an index out of bounds (or compute a wrong loss): the build names the style."""
    for out in worlds.get(T).run(sharded_output_check):
        assert out["whole"] is None, out
        assert out["sharded"] is not None and "model's output" in out["sharded"], out
        assert "ColwiseParallel(output_layouts=Replicate())" in out["sharded"], out


class FixedHeadCountAttention(ShardableAttention):
    """Heads fixed, head size inferred: ``view(b, t, heads, -1)``. On one device the same as
    :class:`ShardableAttention`; on a column-wise shard it runs without an error, reading each
    rank's columns as ``heads`` heads of half the size: other values, silently."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        heads = c // self.head_dim
        q, k, v = (layer(x).view(b, t, heads, -1).transpose(1, 2)
                   for layer in (self.q, self.k, self.v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).flatten(2))


def fixed_heads_check(ctx: WorkerContext) -> dict[str, Any]:
    """The build's output check (partition/sharded_outputs.py) on the GPT with local heads and
    with a fixed head count: its refusal per model, or None."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_gsched.partition.replicated_grads import check_replicated_gradients
    from lightning_gsched.partition.sharded_outputs import check_sharded_outputs, record_outputs

    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("tensor_parallel",))
    (idx,) = gpt_inputs()
    out: dict[str, Any] = {}
    for label in ("local heads", "fixed heads"):
        model = make_gpt(0, shardable=True)
        if label == "fixed heads":
            for block in model.blocks:
                block.attn.__class__ = FixedHeadCountAttention
        stages = list(partition(model, 2, (idx,), verify=False).stages)
        whole = record_outputs(stages, (idx,), {})
        parallelize_stages(stages, BLOCK_PLAN, mesh)
        check_replicated_gradients(stages, (idx,), {}, mesh.get_group())  # all ranks agree
        try:
            check_sharded_outputs(stages, (idx,), {}, whole, mesh.get_group())
            out[label] = None
        except TensorParallelPlanError as exc:
            out[label] = str(exc)
    return out


def test_code_that_runs_sharded_but_computes_otherwise_is_refused(worlds: Any) -> None:
    """A fixed head count with an inferred head size runs on a shard without an error and every
    rank agrees with the others, so only a comparison with the whole stages finds it: the build
    refuses it on every rank, naming the first output that differs (found by probing: it
    trained 7.5e-4 away from one device). The model written with local heads passes."""
    for out in worlds.get(T).run(fixed_heads_check):
        assert out["local heads"] is None, out
        assert out["fixed heads"] is not None, out
        assert "'blocks.0.attn.proj'" in out["fixed heads"], out
        assert "view(b, t, -1, head_dim)" in out["fixed heads"], out
