"""Where things sit in a (pipeline, data) layout of W = P x G ranks, for the torch anchors.

Why a module of its own (pure Python, no torch): the ``pp_dp_*`` rows are only a comparison if
torch's side puts the same stages on the same ranks and feeds each replica the same rows as our
plan does. These few rules are that contract, and ``tests/test_benchmarks_pp_dp.py`` checks
each of them against our planner (what rank ``p*G + g`` computes) and our batch cutting (which
rows a microbatch holds), so the anchor cannot drift from ours silently.

Our rules (``lightning_gsched/schedule/data_parallel.py``, ``engine/rows.py``):

* rank ``p*G + g`` is pipeline position ``p`` of replica ``g`` (torch's
  ``init_device_mesh("cpu", (P, G), mesh_dim_names=("pp", "dp"))`` gives the same ranks);
* replica ``g``'s batch is its ranks' DataLoader rows in position order (ranks ``p*G + g``),
  cut into ``B`` equal microbatches; its ``m``-th is the step's microbatch ``g + G*m`` (rows
  travel only inside their replica);
* a P-worker pipeline of S stages puts S/P consecutive stages on each position (S = P for
  replicate, S = 2P for shard at G=2: each rank of a column then owns one stage).
"""

from __future__ import annotations


def mesh_coords(rank: int, replicas: int) -> tuple[int, int]:
    """(pipeline position, replica) of ``rank`` with the data-parallel dimension innermost."""
    return divmod(rank, replicas)


def position_stages(stages: int, positions: int) -> list[list[int]]:
    """The stages each pipeline position computes: ``stages // positions`` consecutive ones."""
    if stages % positions:
        raise ValueError(f"{stages} stages do not split evenly over {positions} positions")
    per = stages // positions
    return [list(range(p * per, (p + 1) * per)) for p in range(positions)]


def replica_micros(replica: int, replicas: int, micros_per_replica: int) -> list[int]:
    """The global microbatch indices replica ``replica`` runs, in the order it runs them."""
    return [replica + replicas * j for j in range(micros_per_replica)]


def replica_rows(replica: int, replicas: int, micros_per_replica: int, rows: int,
                 positions: int) -> list[int]:
    """Rows of a global batch of ``rows`` rows (every rank's, in rank order) that replica
    ``replica`` reads: its ranks' rows in position order. Handed to torch's schedule, which
    cuts its input into equal chunks in order, its chunk j is our microbatch
    ``replica + replicas * j``."""
    parts = replicas * micros_per_replica
    if rows % parts:
        raise ValueError(f"{rows} rows do not cut into {parts} equal microbatches")
    per_rank = rows // (positions * replicas)
    return [rank * per_rank + i for p in range(positions)
            for rank in (p * replicas + replica,) for i in range(per_rank)]
