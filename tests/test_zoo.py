"""Third-party models split evenly with DEFAULT options and compute what the whole model does.

Opt-in: the default suite skips this module unless transformers / litgpt are installed;
``make test-zoo`` installs them (without touching torch) and runs it. Models are built from
small configs (no weights are downloaded). Each one is partitioned into 2 and 4 stages with
``partition(model, S, (input_ids,))`` and checked by :func:`split_checks.assert_split_matches`:
every stage holds parameters, none more than 1.5x an even share, no warning, outputs equal
bit for bit (same random numbers: the models run in train mode with dropout) and gradients
equal bit for bit (why no tolerance is needed: ``split_checks``).
The results are tabulated in docs/partition.md ("Third-party models").
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

from split_checks import assert_split_matches

VOCAB, BATCH, SEQ = 128, 2, 16
SPECIAL_TOKENS = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)


def input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def pixels() -> torch.Tensor:
    return torch.randn(BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def hf(model_class: str, config_class: str, **config: Any) -> Callable[[], nn.Module]:
    """Builder of ``transformers.<model_class>(transformers.<config_class>(**config))``."""

    def make() -> nn.Module:
        transformers = pytest.importorskip("transformers")
        built = getattr(transformers, config_class)(**config)
        return getattr(transformers, model_class)(built)

    return make


def litgpt_gpt() -> nn.Module:
    model = pytest.importorskip("litgpt.model")
    config = pytest.importorskip("litgpt.config")
    return model.GPT(
        config.Config(
            n_layer=4, n_embd=64, n_head=4, block_size=32, vocab_size=VOCAB,
            padded_vocab_size=VOCAB,
        )
    )


# 4 layers, width 64, 4 heads everywhere (2 key/value heads where the model has them)
DECODER = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, max_position_embeddings=64, **SPECIAL_TOKENS,
)
GQA = dict(DECODER, num_key_value_heads=2)
ENCODER = dict(DECODER, **{"pad_token_id": 1})

BART = dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
            decoder_ffn_dim=128, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
            eos_token_id=2, decoder_start_token_id=2)
# name -> (builder, example args of forward)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple]]] = {
    "transformers.GPT2LMHeadModel": (
        hf("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_positions=32, n_embd=64,
           n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0),
        lambda: (input_ids(),),
    ),
    "transformers.LlamaForCausalLM": (hf("LlamaForCausalLM", "LlamaConfig", **GQA),
                                      lambda: (input_ids(),)),
    "litgpt.GPT": (litgpt_gpt, lambda: (input_ids(),)),
    "transformers.MistralForCausalLM": (hf("MistralForCausalLM", "MistralConfig", **GQA),
                                        lambda: (input_ids(),)),
    "transformers.Qwen2ForCausalLM": (hf("Qwen2ForCausalLM", "Qwen2Config", **GQA),
                                      lambda: (input_ids(),)),
    "transformers.Qwen3ForCausalLM": (hf("Qwen3ForCausalLM", "Qwen3Config", head_dim=16, **GQA),
                                      lambda: (input_ids(),)),
    "transformers.GemmaForCausalLM": (hf("GemmaForCausalLM", "GemmaConfig", head_dim=16, **GQA),
                                      lambda: (input_ids(),)),
    "transformers.MixtralForCausalLM": (
        hf("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2,
           **GQA),
        lambda: (input_ids(),),
    ),
    "transformers.PhiForCausalLM": (hf("PhiForCausalLM", "PhiConfig", **DECODER),
                                    lambda: (input_ids(),)),
    "transformers.GPTNeoXForCausalLM": (hf("GPTNeoXForCausalLM", "GPTNeoXConfig", **DECODER),
                                        lambda: (input_ids(),)),
    "transformers.OPTForCausalLM": (
        hf("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=64, ffn_dim=128,
           num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=64,
           word_embed_proj_dim=64, **SPECIAL_TOKENS),
        lambda: (input_ids(),),
    ),
    "transformers.BertForMaskedLM": (
        hf("BertForMaskedLM", "BertConfig", **ENCODER), lambda: (input_ids(),)
    ),
    "transformers.RobertaForMaskedLM": (
        hf("RobertaForMaskedLM", "RobertaConfig", **ENCODER), lambda: (input_ids(),)
    ),
    "transformers.DistilBertForMaskedLM": (
        hf("DistilBertForMaskedLM", "DistilBertConfig", vocab_size=VOCAB, dim=64, n_layers=4,
           n_heads=4, hidden_dim=128, max_position_embeddings=64, pad_token_id=0),
        lambda: (input_ids(),),
    ),
    "transformers.T5ForConditionalGeneration": (  # forward(input_ids, attention_mask, decoder_..)
        hf("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=64, d_kv=16,
           d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
           pad_token_id=0, eos_token_id=1),
        lambda: (input_ids(), None, input_ids()),
    ),
    "transformers.BartForConditionalGeneration": (  # shift_tokens_right: item assignment
        hf("BartForConditionalGeneration", "BartConfig", **BART), lambda: (input_ids(),)
    ),
    "transformers.CLIPModel": (  # get_text_features assigns pooler_output on an output object
        lambda: pytest.importorskip("transformers").CLIPModel(
            pytest.importorskip("transformers").CLIPConfig(
                text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 max_position_embeddings=32, bos_token_id=0, eos_token_id=2),
                vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, image_size=32, patch_size=8),
                projection_dim=32)),
        lambda: (input_ids(), pixels()),
    ),
    "transformers.MambaForCausalLM": (  # its forward builds a cache object in eval mode
        hf("MambaForCausalLM", "MambaConfig", vocab_size=VOCAB, hidden_size=64, state_size=8,
           num_hidden_layers=4, expand=2, conv_kernel=4),
        lambda: (input_ids(),),
    ),
    "transformers.ViTForImageClassification": (
        hf("ViTForImageClassification", "ViTConfig", image_size=32, patch_size=8,
           hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
           num_labels=10),
        lambda: (pixels(),),
    ),
}


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_model_splits_evenly_and_matches(name: str, num_stages: int) -> None:
    make, example = MODELS[name]
    make()  # skips here, before partitioning, when the package is missing
    part = assert_split_matches(make, example(), num_stages)
    total = sum(p.numel() for p in part.module.parameters())
    shares = " / ".join(f"{100 * c / total:.0f}%" for c in part.stage_param_counts)
    how = "static shapes" if part.static_shapes is not None else "symbolic"
    leaves = f", {len(part.auto_leaf_modules)} automatic leaves" if part.auto_leaf_modules else ""
    print(f"{name} S={num_stages}: {shares} ({how}{leaves})")


CACHED = ["transformers.GPT2LMHeadModel", "transformers.LlamaForCausalLM",
          "transformers.BartForConditionalGeneration"]


@pytest.mark.parametrize("name", CACHED)
def test_cache_is_left_out_unless_asked_for(name: str) -> None:
    """A forward with ``use_cache`` left out is traced with the cache off (the report says so);
    asked for explicitly, the cache object would be the one built while tracing on every call,
    so the split is refused, naming the output and the fix."""
    from lightning_gsched.partition import UntracedOutputError, partition

    make, example = MODELS[name]
    part = partition(make(), 4, example())
    assert part.fixed_keywords == {"use_cache": False}
    assert "Traced as if called with use_cache=False" in part.report(units=False)
    with pytest.raises(UntracedOutputError, match=r"Cache\).*use_cache = False"):
        partition(make(), 4, example(), {"use_cache": True})


class _Wrapped(nn.Module):
    """A model called as a LightningModule calls it: ``self.model(tokens)``, its output object
    returned whole (the loss reads ``.logits``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> Any:
        return self.model(tokens)


@pytest.mark.parametrize("name", CACHED)
def test_a_wrapped_model_with_its_cache_left_out_verifies(name: str) -> None:
    """The trace calls the wrapped model with the cache off; verify's run of the whole model
    must too, or its output object carries a cache entry the split's lacks and every such
    model was refused with a SplitMismatchError (found by probing, Trainer with verify="auto")."""
    from lightning_gsched.partition import partition

    make, example = MODELS[name]
    part = partition(_Wrapped(make()), 2, example()[:1], verify=True)
    assert part.cache_off_modules == ["model"]
    assert part.verified is not None and part.verified.status == "passed"


# --------------------------------------------------------------------------- under a Trainer

import lightning.pytorch as pl  # noqa: E402 - the Trainer part of this opt-in module

from dist_harness import WorkerContext  # noqa: E402
from lightning_models import as_worker, assert_same_state, state_of  # noqa: E402
from models import seeded  # noqa: E402
from test_lightning_real_models import NextTokenSteps, fit_and_record  # noqa: E402

WORLD_TIMEOUT = 300.0  # seconds per check: whole Trainer fits (conftest.worlds)

# Dropout off (a schedule draws masks per microbatch, on other ranks: no two runs would agree);
# the models still read ``self.training`` in traced code (transformers' attention passes
# ``dropout=0.0 if not self.training else ...``), so the stages switch graphs with the mode.
FIT_MODELS: dict[str, Callable[[], nn.Module]] = {
    "transformers.GPT2LMHeadModel": hf(
        "GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=4,
        n_head=4, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0),
    "transformers.LlamaForCausalLM": hf("LlamaForCausalLM", "LlamaConfig", **GQA),
    "transformers.Qwen3ForCausalLM": hf("Qwen3ForCausalLM", "Qwen3Config", head_dim=16, **GQA),
    "litgpt.GPT": litgpt_gpt,
}


class LitZoo(NextTokenSteps):
    """A third-party language model as a plain LightningModule: ``self(tokens)`` once a step."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.model = FIT_MODELS[name]()
        self.returns_output_object = name.startswith("transformers.")  # .logits; litgpt: tensor

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.model(tokens)
        return out.logits if self.returns_output_object else out


class StageParameters(pl.Callback):
    """Each stage's parameter count as split (before sharding), read at the end of training
    (the engine goes at teardown)."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.counts = list(trainer.strategy.engine.partition.stage_param_counts)


def _zoo_fit(world: int, rank: int, strategy: Any, name: str,
             tensor_parallel_size: int = 1) -> dict:
    # a sanity check first: the pipeline is built in eval mode, then trains
    stages = StageParameters()
    record = fit_and_record(world, rank, strategy, lambda: seeded(0, lambda: LitZoo(name)), 1,
                            tensor_parallel_size, [stages] if world > 1 else [])
    return {**record, "stage_parameters": stages.counts}


def zoo_fit_on_worker(ctx: WorkerContext, name: str) -> dict:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    return _zoo_fit(ctx.world_size, ctx.rank, GeneralParallel("1f1b"), name)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(FIT_MODELS))
def test_model_fits_and_validates_like_one_device(worlds, name: str) -> None:
    """``Trainer.fit`` with a sanity check (the pipeline is built in eval mode), 3 training
    steps and validation, on 2 processes under 1f1b, against one device: final weights on every
    rank, every step's loss and the validation loss."""
    FIT_MODELS[name]()  # skips here when the package is missing
    want = _zoo_fit(1, 0, "auto", name)
    for rank, got in enumerate(worlds.get(2).run(zoo_fit_on_worker, name)):
        label = f"{name} rank {rank}"
        assert got["built_in_sanity_check"] is True, label
        assert_same_state(got["state"], want["state"], label)
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), label
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5), label
    initial = state_of(seeded(0, lambda: LitZoo(name)))
    assert any(not torch.equal(initial[k], want["state"][k]) for k in initial)  # it trained


# torch's tensor-parallel plan for transformers' Llama layers (as torchtitan's for its Llama):
# attention and MLP inputs column-wise, their output projections row-wise
LLAMA_PLAN = {f"model.model.layers.*.{layer}": style for layer, style in (
    ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"),
    ("self_attn.v_proj", "colwise"), ("self_attn.o_proj", "rowwise"),
    ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"), ("mlp.down_proj", "rowwise"))}


# Qwen3 normalises each head of q and k: "head_norm" sums those norms' gradients over the ranks
# (left whole, the build refuses them: partition/replicated_grads.py)
TENSOR_PARALLEL_PLANS = {
    "transformers.LlamaForCausalLM": LLAMA_PLAN,
    "transformers.Qwen3ForCausalLM": {**LLAMA_PLAN, **{
        f"model.model.layers.*.self_attn.{norm}": "head_norm" for norm in ("q_norm", "k_norm")}},
}


def zoo_tensor_parallel_on_worker(ctx: WorkerContext, name: str) -> dict:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    strategy = GeneralParallel("1f1b", tensor_parallel_size=2,
                               tensor_parallel_plan=TENSOR_PARALLEL_PLANS[name])
    return _zoo_fit(ctx.world_size, ctx.rank, strategy, name, tensor_parallel_size=2)


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(TENSOR_PARALLEL_PLANS))
def test_tensor_parallel_stages_fit_like_one_device(worlds, name: str) -> None:
    """transformers' Llama and Qwen3 through the Trainer at W=4 as P=2 x T=2, each worker's
    layers sharded by torch's styles (``TENSOR_PARALLEL_PLANS``), against one device: final weights, every
    step's loss and the validation loss (the tolerances of ``assert_same_state`` and rel 1e-5:
    tensor parallelism reorders the float sums), and an even split. Its stages are traced with
    the example's sizes fixed (its mask code branches on sizes); the split keeps the attention
    and MLP modules whole, so their code reads the local head count (``repeat_kv`` reads it
    from a shape); the LightningModule's call leaves ``use_cache`` out, so the model is traced
    as if called with ``use_cache=False`` (a cache object handed to an attention kept whole
    stopped the trace: the whole model ran in one stage). Each worker's T ranks load one share
    of every batch (``fit_and_record``'s ``tensor_parallel_size``): loaded per rank, the build
    refuses it (found with this test: before the values were compared, it trained silently
    wrong). Qwen3 also normalises each head of q and k, styled ``"head_norm"``."""
    FIT_MODELS[name]()  # skips here when the package is missing
    want = _zoo_fit(1, 0, "auto", name)
    for rank, got in enumerate(worlds.get(4).run(zoo_tensor_parallel_on_worker, name)):
        label = f"{name}, P=2 x T=2, rank {rank}"
        assert_same_state(got["state"], want["state"], label)
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), label
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5), label
        # a split, not the model whole in one stage: no stage holds 3/4 of its parameters
        counts = got["stage_parameters"]
        assert len(counts) == 2 and max(counts) < 0.75 * sum(counts), (label, counts)
