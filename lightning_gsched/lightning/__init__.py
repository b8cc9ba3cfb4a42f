"""The Lightning strategy: ``Trainer(strategy=GeneralParallel("fslpp", R=2))``.

Importing this package registers ``gsched_<schedule>`` names with Lightning's StrategyRegistry
(``Trainer(strategy="gsched_1f1b")``). Modules, one job each: :mod:`.options` (the arguments
both front ends take), :mod:`.config` (arguments -> plans), :mod:`.batches` (global batch,
microbatches), :mod:`.intercept` (running the user's step around the model's call),
:mod:`.logsync` (losses and logged values), :mod:`.auto` (``schedule="auto"`` decided at the
first batch), :mod:`.engine` (one run's pipeline, shared with the Fabric strategy in
``lightning_gsched.fabric``), :mod:`.sharded` (sharded checkpoints),
:mod:`.strategy` (the Trainer class). Gradients, clipping and full checkpoints go through the
runtime's facade, ``lightning_gsched.runtime.ModelRuntime``. See ``docs/usage.md``.
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_gsched.lightning.strategy import GeneralParallel

__all__ = ["GeneralParallel"]

if "gsched_fslpp" not in StrategyRegistry:
    GeneralParallel.register_strategies(StrategyRegistry)
