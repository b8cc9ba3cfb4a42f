"""Small deterministic models shared by the partition and runtime tests.

Every ``make_*`` constructor seeds its own RNG fork, so two calls build bit-identical models
without touching the global random state; every ``*_inputs`` helper does the same for data.
Sizes are tiny (hidden 16-32) so whole test files run in seconds on two CPU cores.

Each model exercises something a pipeline partitioner must get right:

* :class:`MLP` — plain chain, no nn.Sequential.
* :class:`ResidualCNN` — residual blocks (skip inside a block), BatchNorm buffers, in-place ReLU.
* :class:`BatchNormCNN` — BatchNorm2d/1d (one with ``momentum=None``) and a tracking InstanceNorm.
* :class:`TinyGPT` — tied embedding/output weights, causal mask buffer sliced once and carried
  through every block, ints from ``idx.size()`` used later.
* :class:`KwargsDictModel` — keyword-only args, optional mask, dict-of-list output with plain
  values.
* :class:`LongSkipModel` — skip connection from the first block to the last.
* :class:`DropoutMLP` — dropout in every layer (random masks in every stage).
* :class:`UnevenModel` — very uneven layer sizes (heavy ``Expand`` blocks between light layers).
* :class:`DataDependentModel`, :class:`RoutedModel` — untraceable control flow (root / submodule).
* :class:`CustomFunctionNet` — custom autograd Functions whose backward is *not* autograd of
  their forward (straight-through rounding, gradient reversal, a scaled backward, a hand-written
  linear over a weight), one or more in every stage.
* :class:`GPTLightning` — a LightningModule wrapping TinyGPT; :class:`BatchNormLightning` —
  one wrapping BatchNormCNN.
"""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any, Callable, TypeVar

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

T = TypeVar("T")


def seeded(seed: int, build: Callable[[], T]) -> T:
    """Run ``build`` with a fixed seed without disturbing the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


# --------------------------------------------------------------------------- MLP


class MLP(nn.Module):
    def __init__(self, sizes: tuple[int, ...] = (16, 32, 32, 32, 8)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in pairwise(sizes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def make_mlp(seed: int = 0) -> MLP:
    return seeded(seed, MLP)


def mlp_inputs(batch: int = 4, seed: int = 1) -> tuple[torch.Tensor]:
    return (seeded(seed, lambda: torch.randn(batch, 16)),)


# --------------------------------------------------------------------------- CNN


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResidualCNN(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()
        )
        self.blocks = nn.Sequential(
            ResidualBlock(channels, channels),
            ResidualBlock(channels, 2 * channels, stride=2),
            ResidualBlock(2 * channels, 2 * channels),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def make_cnn(seed: int = 0) -> ResidualCNN:
    return seeded(seed, ResidualCNN)


def cnn_inputs(batch: int = 2, seed: int = 1) -> tuple[torch.Tensor]:
    return (seeded(seed, lambda: torch.randn(batch, 3, 8, 8)),)


# --------------------------------------------------------------------------- running statistics


class BatchNormCNN(nn.Module):
    """Every kind of running statistics the runtime keeps in step with one device.

    BatchNorm2d with the default momentum and with momentum 0.3, an InstanceNorm2d that tracks
    running statistics (no ``num_batches_tracked`` update, its own update rule), and a
    BatchNorm1d with ``momentum=None`` (a cumulative average over ``num_batches_tracked``), spread
    over the depth so that every stage of a 2- to 4-stage split holds some.
    """

    def __init__(self, channels: int = 4, hidden: int = 16, classes: int = 5) -> None:
        super().__init__()
        c = channels

        def block(cin: int, cout: int, norm: nn.Module, stride: int = 1) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
                                 norm, nn.ReLU())

        self.blocks = nn.Sequential(
            block(3, c, nn.BatchNorm2d(c)),
            block(c, c, nn.BatchNorm2d(c, momentum=0.3)),
            block(c, 2 * c, nn.InstanceNorm2d(2 * c, affine=True, track_running_stats=True), 2),
            block(2 * c, 2 * c, nn.BatchNorm2d(2 * c)),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Linear(2 * c, hidden)
        self.norm = nn.BatchNorm1d(hidden, momentum=None)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.pool(self.blocks(x)), 1)
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def make_bn_cnn(seed: int = 0, **kwargs: Any) -> BatchNormCNN:
    return seeded(seed, lambda: BatchNormCNN(**kwargs))


def bn_cnn_inputs(batch: int = 4, seed: int = 1) -> tuple[torch.Tensor]:
    return (seeded(seed, lambda: torch.randn(batch, 3, 8, 8)),)


# --------------------------------------------------------------------------- GPT


class CausalSelfAttention(nn.Module):
    """Causal attention whose every parameter has a gradient that is not identically zero.

    Why no bias in ``qkv``: a key bias adds ``q . b_k`` to every score of a query row, which the
    softmax cancels, so its true gradient is exactly zero and the float value the backward
    produces is pure summation-order noise (about 1e-9, different on every CPU's kernels and for
    every microbatch split). Adam divides by that noise's own magnitude and turns it into steps
    of up to ``lr * noise / eps``, so equivalence with one device would hold on one CPU and not
    on another. Without such a parameter, every gradient's reordering error is relative to its
    value (float32 roundoff), which no optimizer amplifies.
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.heads))
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class ShardableAttention(nn.Module):
    """The same attention written to run on a tensor-parallel shard of its heads: separate
    ``q``, ``k``, ``v`` layers (a fused one sharded column-wise would give rank 0 all of q and
    part of k) and ``-1`` heads in every view, so the local head count follows the local width.
    The heads are joined with the count read back from a tensor's shape, as transformers'
    attention code does (``repeat_kv``): right when run as written, wrong if a trace fixed the
    example's sizes (the tensor-parallel tests check that the split keeps it whole)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (layer(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for layer in (self.q, self.k, self.v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        _, heads, _, head_dim = v.shape
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, heads * head_dim))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, shardable: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = (ShardableAttention if shardable else CausalSelfAttention)(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """GPT with the token embedding reused as the output projection (tied weights).

    ``tie="functional"`` reads ``self.wte.weight`` in forward; ``tie="module"`` shares the
    Parameter with a ``head`` Linear, so the weight also has the alias name ``head.weight``.
    ``shardable``: blocks with :class:`ShardableAttention` (tensor-parallel tests).
    """

    def __init__(
        self,
        vocab: int = 64,
        dim: int = 32,
        heads: int = 4,
        layers: int = 3,
        block_size: int = 16,
        dropout: float = 0.0,
        tie: str = "functional",
        shardable: bool = False,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads, shardable) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.tie = tie
        if tie == "module":
            self.head = nn.Linear(dim, vocab, bias=False)
            self.head.weight = self.wte.weight
        mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        mask = self.causal_mask[:t, :t]
        for block in self.blocks:
            x = block(x, mask)
        x = self.ln_f(x)
        if self.tie == "module":
            return self.head(x)
        return F.linear(x, self.wte.weight)


class PythonMaskGPT(TinyGPT):
    """TinyGPT whose positions and causal mask are built in Python from the sequence length,
    as transformers' models build theirs: ``int(...)`` of a size stops fx's symbolic trace, so
    the model is traced with static shapes and the split keeps both tensors as constants (which
    a model built without weights once had only as valueless meta tensors)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = int(idx.shape[1])
        pos = torch.arange(t, device=idx.device)
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x, mask)
        return F.linear(self.ln_f(x), self.wte.weight)


def make_gpt(seed: int = 0, **kwargs: Any) -> TinyGPT:
    return seeded(seed, lambda: TinyGPT(**kwargs))


def gpt_inputs(batch: int = 2, length: int = 8, vocab: int = 64, seed: int = 1) -> tuple[torch.Tensor]:
    return (seeded(seed, lambda: torch.randint(0, vocab, (batch, length))),)


# --------------------------------------------------------------------------- kwargs + dict output


class KwargsDictModel(nn.Module):
    """Keyword-only arguments in, a dict holding a list, an int and None out."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.mid = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, 4)

    def forward(
        self,
        x: torch.Tensor,
        *,
        scale: float = 1.0,
        mask: torch.Tensor | None = None,
        extras: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, Any]:
        batch = x.shape[0]
        h = self.inp(x) * scale
        if mask is not None:
            h = h.masked_fill(~mask, 0.0)
        h2 = self.mid(torch.tanh(h))
        if extras is not None:
            h2 = h2 + extras["bias"]
        logits = self.out(torch.relu(h2)).reshape(batch, -1)
        return {"logits": logits, "hidden": [h, h2], "batch": batch, "aux": None}


def make_kwargs_model(seed: int = 0) -> KwargsDictModel:
    return seeded(seed, KwargsDictModel)


def kwargs_inputs(batch: int = 3, seed: int = 1) -> tuple[tuple, dict]:
    def build() -> tuple[tuple, dict]:
        x = torch.randn(batch, 16)
        mask = torch.rand(batch, 16) > 0.3
        return (x,), {"scale": 0.5, "mask": mask, "extras": {"bias": torch.randn(16)}}

    return seeded(seed, build)


# --------------------------------------------------------------------------- long skip


class LongSkipModel(nn.Module):
    """The first block's output skips every middle block and is added before the last one."""

    def __init__(self, dim: int = 16, depth: int = 5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.blocks[0](x)
        h = first
        for block in self.blocks[1:-1]:
            h = block(h)
        return self.blocks[-1](h + first)


def make_long_skip(seed: int = 0) -> LongSkipModel:
    return seeded(seed, LongSkipModel)


def long_skip_inputs(batch: int = 4, seed: int = 1) -> tuple[torch.Tensor]:
    return (seeded(seed, lambda: torch.randn(batch, 16)),)


# --------------------------------------------------------------------------- dropout everywhere


class DropoutMLP(nn.Module):
    """Dropout after every hidden layer (and on the input), so every stage of a 2- to 4-stage
    split draws random masks, the last stage included: what activation checkpointing's replay
    must redraw identically."""

    def __init__(self, sizes: tuple[int, ...] = (16, 32, 32, 32, 32, 8), p: float = 0.3) -> None:
        super().__init__()
        self.drop_in = nn.Dropout(p)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in pairwise(sizes))
        self.drops = nn.ModuleList(nn.Dropout(p) for _ in sizes[2:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop_in(x)
        for layer, drop in zip(self.layers, self.drops, strict=False):
            x = drop(F.gelu(layer(x)))
        return self.layers[-1](x)


def make_dropout_mlp(seed: int = 0, **kwargs: Any) -> DropoutMLP:
    return seeded(seed, lambda: DropoutMLP(**kwargs))


# --------------------------------------------------------------------------- random skips


class SkipNet(nn.Module):
    """``n`` layers with arbitrary skip edges ``(src, dst)``: ``h[dst] += h[src]`` (src < dst).

    Used with hypothesis to check liveness and carrying on random dataflow; also returns an
    intermediate and a Python int so outputs are a pytree.
    """

    def __init__(self, layers: int = 4, skips: tuple[tuple[int, int], ...] = (), dim: int = 8) -> None:
        super().__init__()
        self.skips = tuple(skips)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        hidden = [x]
        for i, layer in enumerate(self.layers, start=1):
            h = torch.tanh(layer(hidden[-1]))
            for src, dst in self.skips:
                if dst == i:
                    h = h + hidden[src]
            hidden.append(h)
        return {"out": hidden[-1], "first": hidden[1], "depth": len(hidden)}


def make_skipnet(seed: int = 0, **kwargs: Any) -> SkipNet:
    return seeded(seed, lambda: SkipNet(**kwargs))


# --------------------------------------------------------------------------- uneven layers


class Expand(nn.Module):
    """A heavy layer: up-projection to ``hidden`` and back."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class UnevenModel(nn.Module):
    """Layers by ``pattern``: ``s`` = Linear(dim, dim), ``H`` = Expand(dim, hidden)."""

    def __init__(self, pattern: str = "sHssHs", dim: int = 16, hidden: int = 512) -> None:
        super().__init__()
        self.pattern = pattern
        self.layers = nn.ModuleList(
            Expand(dim, hidden) if kind == "H" else nn.Linear(dim, dim) for kind in pattern
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def make_uneven(seed: int = 0, **kwargs: Any) -> UnevenModel:
    return seeded(seed, lambda: UnevenModel(**kwargs))


def uneven_inputs(batch: int = 64, seed: int = 1) -> tuple[torch.Tensor]:
    return (seeded(seed, lambda: torch.randn(batch, 16)),)


# --------------------------------------------------------------------------- untraceable


class DataDependentModel(nn.Module):
    """Branches on tensor data in its own forward: fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if x.sum() > 0:  # data-dependent branch (the line the error must name)
            x = -x
        return self.b(x)


class Router(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.left = nn.Linear(dim, dim)
        self.right = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0:  # data-dependent branch inside a submodule
            return self.left(x)
        return self.right(x)


class RoutedModel(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.pre = nn.Linear(dim, dim)
        self.router = Router(dim)
        self.post = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(torch.relu(self.router(self.pre(x))))


class ModeDependentModel(nn.Module):
    """Reads ``self.training`` in traced code (F.dropout), so its graph depends on the mode."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout(self.a(x), p=0.5, training=self.training)
        return self.b(x)


# --------------------------------------------------------------------------- Lightning


class GPTLightning(pl.LightningModule):
    """A LightningModule whose forward is what gets partitioned."""

    def __init__(self, **gpt_kwargs: Any) -> None:
        super().__init__()
        self.model = TinyGPT(**gpt_kwargs)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def make_gpt_lightning(seed: int = 0, **kwargs: Any) -> GPTLightning:
    return seeded(seed, lambda: GPTLightning(**kwargs))


class BatchNormLightning(pl.LightningModule):
    """A LightningModule around :class:`BatchNormCNN` (batches are ``(images, labels)``)."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.model = BatchNormCNN()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def make_bn_lightning(seed: int = 0, **kwargs: Any) -> BatchNormLightning:
    return seeded(seed, lambda: BatchNormLightning(**kwargs))


# --------------------------------------------------------------------------- helpers


# --------------------------------------------------------------------------- custom Functions


class StraightThrough(torch.autograd.Function):
    """Rounds in forward; passes the gradient through unchanged (autograd of round: zero)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class GradientReversal(torch.autograd.Function):
    """Identity in forward; ``-alpha`` times the gradient in backward (a plain float argument)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, alpha: float) -> torch.Tensor:
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return -ctx.alpha * grad, None


class ScaledBackward(torch.autograd.Function):
    """``x * 1`` in forward, three times the gradient in backward (custom gradient clipping and
    loss scaling are written like this)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return 3.0 * grad


class HandLinear(torch.autograd.Function):
    """``x @ w.t()`` with a hand-written backward whose weight gradient is halved: a Function
    over an activation *and* a weight (split backward must run it for both halves)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        flat_grad, flat_x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        return grad @ w, 0.5 * flat_grad.t() @ flat_x


class CustomFunctionNet(nn.Module):
    """Four blocks, each a Linear and a custom Function, so every stage position (first, middle,
    last, with 2-4 stages) holds one; the head's weight goes through :class:`HandLinear`."""

    def __init__(self, width: int = 16, out: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.head = nn.Parameter(torch.randn(out, width) / math.sqrt(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = StraightThrough.apply(self.layers[0](x))
        x = GradientReversal.apply(torch.tanh(self.layers[1](x)), 0.5)
        x = ScaledBackward.apply(torch.tanh(self.layers[2](x)))
        x = StraightThrough.apply(torch.tanh(self.layers[3](x)))
        return HandLinear.apply(x, self.head)


def make_custom_functions(seed: int = 0) -> CustomFunctionNet:
    return seeded(seed, CustomFunctionNet)


def custom_function_inputs(batch: int = 4, seed: int = 1) -> tuple[torch.Tensor]:
    return seeded(seed, lambda: (torch.randn(batch, 16),))


def loss_of(output: Any) -> torch.Tensor:
    """A scalar that depends on every floating tensor in an output pytree."""
    from torch.utils import _pytree as pytree

    terms = [
        (t.float() * (i + 1)).square().mean()
        for i, t in enumerate(pytree.tree_leaves(output))
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]
    return torch.stack(terms).sum()


def parameter_grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        name: None if p.grad is None else p.grad.clone() for name, p in module.named_parameters()
    }


def run_stagewise(stages: list[nn.Module], args: tuple, kwargs: dict) -> Any:
    """Run stages the way a pipeline runtime does: detach at every boundary, backward per stage.

    Forward: stage k receives detached copies of stage k-1's outputs (floating tensors require
    grad). Backward: the loss of the last stage, then each earlier stage's outputs with the
    gradients its successor accumulated on the received copies. Returns the final output.
    """
    from torch.utils import _pytree as pytree

    def receive(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().requires_grad_(value.requires_grad)
        return value

    outputs, received = [], []
    carried = stages[0](*args, **kwargs)
    outputs.append(carried)
    for stage in stages[1:]:
        inputs = pytree.tree_map(receive, carried)
        received.append(inputs)
        carried = stage(inputs)
        outputs.append(carried)
    loss_of(carried).backward()
    for k in range(len(stages) - 2, -1, -1):
        pairs = [
            (out, got.grad)
            for out, got in zip(
                pytree.tree_leaves(outputs[k]), pytree.tree_leaves(received[k]), strict=True
            )
            if isinstance(out, torch.Tensor) and out.requires_grad and got.grad is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return carried
