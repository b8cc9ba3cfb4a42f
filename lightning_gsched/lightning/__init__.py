"""The Lightning strategy: ``Trainer(strategy=GeneralParallel("fslpp", R=2))``.

Importing this package registers ``gsched_<schedule>`` names with Lightning's StrategyRegistry
(``Trainer(strategy="gsched_1f1b")``). The pipeline itself (arguments, plans, batches, the
user's step, logs, ``schedule="auto"``, the step) is the engine both front ends share,
``lightning_gsched.engine``. Modules here, the Trainer's side only: :mod:`.strategy` (the
Trainer class), :mod:`.hook_failure` (which hook failed; the first ``on_exception`` callback),
:mod:`.preemption` (SIGTERM/SIGUSR1 agreed at a step boundary), :mod:`.outputs_read` (whether
a batch-end hook reads a step's return), :mod:`.grad_norm` (Lightning's ``grad_norm`` over
every rank's gradients). Checkpoints (full or sharded,
gathered or streamed, atomic, checked on every rank) are the engine's ``CheckpointService``,
which the strategy's checkpoint hooks call; gradients and clipping go through the runtime's
facade, ``lightning_gsched.runtime.ModelRuntime``. See ``docs/usage.md``.
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_gsched.lightning.grad_norm import grad_norm
from lightning_gsched.lightning.strategy import GeneralParallel

__all__ = ["GeneralParallel", "grad_norm"]

if "gsched_fslpp" not in StrategyRegistry:
    GeneralParallel.register_strategies(StrategyRegistry)
