"""The model cut into the schedule's stages at the build: one partition per rank, all alike.

Why a module of its own: the cut is the build's one step with a policy of its own. Every rank
traces and cuts the model itself (each keeps its own stage modules), and every rank must cut
at the same places. With ``balance="time"`` the places come from measured unit costs, which
differ between ranks and runs, so rank 0 measures and cuts, one broadcast gives every rank its
costs (:mod:`.rank_zero`), and the others cut with them; rank 0 keeps its own partition and
only verifies it. Any other balance is deterministic: each rank cuts alone.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_gsched.engine.control import Collective
from lightning_gsched.engine.options import PartitionOptions
from lightning_gsched.engine.rank_zero import decided_by_rank_zero
from lightning_gsched.errors import GschedError, PartitionError
from lightning_gsched.partition import Partition, partition
from lightning_gsched.partition.verify import check_verify, verify_split


def cut_model(module: nn.Module, stages: int, options: PartitionOptions,
              args: tuple[Any, ...], kwargs: dict[str, Any], *, rank: int, world_size: int,
              group: Any, collective: Collective) -> Partition:
    """``module`` cut into ``stages`` stages on its call ``args``/``kwargs`` (collective with
    ``balance="time"``, see the module doc), verified as ``options.verify`` asks; an error of
    the partitioner says which model and stage count it could not split."""
    common: dict[str, Any] = dict(balance=options.balance, leaf_modules=options.leaf_modules,
                                  split_points=options.split_points,
                                  static_shapes=options.static_shapes)
    unit_costs = None
    measured: list[Partition] = []  # rank 0's own partition, with balance="time"
    if options.balance == "time" and world_size > 1:

        def measure() -> Any:
            measured.append(partition(module, stages, args, kwargs, verify=False, **common))
            return measured[0].unit_costs

        unit_costs = decided_by_rank_zero(
            "the partition's broadcast", measure, rank=rank, world_size=world_size,
            group=group, collective=collective,
            failure=lambda failed: PartitionError(
                f"rank 0 could not partition the model: {failed.text}"))
    try:
        if measured:  # the cut the others make from its costs: only verify it
            measured[0].verified = verify_split(measured[0], args, kwargs,
                                                check_verify(options.verify))
            return measured[0]
        return partition(module, stages, args, kwargs, unit_costs=unit_costs,
                         verify=options.verify, **common)
    except GschedError as exc:
        raise type(exc)(
            f"GeneralParallel could not split {type(module).__name__}.forward into "
            f"{stages} stages: {exc}"
        ) from exc
