"""A tiny character-level GPT and its data, written as a plain Lightning user would.

Nothing here knows about ``lightning_gsched``: the same module trains with ``strategy="ddp"`` and
with ``GeneralParallel(...)``. The only rules it follows for the pipeline strategies:

* ``forward`` is traceable by ``torch.fx.symbolic_trace``: no Python branch on tensor values, no
  tensor sizes used as Python numbers. Head splitting uses ``unflatten``/``flatten`` instead of
  ``view(b, t, ...)``; the causal mask is a buffer built once for ``block_size`` and narrowed to
  the (symbolic) sequence length; dropout is ``nn.Dropout`` modules, never ``self.training``.
* ``training_step``/``validation_step`` call ``self(x)`` exactly once; the loss is computed
  after that call from its output only.
* Batches have a fixed shape (``drop_last=True``), so any per-device batch splits evenly into
  microbatches.

Import it (``from gpt import GPT, CharDataModule`` with ``examples/`` on ``sys.path``) or run it
through ``train_gpt.py`` (LightningCLI).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

DEFAULT_CORPUS = Path(__file__).parent / "data" / "tiny_corpus.txt"


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with an externally supplied boolean causal mask."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_head = n_head
        self.head_dim = n_embd // n_head
        # q, k and v as three layers, heads counted from the width (-1 below): the layers can
        # then be sharded column-wise by heads (tensor parallelism, configs/1f1b_3d.yaml)
        self.q, self.k, self.v = (nn.Linear(n_embd, n_embd) for _ in range(3))
        self.proj = nn.Linear(n_embd, n_embd)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # (b, t, c) -> (b, h, t, d) each; unflatten needs no Python ints from x.shape
        q, k, v = (layer(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
                   for layer in (self.q, self.k, self.v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = self.attn_drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).flatten(2)  # (b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class GPT(pl.LightningModule):
    """Decoder-only transformer over bytes; the output projection reuses the token embedding.

    Args:
        vocab_size: token ids are bytes of ASCII text, so 128 covers every corpus character.
        block_size: the longest sequence the model accepts (size of the position table and mask).
        n_layer, n_head, n_embd, dropout: transformer shape.
        lr, weight_decay, betas: AdamW; decay applies to matrices only (not norms or biases).
        warmup_steps: linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at the last step.
    """

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        # Wider than GPT-2's 0.02: at this width a 0.02 tied embedding often sits at the unigram
        # loss (~2.95) through step 60 (3 of 5 seeded runs at lr 3e-3..5e-3); with 0.05 all 3
        # seeds reached 2.2-2.4 by step 60 (lr 3e-3, 32 x 64 tokens per step).
        nn.init.normal_(self.wte.weight, mean=0.0, std=0.05)
        self.head.weight = self.wte.weight  # tied: one Parameter, two module paths
        # Built once for the maximum length; forward narrows it, so no tensor is built from x.shape.
        mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("causal_mask", mask, persistent=False)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``(batch, t)`` with ``t <= block_size`` -> logits ``(batch, t, vocab)``."""
        t = idx.size(1)  # symbolic under fx; used only as a slice bound and an arange end
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        # narrow, not [:t, :t]: plain symbolic_trace keeps buffers as real tensors, and a real
        # tensor cannot be sliced by a symbolic int, but its narrow() call is recorded.
        mask = self.causal_mask.narrow(0, 0, t).narrow(1, 0, t)
        for block in self.blocks:  # iterates modules, not tensor values: fx unrolls it
            x = block(x, mask)
        return self.head(self.ln_f(x))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Greedy next-token ids for every position, ``(batch, t)``."""
        return self(batch[0]).argmax(dim=-1)

    def configure_optimizers(self):  # type: ignore[override]  # Lightning's return type is a union
        hp = self.hparams
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr, betas=tuple(hp.betas),
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = min(hp.warmup_steps, total)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(1, total - warmup)
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class CharWindows(Dataset):
    """Fixed-length windows of a token tensor: ``x = tokens[i:i+t]``, ``y = tokens[i+1:i+t+1]``."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, stride: int) -> None:
        if len(tokens) <= seq_len:
            raise ValueError(f"text of {len(tokens)} tokens is too short for seq_len={seq_len}")
        self.tokens, self.seq_len, self.stride = tokens, seq_len, stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.stride
        chunk = self.tokens[start : start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class CharDataModule(pl.LightningDataModule):
    """Byte-level next-token prediction on an ASCII text file; the last ``val_fraction`` is validation.

    Args:
        data_path: text file (ASCII); default: ``examples/data/tiny_corpus.txt``.
        batch_size: per device, as in DDP (global batch = batch_size x devices).
        seq_len: tokens per sample; must not exceed the model's ``block_size``.
        stride: distance between window starts (default ``seq_len // 2``: overlapping windows).

    Every loader yields only full batches: the pipeline strategies split each global batch into
    microbatches, and a short batch would not split evenly.
    """

    def __init__(
        self,
        data_path: str | None = None,
        batch_size: int = 8,
        seq_len: int = 64,
        stride: int | None = None,
        val_fraction: float = 0.1,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.path = Path(data_path) if data_path else DEFAULT_CORPUS

    def setup(self, stage: str | None = None) -> None:
        data = self.path.read_bytes()
        if any(b >= 128 for b in data):
            raise ValueError(f"{self.path} is not ASCII; token ids are bytes and vocab_size is 128")
        tokens = torch.tensor(list(data), dtype=torch.long)
        split = int(len(tokens) * (1 - self.hparams.val_fraction))
        seq_len = self.hparams.seq_len
        stride = self.hparams.stride or max(1, seq_len // 2)
        self.train_set = CharWindows(tokens[:split], seq_len, stride)
        self.val_set = CharWindows(tokens[split:], seq_len, seq_len)

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(dataset, batch_size=self.hparams.batch_size, shuffle=shuffle, drop_last=True,
                          num_workers=self.hparams.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        # Lightning forces drop_last=False when predicting, so trim the set instead: every rank
        # then gets only full batches (a short one would not split into microbatches).
        world = self.trainer.world_size if self.trainer is not None else 1
        full = len(self.val_set) - len(self.val_set) % (self.hparams.batch_size * world)
        return self._loader(Subset(self.val_set, range(full)), shuffle=False)


def tune_target(rows: int = 4, block_size: int = 128) -> tuple[GPT, tuple, Any]:
    """``gsched tune examples/gpt.py:tune_target ...``: the demo's GPT and one microbatch of
    ``rows`` sequences (random bytes: timing and sizes do not depend on the values)."""
    model = GPT(block_size=block_size)
    tokens = torch.randint(0, 128, (rows, block_size + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    return model, (x,), loss_fn
