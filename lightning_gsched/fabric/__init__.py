"""The Lightning Fabric front end: ``Fabric(strategy=GeneralParallelFabric("1f1b"))``.

Importing this package registers ``gsched_<schedule>`` names with Fabric's strategy registry
(``Fabric(strategy="gsched_1f1b", devices=2)``); Fabric's registry is not the Trainer's, so
each front end registers its own class. :mod:`.strategy` holds the class, a thin adapter over
the engine both front ends share (``lightning_gsched.engine``); nothing here imports
``lightning.pytorch`` or ``lightning_gsched.lightning``. See the "Fabric"
section of ``docs/usage.md``.
"""

from __future__ import annotations

from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_gsched.fabric.strategy import GeneralParallelFabric

__all__ = ["GeneralParallelFabric"]

if "gsched_fslpp" not in STRATEGY_REGISTRY:
    GeneralParallelFabric.register_strategies(STRATEGY_REGISTRY)
