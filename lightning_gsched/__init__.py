"""lightning_gsched: every distributed-training scheme from one generic scheduler.

The top-level package stays import-light: the pure-Python planner (``lightning_gsched.schedule``)
and the ``gsched`` CLI must not pay for importing torch. Torch-backed names are loaded on first
attribute access.
"""

from __future__ import annotations

from typing import Any

from lightning_gsched.errors import GschedError

__version__ = "0.1.0"
__all__ = ["GschedError", "__version__"]

_LAZY = {
    "partition": "lightning_gsched.partition",
    "runtime": "lightning_gsched.runtime",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return importlib.import_module(_LAZY[name])
    raise AttributeError(f"module 'lightning_gsched' has no attribute {name!r}")
