"""A model built without weights whose forward builds or reads values splits as with weights.

A deferred model (parameters on the meta device, docs/memory.md "Models larger than one rank")
is traced on the example with real-device stand-ins of its parameters (one zero each, no
memory: partition/meta_run.py ``stand_ins``). Two kinds of model code used to be refused that
way, traced on meta tensors, which have shapes but no values:

- code fx can trace only with static shapes that builds a tensor while traced (a causal mask
  from ``torch.arange(t, device=x.device)``, transformers' mask and rotary positions): the split
  keeps it as a constant, which on meta had no values, and the device it read as a literal;
- code that reads a value (``.item()``, ``bool()`` of a tensor: transformers' packed-sequence
  check of the attention mask).

Each test gives the deferred model the weights of the same model built with them, after the
split (as each rank's materialisation does, in place), and checks that the stages compute
what that model computes, bit for bit (the same operations in the same order). The memory
prediction still sizes the stages on meta tensors: the split's constants and the devices its
stages name are moved there for the run (``on_meta``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gsched.measure.stage_pass import measure_stage_bytes
from lightning_gsched.partition import partition
from lightning_gsched.partition.meta_run import on_meta, to_meta
from lightning_gsched.runtime.flat import set_storage


class MaskedMix(nn.Module):
    """Mixes positions under a causal mask built from the sequence length while traced, and
    moves its input to the device it is on (a device literal in a static-shape trace)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        position = torch.arange(t, device=x.device)
        mask = (position[None, :] <= position[:, None]).to(x.dtype)  # (t, t)
        x = x.to(x.device)
        return self.proj(torch.einsum("st,btd->bsd", mask / mask.sum(-1, keepdim=True), x))


class SkipsEmptyRows(nn.Module):
    """Reads a value of its input: whether any row is all zeros (a padding check)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x.abs().sum(-1) == 0).any()):
            x = x + 1.0
        return self.proj(x)


class Net(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.mix = block()
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mix(torch.relu(self.inp(x)))))


def _given_weights(deferred: nn.Module, weighted: nn.Module) -> None:
    """The deferred model's parameters take the other model's values in place (every holder,
    a stage included, sees them), as a rank's materialisation gives its stages theirs."""
    values = dict(weighted.named_parameters())
    for name, param in deferred.named_parameters():
        set_storage(param, values[name].detach().clone())


def _run(stages: list[nn.Module], args: tuple) -> torch.Tensor:
    out = stages[0](*args)
    for stage in stages[1:]:
        out = stage(out)
    return out


@pytest.mark.parametrize("block,options", [(MaskedMix, {"static_shapes": True}),
                                           (SkipsEmptyRows, {})])
def test_a_split_made_without_weights_computes_what_the_model_with_them_does(
        block: type[nn.Module], options: dict) -> None:
    torch.manual_seed(0)
    weighted, x = Net(block), torch.randn(2, 5, 8)
    x[0, 1] = 0.0  # an empty row: SkipsEmptyRows takes its branch
    with torch.device("meta"):  # buffers on meta too, as Lightning's empty init makes them
        deferred = Net(block)
    part = partition(deferred, 2, (x,), balance="params", **options)
    assert all(p.is_meta for p in deferred.parameters())  # the split made no weights
    _given_weights(deferred, weighted)
    torch.testing.assert_close(_run(part.stages, (x,)), weighted(x), rtol=0, atol=0)


def test_stages_without_weights_are_sized_on_meta_with_their_constants_and_devices() -> None:
    """The memory prediction's run: MaskedMix's stages hold the mask as a constant and name the
    example's device; on meta both follow, and the bytes equal those of the split with weights
    (this model's operations save the same tensors on either device)."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    with torch.device("meta"):
        deferred = Net(MaskedMix)
    lazy = partition(deferred, 2, (x,), balance="params", static_shapes=True)
    with on_meta(*lazy.stages):
        sizes = measure_stage_bytes(lazy.stages, to_meta((x,)), {}, optimizer_factor=2.0)
    real = partition(Net(MaskedMix), 2, (x,), balance="params", static_shapes=True)
    assert [len(u) for u in lazy.stage_units] == [len(u) for u in real.stage_units]
    assert sizes == measure_stage_bytes(real.stages, (x,), {}, optimizer_factor=2.0)


def test_a_transformers_llama_with_an_attention_mask_splits_without_weights() -> None:
    """The case that was refused (found by probing): its mask code builds tensors while traced
    and reads values (the packed-sequence check)."""
    transformers = pytest.importorskip("transformers")
    from lightning_gsched.runtime.materialize import deferred_parameters

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    weighted = transformers.LlamaForCausalLM(config)
    with deferred_parameters():
        deferred = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    part = partition(deferred, 2, (ids, mask), balance="params")
    _given_weights(deferred, weighted)
    got = _run(part.stages, (ids, mask))
    torch.testing.assert_close(got["logits"], weighted(ids, mask).logits, rtol=0, atol=0)


def test_only_a_trace_that_needs_values_runs_on_stand_ins(monkeypatch) -> None:
    """A trace on stand-ins computes a real forward of the example (seconds for a large model):
    a model whose trace on meta keeps nothing valueless is traced there alone. MaskedMix traced
    symbolically builds its mask in the graph at every call (no constant); with static shapes
    the mask is a constant, so the trace is made again on stand-ins."""
    from lightning_gsched.partition import meta_run

    made: list[str] = []
    real = meta_run.stand_ins

    def counted(module: nn.Module, device: torch.device):  # type: ignore[no-untyped-def]
        made.append(type(module).__name__)
        return real(module, device)

    monkeypatch.setattr(meta_run, "stand_ins", counted)
    x = torch.randn(2, 5, 8)
    with torch.device("meta"):
        symbolic, static = Net(MaskedMix), Net(MaskedMix)
    partition(symbolic, 2, (x,), balance="params")
    assert made == []
    partition(static, 2, (x,), balance="params", static_shapes=True)
    assert made == ["Net"]


class Experts(MaskedMix):
    """MaskedMix plus two experts applied with ``grouped_mm`` (as transformers' mixture-of-
    experts layers are), which refuses a stride-0 weight."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__(dim)
        self.experts = nn.Parameter(torch.randn(2, dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        offsets = torch.tensor([rows.shape[0] // 2, rows.shape[0]], dtype=torch.int32)
        mixed = torch.nn.functional.grouped_mm(rows, self.experts, offs=offsets)
        return super().forward(x) + mixed.reshape(x.shape)


def test_an_operation_refusing_the_stand_ins_says_so() -> None:
    """Found by probing (deferred Mixtral): the failure read as a bad example input."""
    with torch.device("meta"):
        deferred = Net(Experts)
    with pytest.raises(Exception) as refused:
        partition(deferred, 2, (torch.randn(2, 5, 8),), balance="params", static_shapes=True)
    message = str(refused.value)
    assert "traced on stand-ins of its parameters" in message, message
    assert "build this model with its weights" in message
