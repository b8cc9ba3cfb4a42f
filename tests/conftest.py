"""Fixtures shared by the distributed test modules.

``worlds``: one test module's view (:class:`dist_harness.Worlds`) of the session's worker
processes, one set per world size, started when first asked for and kept until the session ends
(``_world_pool``). A module whose checks run whole Trainer fits sets ``WORLD_TIMEOUT`` (seconds
per check) above the harness default. ``world``: that module's W=2 world, for modules that need
no other size.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from dist_harness import DEFAULT_TIMEOUT, WorldPool, Worlds


@pytest.fixture(scope="session")
def _world_pool() -> Iterator[WorldPool]:
    pool = WorldPool()
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def worlds(request: pytest.FixtureRequest, _world_pool: WorldPool) -> Iterator[Worlds]:
    w = Worlds(_world_pool, timeout=getattr(request.module, "WORLD_TIMEOUT", DEFAULT_TIMEOUT))
    yield w
    w.close()


@pytest.fixture(scope="module")
def world(worlds: Worlds) -> Any:
    return worlds.get(2)


@pytest.fixture(autouse=True)
def _restore_lightning_rank() -> Iterator[None]:
    """Put Lightning's process-wide ``rank_zero_only.rank`` back after every test.

    Constructing a Trainer for another global rank (the fake-SLURM test builds one for rank 3)
    sets that attribute for the whole pytest process; a later single-process reference Trainer
    would then skip everything rank-zero-only, e.g. its CSVLogger would write no metrics.csv.
    """
    from lightning_utilities.core.rank_zero import rank_zero_only

    rank = getattr(rank_zero_only, "rank", 0)
    yield
    rank_zero_only.rank = rank


# what lightning.fabric.utilities.seed.seed_everything leaves in the environment
_SEED_VARIABLES = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@pytest.fixture(autouse=True)
def _restore_seed_environment() -> Iterator[None]:
    """Put Lightning's seed variables back after every test.

    A LightningCLI run in this process (tests/test_lightning_launch.py) calls
    ``seed_everything``, which exports ``PL_GLOBAL_SEED``. Worker processes started later
    inherit it, and Lightning's DDP set-up (``reset_seed``) re-seeds every rank from it, so a
    later module's deferred model was initialised from another seed than its single-process
    reference (test_lightning_deferred failed when it ran after test_lightning_launch).
    """
    import os

    saved = {name: os.environ.get(name) for name in _SEED_VARIABLES}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def one_rank_job() -> Iterator[None]:
    """For a test that launches a one-rank Fabric job in the pytest process: Fabric's launch
    sets MASTER_ADDR/PORT and a default process group here; both are undone afterwards, so
    later tests in the worker see neither (a SLURM test read the address)."""
    import os

    import torch.distributed as dist

    saved = dict(os.environ)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
