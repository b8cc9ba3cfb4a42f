"""Real models that ship with our dependencies split evenly with DEFAULT options.

``lightning.pytorch.demos.LightningTransformer`` is Lightning's canonical example: a
LightningModule whose network is ``self.model``. torch.fx cannot trace that network
symbolically (it builds masks with ``torch.ones(t, t)``), so the whole network used to become
one automatic leaf; ``nn.TransformerEncoder``'s fast-path checks likewise kept all its layers in
one unit. The tracer now retries with static shapes before keeping a submodule whole that
holds too much of the model (docs/partition.md), so both split between layers.
Third-party models (transformers, litgpt) are in ``test_zoo.py`` (``make test-zoo``).
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import models
from lightning_gsched.partition import TooManyStagesError, partition
from lightning_gsched.partition.errors import UnbalancedPartitionWarning
from split_checks import assert_split_matches


def lightning_transformer() -> nn.Module:
    from lightning.pytorch.demos.transformer import LightningTransformer

    return LightningTransformer(vocab_size=128)  # train mode, dropout 0.2: same RNG order


class EncoderLM(nn.Module):
    """Embedding, a 4-layer ``nn.TransformerEncoder`` and a head: cuts belong between layers."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


@pytest.mark.parametrize("num_stages", [2, 4])
def test_lightning_transformer_splits_evenly_with_defaults(num_stages: int) -> None:
    x = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    part = assert_split_matches(lightning_transformer, (x, x), num_stages)
    assert part.static_shapes == ((2, 8), (2, 8))  # the fallback that made it possible
    assert part.auto_leaf_modules == {}
    names = sum(part.stage_parameter_names, [])
    assert any(".layers.1." in name for name in names)
    assert part.module.model.src_mask is None  # tracing left no Proxy-built cache behind


@pytest.mark.parametrize("num_stages", [2, 4])
def test_transformer_encoder_is_cut_between_its_layers(num_stages: int) -> None:
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    part = assert_split_matches(EncoderLM, (tokens,), num_stages)
    first = [names[0] for names in part.stage_parameter_names[1:]]
    assert any(name.startswith("encoder.layers.") for name in first), first


def test_heavy_automatic_leaf_warns_naming_module_reason_and_fix() -> None:
    """With static shapes forbidden the encoder stays one automatic leaf: the split is
    degenerate, and the warning says which module, why (file:line) and what fixes it."""
    tokens = torch.randint(0, 64, (2, 8))
    with pytest.warns(UnbalancedPartitionWarning) as record:
        part = partition(models.seeded(0, EncoderLM), 2, (tokens,), static_shapes=False)
    assert list(part.auto_leaf_modules) == ["encoder"]
    message = str(record[0].message)
    assert "'encoder'" in message and "TransformerEncoder" in message
    assert re.search(r"transformer\.py:\d+", message)  # the line that stopped the tracer
    assert "drop static_shapes=False" in message


def test_too_few_units_names_the_automatic_leaf_not_leaf_modules() -> None:
    x = torch.randint(0, 128, (2, 8))
    with pytest.raises(TooManyStagesError) as info:
        partition(lightning_transformer(), 2, (x, x), static_shapes=False)
    message = str(info.value)
    assert "'model' is kept whole because torch.fx could not trace into it" in message
    assert re.search(r"demos[/\\]transformer\.py:\d+", message)
    assert "drop static_shapes=False" in message
    assert "leaf_modules" not in message  # the user gave none: nothing to remove there
