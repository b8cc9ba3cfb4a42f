"""lightning_gsched: every distributed-training scheme from one generic scheduler.

The top-level package stays import-light: the pure-Python planner (``lightning_gsched.schedule``)
and the ``gsched`` CLI must not pay for importing torch. Torch-backed names are loaded on first
attribute access.
"""

from __future__ import annotations

from typing import Any

from lightning_gsched.errors import GschedError

__version__ = "0.1.0"
__all__ = [
    "GeneralParallel",
    "GeneralParallelFabric",
    "GschedError",
    "__version__",
    "grad_norm",
    "measure_stage_bytes",
    "profile_stages",
]

_LAZY = {
    "partition": "lightning_gsched.partition",
    "runtime": "lightning_gsched.runtime",
    "measure": "lightning_gsched.measure",
    "engine": "lightning_gsched.engine",
    "lightning": "lightning_gsched.lightning",
    "fabric": "lightning_gsched.fabric",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        return importlib.import_module(_LAZY[name])
    if name == "GeneralParallel":
        return importlib.import_module("lightning_gsched.lightning").GeneralParallel
    if name == "grad_norm":
        return importlib.import_module("lightning_gsched.lightning").grad_norm
    if name == "GeneralParallelFabric":
        return importlib.import_module("lightning_gsched.fabric").GeneralParallelFabric
    if name in ("profile_stages", "measure_stage_bytes"):
        return getattr(importlib.import_module("lightning_gsched.measure"), name)
    raise AttributeError(f"module 'lightning_gsched' has no attribute {name!r}")


def _register_if_lightning_loaded() -> None:
    """``Trainer(strategy="gsched_fslpp")`` and ``Fabric(strategy="gsched_fslpp")`` need the
    names registered; when Lightning is already imported (torch is then loaded anyway)
    importing lightning_gsched is enough."""
    import importlib
    import sys

    if "lightning.pytorch" in sys.modules:
        importlib.import_module("lightning_gsched.lightning")
    if "lightning.fabric" in sys.modules:
        importlib.import_module("lightning_gsched.fabric")


_register_if_lightning_loaded()
