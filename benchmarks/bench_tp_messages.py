"""``tp_messages``: one stage-boundary message between tensor-parallel workers, sent per rank
against sent once and broadcast (issue 35, item 3).

W=4 gloo CPU processes as P=2 workers x T=2 tensor-parallel ranks (worker w = ranks 2w, 2w+1,
as the runtime lays them out). Worker 0 holds a message of X bytes (float32) on both its ranks,
as a stage's replicated output is held, and worker 1 needs it on both of its:

* **ours, per rank** (what the runtime does, ``Channels(tensor_parallel_size=T)``): rank 0 ->
  rank 2 and rank 1 -> rank 3 at the same time (``isend`` / ``irecv``, then ``wait``);
* **anchor, once and broadcast**: rank 0 -> rank 2 (``isend`` / ``irecv``), then rank 2
  broadcasts it to rank 3 over worker 1's tensor-parallel group {2, 3}; rank 1 is idle.

One timed message: every rank leaves a barrier, moves its part, and reads the clock. Its time is
the last worker-1 rank's finish less the first rank's start, read on one clock
(``CLOCK_MONOTONIC``, shared by the processes of one machine), so it covers the whole transfer
whichever rank starts late. CPU: each rank's process CPU time (all threads, gloo's included)
over the same interval; "sender" sums worker 0's ranks, "receiver" worker 1's (rank 2's
broadcast counts as receiver work). Each rank of worker 1 checks the first message of every run
against the payload (a route that delivered other bytes fails the row).

Both routes run alternated in rounds (:mod:`benchmarks.rounds`, reused processes): in a round
each size's two routes run back to back, the order flipped every round; a route's run is
``WARMUP`` untimed messages then the size's count of timed ones (``QUICK`` / ``FULL``). Per
size, the row's ratio is the median over rounds of per-round median times, per rank /
broadcast: **below 1, per rank is faster**. Only worker 0 -> worker 1 is timed (activations
forward); gradients going back take the same routes in the other direction, not timed apart.

Bytes (arithmetic, :func:`wire_bytes`, not measured): both routes leave X on every rank of
worker 1 and move 2X in all (T X for T ranks). Per rank moves T X between the workers at once
(every rank of worker 0 sends X, every rank of worker 1 receives X); once + broadcast moves X
between the workers, then (T - 1) X inside worker 1 (rank 0 sends X; rank 2 receives X and
sends it on).

    python -m benchmarks.bench_tp_messages [--quick] [--json]
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.common import Result, bench_main, median
from benchmarks.rounds import Side, SideRuns, measure, ratio_result

MODULE = "benchmarks.bench_tp_messages"
NAME = "tp_messages"
WORLD, T = 4, 2  # P = WORLD / T = 2 workers; worker w = ranks w*T .. w*T + T - 1
ROUTES = ("per_rank", "broadcast")  # ours, anchor
WARMUP = 2  # untimed messages at the start of every run (first touch, connections)
KIB, MIB = 2**10, 2**20
# activation-sized messages (size: timed messages per route and round): the benchmark GPT's
# microbatch boundary is 4 x 64 x 256 float32 = 256 KiB, its whole 16-row batch 1 MiB; 8 and
# 32 MiB stand for larger models' activations. Small messages take more repetitions: their
# times (well under a millisecond) scatter most on the shared cores
QUICK = {"sizes": {64 * KIB: 60, 1 * MIB: 40, 8 * MIB: 20}, "rounds": 4}
FULL = {"sizes": {64 * KIB: 100, 1 * MIB: 60, 8 * MIB: 30, 32 * MIB: 20}, "rounds": 8}
GOAL = "<= 1.00 keeps per rank"

_groups: dict[tuple[int, ...], Any] = {}


def size_label(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB and size % MIB == 0 else f"{size // KIB} KiB"


def wire_bytes(route: str, size: int, t: int = T) -> dict[str, Any]:
    """What a route moves for one message of ``size`` bytes from a worker of ``t`` ranks to the
    next: bytes between the workers, bytes inside the receiving worker, how many transfers
    follow one another, and per rank (worker 0's ``t`` ranks, then worker 1's) bytes sent and
    received."""
    if route == "per_rank":
        return {"between_workers": t * size, "inside_worker": 0, "hops_in_sequence": 1,
                "sent": [size] * t + [0] * t, "received": [0] * t + [size] * t}
    if route == "broadcast":
        # worker 1's t = 0 sends each of its t - 1 peers a copy (exact for t = 2, the measured
        # case; a tree or a ring moves the same total, spread over more senders and steps)
        return {"between_workers": size, "inside_worker": (t - 1) * size, "hops_in_sequence": 2,
                "sent": [size] + [0] * (t - 1) + [(t - 1) * size] + [0] * (t - 1),
                "received": [0] * t + [size] * t}
    raise ValueError(f"route must be one of {ROUTES}, got {route!r}")


def _clock() -> float:
    """One clock for every process of the machine, so ranks' readings compare."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def _group(ranks: tuple[int, ...]) -> Any:
    """A process group, made on first use (by every rank: each calls :func:`messages` in the
    same order) and kept for the later runs of the same processes."""
    import torch.distributed as dist

    if ranks not in _groups:
        _groups[ranks] = dist.new_group(list(ranks))
    return _groups[ranks]


def _move(route: str, rank: int, payload: Any, recv: Any, tp: Any) -> None:
    """One message from worker 0 to worker 1 by ``route``, this rank's part of it."""
    import torch.distributed as dist

    worker, t = divmod(rank, T)
    if route == "per_rank":
        if worker == 0:
            dist.isend(payload, T + t).wait()
        else:
            dist.irecv(recv, t).wait()
    elif route == "broadcast":
        if worker == 0:
            if t == 0:
                dist.isend(payload, T).wait()
            return  # rank 1 idle
        if t == 0:
            dist.irecv(recv, 0).wait()
        dist.broadcast(recv, src=T, group=tp)
    else:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")


def messages(rank: int, world: int, route: str, size: int, count: int) -> dict[str, Any]:
    """One run of ``route`` on this rank: ``count`` messages of ``size`` bytes, one at a time.

    Returns ``times`` (each message's time, from the first rank's start to the last receiver's
    finish, the same list on every rank) and ``cpu_times`` (this rank's process CPU seconds per
    message), the fields :mod:`benchmarks.rounds` reads."""
    import torch
    import torch.distributed as dist

    if world != WORLD:
        raise ValueError(f"the benchmark runs on {WORLD} processes, got {world}")
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    tp = _group(tuple(range(T, 2 * T)))  # worker 1's tensor-parallel group
    payload = torch.randn(size // 4, generator=torch.Generator().manual_seed(size))
    recv = torch.zeros_like(payload)
    starts, ends, cpu = [], [], []
    for i in range(count):
        dist.barrier()
        c0, t0 = time.process_time(), _clock()
        _move(route, rank, payload, recv, tp)
        t1, c1 = _clock(), time.process_time()
        starts.append(t0)
        ends.append(t1)
        cpu.append(c1 - c0)
        if i == 0 and rank >= T and not torch.equal(recv, payload):
            raise RuntimeError(f"{route}: rank {rank} received other bytes than worker 0 sent")
    clocks: list[Any] = [None] * world
    dist.all_gather_object(clocks, (starts, ends))
    times = [max(clocks[r][1][i] for r in range(T, 2 * T)) - min(c[0][i] for c in clocks)
             for i in range(count)]
    return {"times": times, "cpu_times": cpu}


def _side_cpu(runs: SideRuns, ranks: range) -> float:
    """Median over every steady message of every round of the CPU seconds of ``ranks``."""
    per_message = []
    for r in range(runs.rounds):
        per_rank = [runs.outputs[r][k]["cpu_times"][runs.warmup:] for k in ranks]
        per_message += [sum(step) for step in zip(*per_rank, strict=True)]
    return median(per_message)


def size_row(size: int, ours: SideRuns, anchor: SideRuns) -> Result:
    """One size's row: both routes' message times, their ratio over rounds, CPU and bytes."""
    figures: dict[str, Any] = {}
    for route, runs in zip(ROUTES, (ours, anchor), strict=True):
        wall = median(runs.all_wall())
        figures[route] = {
            "median_us": 1e6 * wall, "gbytes_per_s": size / wall / 1e9,
            "cpu_sender_us": 1e6 * _side_cpu(runs, range(T)),
            "cpu_receiver_us": 1e6 * _side_cpu(runs, range(T, 2 * T)),
            "cpu_total_us": 1e6 * median(runs.all_cpu()), **wire_bytes(route, size)}
    a, b = figures["per_rank"], figures["broadcast"]
    notes = (f"W={WORLD} = P=2 x T={T}, gloo on loopback; one message of {size_label(size)} from "
             f"worker 0 to worker 1: per rank (0->2 and 1->3 at once) {a['median_us']:.0f} us, "
             f"once + broadcast (0->2, then 2->3 over group {{2, 3}}) {b['median_us']:.0f} us "
             f"(median per message, first rank's start to last receiver's end); CPU per "
             f"message, senders/receivers: per rank {a['cpu_sender_us']:.0f}/"
             f"{a['cpu_receiver_us']:.0f} us, broadcast {b['cpu_sender_us']:.0f}/"
             f"{b['cpu_receiver_us']:.0f} us; bytes between workers {size_label(a['between_workers'])}"
             f" at once vs {size_label(b['between_workers'])} then "
             f"{size_label(b['inside_worker'])} inside worker 1")
    result = ratio_result(f"{NAME}[{size_label(size)}]", ours, anchor, GOAL, notes,
                          extra={"size_bytes": size, "world": WORLD, "tensor_parallel_size": T,
                                 **{route: figures[route] for route in ROUTES}})
    # every steady message per round in microseconds (rounds.py keeps 0.1 ms, too coarse here)
    for key, runs in (("ours_round_ms", ours), ("anchor_round_ms", anchor)):
        del result.extra[key]
        result.extra[key.replace("_ms", "_us")] = [[round(1e6 * t) for t in runs.wall(r)]
                                                   for r in range(runs.rounds)]
    return result


def run(quick: bool) -> list[Result]:
    """One row per size: every size's two routes alternated in one launch of W=4 processes."""
    cfg = QUICK if quick else FULL
    sizes: dict[int, int] = cfg["sizes"]
    sides = {f"{route}[{size}]": Side(f"{MODULE}:messages", {"route": route, "size": size,
                                                            "count": WARMUP + reps})
             for size, reps in sizes.items() for route in ROUTES}
    runs = measure(sides, WORLD, cfg["rounds"], WARMUP)
    return [size_row(size, runs[f"per_rank[{size}]"], runs[f"broadcast[{size}]"])
            for size in sizes]


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, __doc__.splitlines()[0], run, None, "",
               skip_keys=("ours_round_us", "anchor_round_us"), short=True)


if __name__ == "__main__":
    main()
