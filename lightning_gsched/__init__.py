"""lightning_gsched: every distributed-training scheme from one generic scheduler.

The top-level package stays import-light: the pure-Python planner (``lightning_gsched.schedule``)
and the ``gsched`` CLI must not pay for importing torch. Torch-backed names are loaded on first
attribute access.
"""

from __future__ import annotations

from typing import Any

from lightning_gsched.errors import GschedError

__version__ = "0.1.0"
__all__ = ["GeneralParallel", "GschedError", "__version__"]

_LAZY = {
    "partition": "lightning_gsched.partition",
    "runtime": "lightning_gsched.runtime",
    "lightning": "lightning_gsched.lightning",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        return importlib.import_module(_LAZY[name])
    if name == "GeneralParallel":
        return importlib.import_module("lightning_gsched.lightning").GeneralParallel
    raise AttributeError(f"module 'lightning_gsched' has no attribute {name!r}")


def _register_if_lightning_loaded() -> None:
    """``Trainer(strategy="gsched_fslpp")`` needs the names registered; when Lightning is already
    imported (torch is then loaded anyway) importing lightning_gsched is enough."""
    import sys

    if "lightning.pytorch" in sys.modules:
        import importlib

        importlib.import_module("lightning_gsched.lightning")


_register_if_lightning_loaded()
