"""CPU cost of the transport alone: B activations of one shape sent rank 0 -> rank 1 per step.

Not a row of ``benchmarks/run.py``: a microbenchmark for comparing two versions of
``lightning_gsched.runtime.transport`` on the same machine (run it once with each version on
``PYTHONPATH``). Each step rank 0 sends ``--micro`` activations of ``--shape`` (default: the
``pipeline_vs_torch`` boundary activation of a 4-row microbatch, 4 x 64 x 256 float32, 256 KiB)
through ``Transport.send_pytree``; rank 1 posts every receive first, then waits for each, as a
program does. Reported: median process CPU time and wall time per step on each rank, over
``--steps`` steps after ``--warmup`` (the first steps describe the messages).

    PYTHONPATH=$PWD python -m benchmarks.transport_micro [--steps 200] [--micro 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, port: int, args: Any, out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from lightning_gsched.runtime import wire
    from lightning_gsched.runtime.channels import Channels
    from lightning_gsched.runtime.faults import Waiter
    from lightning_gsched.runtime.transport import Transport
    from lightning_gsched.schedule import plan

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", rank=rank, world_size=2, store=store)
    programs = plan("gpipe", workers=2).programs
    channels = Channels(programs, timeout=60)
    transport = Transport(channels, Waiter(rank, channels, 60, lambda: "bench"),
                          torch.device("cpu"))
    shape = tuple(args.shape)
    x = torch.randn(*shape, requires_grad=True)
    cpu, wall = [], []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            transport.begin_step(programs, ("bench", shape))
        except TypeError:  # the version before step signatures
            transport.begin_step(programs)
        if rank == 0:
            for b in range(args.micro):
                y = x * 1.0  # an output with a graph, as a stage's
                transport.send_pytree(wire.split(y), 1, f"SEND_ACT s0 b{b}")
        else:
            posted = [transport.post_pytree(0, f"RECV_ACT s0 b{b}") for b in range(args.micro)]
            for message in posted:
                transport.wait_pytree(message)
        getattr(transport, "flush", getattr(transport, "flush_headers", None))()
        transport.drain_sends()
        transport.end_step()
        if step >= args.warmup:
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
    out.put((rank, statistics.median(cpu), statistics.median(wall)))
    channels.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--shape", type=int, nargs="+", default=[4, 64, 256])
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    for rank, cpu, wall in results:
        role = "sender" if rank == 0 else "receiver"
        print(f"rank {rank} ({role}): cpu {cpu * 1e3:.3f} ms/step, wall {wall * 1e3:.3f} ms/step, "
              f"{args.micro} messages of {tuple(args.shape)} per step")


if __name__ == "__main__":
    main()
