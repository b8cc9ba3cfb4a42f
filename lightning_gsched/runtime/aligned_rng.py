"""A tensor-parallel worker's ranks draw the same random numbers: their generators aligned.

Why: every activation a tensor-parallel plan leaves whole is computed by each of the worker's T
ranks, dropout included, and must come out the same on each: a rank whose dropout mask differs
holds a different "replicated" activation, its row-wise layers add partial sums made from
different inputs, and the whole parameters (embeddings, norms) get different gradients on each
rank and drift apart. The ranks' generators are not equal by themselves: the build runs code on
some ranks only (rank 0 traces, verifies and measures the model, each draws), and a user may
seed each rank apart (``seed_everything(base + rank)``, so that data-parallel replicas draw
different masks). So the engine aligns them within each worker (:func:`align_generators`): the
worker's first rank's states (the CPU generator's, the training device's, and Python's and
numpy's global generators: a layer drop drawn with ``random.random()`` runs in a module kept
whole, :mod:`lightning_gsched.host_random`, and ranks deciding apart would run different
collectives) go to its other ranks, before the build's check runs and once more before the
first step. From there every rank of a worker runs the same program on the same shapes and
draws the same numbers. Workers keep their own streams (replicas still draw different masks).
As in torch's tensor parallelism outside DTensor's own random-number tracker, a dropout on a
sharded activation then draws the same pattern on every shard (Megatron-LM draws those from a
per-rank stream: not done here).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_gsched.host_random import host_states, set_host_states


def align_generators(group: Any, device: torch.device) -> None:
    """Every rank of ``group`` takes the random-number generator states of the group's first
    rank: the CPU generator's, ``device``'s where it is a CUDA device, Python's and numpy's
    (collective over ``group``; its backend carries ``device``'s tensors)."""
    carrier = device if device.type == "cuda" else torch.device("cpu")
    state = torch.get_rng_state().to(carrier)
    dist.broadcast(state, group=group, group_src=0)
    torch.set_rng_state(state.cpu())
    if device.type == "cuda":
        cuda_state = torch.cuda.get_rng_state(device).to(carrier)
        dist.broadcast(cuda_state, group=group, group_src=0)
        torch.cuda.set_rng_state(cuda_state.cpu(), device)
    host = [host_states()]
    dist.broadcast_object_list(host, group=group, group_src=0, device=carrier)
    set_host_states(host[0])
