"""The Lightning strategy: ``Trainer(strategy=GeneralParallel("fslpp", R=2))``.

Importing this package registers ``gsched_<schedule>`` names with Lightning's StrategyRegistry
(``Trainer(strategy="gsched_1f1b")``). Modules, one job each: :mod:`.config` (arguments ->
plans), :mod:`.batches` (global batch, microbatches), :mod:`.intercept` (running the user's step
around ``self(...)``), :mod:`.logsync` (logged values), :mod:`.grads` (gradients between the
schedule and the optimizer loop, clipping), :mod:`.engine` (one run's pipeline),
:mod:`.checkpoint` / :mod:`.sharded` (checkpoints), :mod:`.strategy` (the Lightning class).
See ``docs/usage.md``.
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_gsched.lightning.strategy import GeneralParallel

__all__ = ["GeneralParallel"]

if "gsched_fslpp" not in StrategyRegistry:
    GeneralParallel.register_strategies(StrategyRegistry)
