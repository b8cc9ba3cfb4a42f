"""Fixtures shared by the distributed test modules.

``worlds``: one :class:`dist_harness.Worlds` per test module (module scope), closed when the
module's tests are done, so at most one set of worker processes is alive at a time. A module
whose checks run whole Trainer fits sets ``WORLD_TIMEOUT`` (seconds per check) above the
harness default.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from dist_harness import DEFAULT_TIMEOUT, Worlds


@pytest.fixture(scope="module")
def worlds(request: pytest.FixtureRequest) -> Iterator[Worlds]:
    w = Worlds(timeout=getattr(request.module, "WORLD_TIMEOUT", DEFAULT_TIMEOUT))
    yield w
    w.close()
