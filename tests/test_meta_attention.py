"""Sizing a model on meta tensors counts attention's saved bytes as real tensors do.

A deferred model is sized on meta tensors (engine/memory_report.py). Without
``fused_attention_on_meta`` torch decomposes scaled-dot-product attention on meta into the
math path, which saves the T x T attention matrix; on CPU (and CUDA) the fused kernel saves
only q, k, v, the output and the log-sum-exp rows. The reference here is the same stage sized
on real CPU tensors in the same test.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_gsched.measure import measure_stage_bytes
from lightning_gsched.measure.meta_attention import fused_attention_on_meta
from lightning_gsched.partition.meta_run import to_meta
from lightning_gsched.runtime.footprint import SavedTensorBytes, weight_storages


class Attention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, causal: bool = True,
                 masked: bool = False) -> None:
        super().__init__()
        self.heads, self.causal, self.masked = heads, causal, masked
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = None
        if self.masked:  # an explicit additive mask instead of is_causal
            mask = torch.zeros(t, t, device=x.device)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


def _activations(stage: nn.Module, x: torch.Tensor) -> int:
    return measure_stage_bytes([stage], (x,)).stages[0].activations


def _saved_by_forward(stage: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves in one forward of ``stage`` (no mode entered here)."""
    with torch.enable_grad(), SavedTensorBytes(weight_storages(stage)) as saved:
        stage(x)
    return saved.nbytes


@pytest.mark.parametrize("causal, masked", [(True, False), (False, True), (False, False)])
def test_meta_sizing_saves_what_the_fused_kernel_saves(causal: bool, masked: bool) -> None:
    torch.manual_seed(0)
    stage = Attention(causal=causal, masked=masked)
    x = torch.randn(2, 64, 32)
    real = _activations(stage, x)
    meta_stage = copy.deepcopy(stage).to("meta")
    # measure_stage_bytes enters fused_attention_on_meta itself for a stage on meta
    assert _activations(meta_stage, to_meta(x)) == real
    with fused_attention_on_meta():
        fused = _saved_by_forward(meta_stage, to_meta(x))
    assert fused == _saved_by_forward(stage, x)
    # without the mode the math path keeps (about) a 64 x 64 matrix per row and head: at
    # least half of 2 rows x 4 heads x 64 x 64 floats more
    assert _saved_by_forward(meta_stage, to_meta(x)) > fused + 2 * 4 * 64 * 64 * 4 // 2


def test_real_tensors_and_other_calls_are_untouched() -> None:
    q = torch.randn(1, 2, 8, 4)
    with fused_attention_on_meta():
        inside = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        grouped = F.scaled_dot_product_attention(
            torch.randn(1, 4, 8, 4, device="meta"), torch.randn(1, 2, 8, 4, device="meta"),
            torch.randn(1, 2, 8, 4, device="meta"), enable_gqa=True)
    assert torch.equal(inside, F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert grouped.shape == (1, 4, 8, 4) and grouped.is_meta
