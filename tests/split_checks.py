"""Checks shared by the real-model partition tests (Lightning demos here, third-party zoo).

A real model passes when, with ``partition()``'s DEFAULT options:

* the split is balanced: every stage holds parameters and none holds more than 1.5x an even
  share (``total / num_stages``) of the model's distinct parameter elements (a tied weight is
  counted in every stage that reads it, as in ``part.stage_param_counts``);
* no :class:`UnbalancedPartitionWarning` is raised;
* the stages, run in sequence (``part(...)``), compute the unsplit model's output exactly, with
  the same random numbers (same ops in the same order consume the RNG identically);
* the gradients of every parameter equal the unsplit model's, bit for bit. No tolerance: the
  stages run the same operations in the same order inside one autograd graph (``part(...)``
  chains them without detaching), so backward runs the same kernels in the same order too,
  including the summation of a tied embedding's two contributions;
* run as a pipeline runtime runs them (``models.run_stagewise``: detached at every boundary,
  backward stage by stage), the gradients match within ``rtol=1e-5, atol=1e-6``: the same
  per-operation gradients, but a value used by several later stages (a tied embedding, a
  residual or mask handed through) has its contributions summed in a different order, which
  may change the last bits of a float32 sum.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

import models
from lightning_gsched.partition import Partition, partition
from lightning_gsched.partition.errors import UnbalancedPartitionWarning

SHARE_LIMIT = 1.5  # a stage may hold up to this many even shares of the parameters


def parameter_shares(part: Partition) -> list[float]:
    """Per stage: parameter elements it reads / the model's distinct parameter elements."""
    total = sum(p.numel() for p in part.module.parameters())
    return [count / total for count in part.stage_param_counts]


def assert_balanced(part: Partition) -> None:
    shares = parameter_shares(part)
    rounded = [round(100 * s) for s in shares]
    assert all(s > 0 for s in shares), f"a stage without parameters: {rounded}%"
    limit = SHARE_LIMIT / part.num_stages
    assert max(shares) <= limit, f"a stage above {SHARE_LIMIT}x its share: {rounded}%"


def run_with_seed(fn: Callable[[], Any], seed: int) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return fn()


def tensor_leaves(output: Any, depth: int = 6) -> list[torch.Tensor]:
    """Every tensor reachable from an output: its pytree leaves (transformers' output objects
    are pytrees too) and, inside any other object (a cache), its attributes, lists and dicts."""
    found: list[torch.Tensor] = []

    def walk(obj: Any, level: int) -> None:
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif level and isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item, level - 1)
        elif level and isinstance(obj, dict):
            for item in obj.values():
                walk(item, level - 1)
        elif level and hasattr(obj, "__dict__") and not isinstance(obj, type):
            for item in vars(obj).values():
                walk(item, level - 1)

    for leaf in pytree.tree_leaves(output):
        walk(leaf, depth)
    return found


def assert_split_matches(
    make: Callable[[], nn.Module], args: tuple, num_stages: int, seed: int = 0
) -> Partition:
    """Partition a fresh model with default options; check balance, outputs and gradients."""
    module = models.seeded(seed, make)
    reference = models.seeded(seed, make)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnbalancedPartitionWarning)
        part = partition(module, num_stages, args)
    assert len(part.stages) == num_stages
    assert_balanced(part)
    out = run_with_seed(lambda: part(*args), seed + 1)
    # called as the split was traced (use_cache=False when forward has it and args omit it)
    expected = run_with_seed(lambda: reference(*args, **part.fixed_keywords), seed + 1)
    got_leaves, want_leaves = tensor_leaves(out), tensor_leaves(expected)
    assert got_leaves, "the output holds no tensor"
    assert all(torch.equal(a, b) for a, b in zip(got_leaves, want_leaves, strict=True))
    models.loss_of(out).backward()
    models.loss_of(expected).backward()
    want = models.parameter_grads(reference)
    got = models.parameter_grads(module)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        assert grad is not None and got[name] is not None, name
        assert torch.equal(got[name], grad), name
    # as a pipeline runtime runs them: detached at every boundary, backward stage by stage
    module.zero_grad(set_to_none=True)
    run_with_seed(lambda: models.run_stagewise(part.stages, args, {}), seed + 1)
    for name, grad in models.parameter_grads(module).items():
        assert grad is not None, name
        torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-6, msg=name)
    return part
