"""The benchmark model and data: a small GPT (a few million parameters) and fixed random tokens.

Why not examples/gpt.py: its output head is tied to the token embedding, and
torch.distributed.pipelining (an anchor of ``pipeline_vs_torch``) cannot split a model whose
first and last stage share a parameter. Every benchmark uses this one untied model so that all
rows of the table train the same network on the same data.

``shardable=True`` (the ``tp_vs_lightning_model_parallel`` row only) swaps each block's fused
``qkv`` for three ``Linear(dim, dim)`` layers and views heads as ``-1``, so that q, k and v
shard column-wise by heads (a fused ``qkv`` cut column-wise gives rank 0 all of q and half of
k; docs/tensor_parallel.md, "Model code"). Same parameter count and the same init distribution
(``fan_in = dim`` either way); off by default, so every other row builds the network it always
built.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


@dataclass(frozen=True)
class GPTShape:
    vocab: int = 256
    seq: int = 64
    layers: int = 4
    dim: int = 256
    heads: int = 8

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ShardableBlock(nn.Module):
    """:class:`Block` with separate ``q``, ``k``, ``v`` layers and ``-1`` heads in every view:
    the form a tensor-parallel shard runs (the local head count follows the local width).

    The heads are cut from each projection's own output (``unflatten``), never with the
    sequence length read from the block's input: under sequence parallelism the input holds
    this rank's part of the sequence and the column-wise projections gather it whole, so a
    ``view(b, t, -1, ...)`` with the input's ``t`` would fold the other half into extra heads."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.head_dim = dim // heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        q, k, v = (layer(h).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
                   for layer in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).flatten(2))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class GPTCore(nn.Module):
    """Token + position embedding, ``layers`` blocks, final norm, untied head; ``shardable``:
    :class:`ShardableBlock` blocks (module docstring)."""

    def __init__(self, shape: GPTShape, shardable: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(shape.vocab, shape.dim)
        self.wpe = nn.Embedding(shape.seq, shape.dim)
        block = ShardableBlock if shardable else Block
        self.blocks = nn.Sequential(*(block(shape.dim, shape.heads) for _ in range(shape.layers)))
        self.ln_f = nn.LayerNorm(shape.dim)
        self.head = nn.Linear(shape.dim, shape.vocab, bias=False)
        self.register_buffer("positions", torch.arange(shape.seq), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(self.positions)
        return self.head(self.ln_f(self.blocks(x)))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def build_core(shape: GPTShape, seed: int = 0, shardable: bool = False) -> GPTCore:
    torch.manual_seed(seed)
    return GPTCore(shape, shardable)


class BenchLit(pl.LightningModule):
    """The Lightning side: the same core, SGD with momentum (cheap, so timing is the schedule's)."""

    def __init__(self, shape: dict[str, int] | None = None, lr: float = 0.05, seed: int = 0,
                 shardable: bool = False) -> None:
        super().__init__()
        self.shape = GPTShape(**(shape or {}))
        self.lr = lr
        self.core = build_core(self.shape, seed, shardable)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.core(idx)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = lm_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def token_data(shape: GPTShape, rows: int, seed: int = 1) -> TensorDataset:
    """``rows`` random sequences; target = input shifted by one (a learnable copy task)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape.vocab, (rows, shape.seq + 1), generator=gen)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def rank_loader(shape: GPTShape, per_rank: int, steps: int, rank: int, world: int) -> DataLoader:
    """Rank ``rank``'s contiguous slice of each global batch (fixed, no sampler)."""
    data = token_data(shape, per_rank * world * steps)
    idx = [i * per_rank * world + rank * per_rank + j for i in range(steps) for j in range(per_rank)]
    subset = torch.utils.data.Subset(data, idx)
    return DataLoader(subset, batch_size=per_rank, shuffle=False)


def replica_loader(shape: GPTShape, rows: int, steps: int) -> DataLoader:
    """Every global batch of ``rows`` rows whole, the same on every rank (``data_loading=
    "per_replica"`` with one replica: :func:`rank_loader`'s global batches, unsliced)."""
    return DataLoader(token_data(shape, rows * steps), batch_size=rows, shuffle=False)


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
