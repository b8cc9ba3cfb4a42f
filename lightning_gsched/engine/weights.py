"""The build's weights: the same values on every rank, a deferred model's parameters, shards.

Used by the engine's build (:meth:`.build.PipelineBuild.build`), in this order:

1. a model built with weights: rank 0's parameters and buffers broadcast to every rank
   (:func:`sync_module_states`), as DDP does when it wraps a model;
2. with ``tensor_parallel_size > 1``: every stage sharded over its worker's T ranks
   (:func:`shard_stages`). A model built without weights is sharded while still on the meta
   device, so that step 3 gives each rank only its pieces (:func:`pieces_of`); one built with
   weights after step 3 is skipped, from its full tensors;
3. a model built without weights (:func:`materialize`): each rank gives storage and values to
   the parameters it keeps, drawn from rank 0's seed, read from pretrained files, or restored
   from a checkpoint resumed into the model.

Each collective step runs through the engine's ``collective(what, fn)``, which turns a backend
failure into a fault naming what the ranks were doing.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_gsched.engine.checkpoint_sharded import DeferredRestore
from lightning_gsched.engine.control import Collective
from lightning_gsched.partition.replicated_grads import check_replicated_gradients
from lightning_gsched.partition.sharded_outputs import check_sharded_outputs, record_outputs
from lightning_gsched.partition.tensor_parallel import (
    TensorParallelPlan,
    parallelize_stages,
    sequence_patterns,
)
from lightning_gsched.partition.tensor_parallel_state import (
    global_view,
    region,
    sharded_parameter_specs,
    whole,
)
from lightning_gsched.runtime import (
    Piece,
    Pieces,
    PretrainedWeights,
    allocate_parameters,
    initialize_parameters,
    load_parameters,
    owned_parameters,
)
from lightning_gsched.schedule.program import Programs


def sync_module_states(module: nn.Module, group: Any = None) -> None:
    """Rank 0's parameters and buffers everywhere, as DDP does when it wraps a model.

    A deferred model's meta parameters have no values yet: each rank initialises the ones it
    keeps from rank 0's seed (:func:`agreed_seed`) instead."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if not tensor.is_meta:
                dist.broadcast(tensor.data, 0, group=group)


def agreed_seed(world_size: int, group: Any = None) -> int:
    """Rank 0's initial seed (``seed_everything``'s, or torch's own), the same on every rank:
    a deferred model's weights are a function of it (runtime/materialize.py)."""
    seed = torch.tensor([torch.initial_seed() % (2**62)], dtype=torch.int64)
    if world_size > 1:
        dist.broadcast(seed, 0, group=group)
    return int(seed.item())


def shard_stages(stages: Sequence[nn.Module], plan: TensorParallelPlan, tp_mesh: Any,
                 check_call: tuple[tuple[Any, ...], dict[str, Any]] | None,
                 collective: Collective) -> None:
    """Shard every stage over this worker's T ranks by the tensor-parallel plan (collective
    over the T ranks). Every stage, not only this worker's: a schedule that fetches stages
    (fsdp, fslpp) computes them all.

    ``check_call``: the build's microbatch (args, kwargs), on which the sharded stages then run
    once forward and backward, so that a model that cannot run on local sizes fails here on
    every rank, naming the module, and so does a parameter left whole whose gradient differs
    between the ranks (partition/replicated_grads.py) and a stage whose outputs differ from the
    whole stage's (partition/sharded_outputs.py); None for a model built without weights
    (the other workers' stages have none here to run)."""
    if check_call is None:
        collective("the stages' sharding", lambda: parallelize_stages(stages, plan, tp_mesh))
        return
    args, kwargs = check_call
    # the whole stages' outputs first, to compare the sharded ones with (sharded_outputs.py)
    whole = record_outputs(stages, args, kwargs)
    collective("the stages' sharding", lambda: parallelize_stages(stages, plan, tp_mesh))
    collective("the sharded stages' check", lambda: check_replicated_gradients(
        stages, args, kwargs, tp_mesh.get_group(), sequence_patterns(plan)))
    collective("the sharded stages' outputs", lambda: check_sharded_outputs(
        stages, args, kwargs, whole, tp_mesh.get_group()))


def pieces_of(module: nn.Module) -> Pieces:
    """Each sharded parameter of ``module`` as the piece of its full tensor this rank holds."""
    return {id(param): Piece(spec.shape, region(spec), partial(global_view, spec=spec),
                             partial(whole, spec=spec))
            for param, spec in sharded_parameter_specs(module)}


def materialize(module: nn.Module, stages: Sequence[nn.Module], programs: Programs,
                worker: int, seed: int, device: torch.device,
                init_weights: PretrainedWeights | None, restore: DeferredRestore | None,
                optimizers: Sequence[Any], pieces: Pieces, collective: Collective,
                reports: bool = True) -> None:
    """A model built without weights: the parameters ``worker`` keeps get storage and values,
    drawn from ``seed``, read from ``init_weights``, or restored from ``restore`` (a checkpoint
    resumed into the model, which overrides ``init_weights``; collective for a sharded
    directory). ``pieces``: the tensor-parallel shards this rank keeps of larger tensors.
    ``reports``: this rank warns of what every rank finds alike (rank 0)."""
    keep = owned_parameters(stages, programs, worker, module)
    if restore is not None:  # it fills every kept parameter (or names the one it lacks)
        allocate_parameters(keep, device, pieces)
        apply = restore.apply
        collective("the checkpoint's restore", lambda: apply(module, keep, optimizers, pieces))
        return
    rest = keep
    if init_weights is not None:
        rest = load_parameters(module, keep, init_weights, device, pieces, reports)
    if rest:
        initialize_parameters(module, rest, seed, device, pieces)
