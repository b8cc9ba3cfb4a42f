"""``batch_bytes_per_rank``: the batch bytes each rank receives per training step, against the
bytes of the rows its program reads.

W=4 as P=2 x G=2 (``GeneralParallel("1f1b", data_parallel_size=2)``), the benchmark GPT made
small (the row counts bytes, not time), 4 rows per rank, 3 steps. Received: every tensor a rank
receives through ``torch.distributed.batch_isend_irecv`` (the row exchange's transport) or
``torch.distributed.all_gather`` (the whole-batch gather it replaced), counted by wrapping both
in the launched process, outside the engine (:class:`ReceivedRows`), between
``on_train_batch_start`` and ``on_train_batch_end``. Read: the rows of the microbatches whose
first stage (inputs) or last stage (targets) the rank computes (``engine.step_rows.needed_micros`` off
the running plan), its own rows included, times the bytes of a row. The row count exchange
(two int64 per rank) is not batch data and is not counted.

Ours is the worst rank's received bytes per steady step (after the first: there the build
probes microbatch 0 on every rank, reported in the notes), the anchor that rank's read bytes;
goal <= 1.00 on every rank. Before rows moved point to point, every rank received the whole
global batch less its own rows (``extra.gather_bytes``).

    python -m benchmarks.bench_batch_bytes
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import Result, bench_main, launch_ranks

WORLD, G, PER_RANK, STEPS = 4, 2, 4, 3
SHAPE = {"layers": 2, "dim": 64, "heads": 4}


class ReceivedRows:
    """Every tensor this process receives through ``dist.batch_isend_irecv`` or
    ``dist.all_gather`` while entered, as ``(source rank, tensor)``: both wrapped, so the count
    is taken outside the engine (tests/test_data_parallel_batches.py reads it too)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.received: list[tuple[int, Any]] = []
        self._saved = (dist.batch_isend_irecv, dist.all_gather)

    def __enter__(self) -> ReceivedRows:
        dist, (batched, gather) = self.dist, self._saved

        def batch_isend_irecv(ops: list[Any]) -> Any:
            self.received += [(op.peer, op.tensor) for op in ops if op.op is dist.irecv]
            return batched(ops)

        def all_gather(tensors: list[Any], tensor: Any, group: Any = None,
                       async_op: bool = False) -> Any:
            out = gather(tensors, tensor, group=group, async_op=async_op)
            me = dist.get_rank()
            self.received += [(r, t) for r, t in enumerate(tensors) if r != me]
            return out

        dist.batch_isend_irecv, dist.all_gather = batch_isend_irecv, all_gather
        return self

    def __exit__(self, *exc: object) -> None:
        self.dist.batch_isend_irecv, self.dist.all_gather = self._saved

    def rows(self, since: int = 0) -> int:
        return sum(t.shape[0] for _, t in self.received[since:])

    def bytes(self, since: int = 0) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.received[since:])


def _step_counter(seen: ReceivedRows, world: int) -> Any:
    """A callback recording, per step, the bytes received and the bytes of the rows read."""
    import lightning.pytorch as pl
    import torch

    from lightning_gsched.engine.step_rows import needed_micros

    class StepBytes(pl.Callback):
        def __init__(self) -> None:
            self.mark, self.row_bytes, self.steps = 0, 0, []

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, *args: Any) -> None:
            self.mark = len(seen.received)
            tensors = [t for t in batch if isinstance(t, torch.Tensor)]
            self.row_bytes = sum(t[0].numel() * t.element_size() for t in tensors)

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            plan = trainer.strategy.engine.train_plan
            micro_rows = PER_RANK * world // plan.micro  # training: equal microbatches
            read = len(needed_micros(plan.table.compute, world)[trainer.global_rank])
            self.steps.append({"received": seen.bytes(self.mark),
                               "read": read * micro_rows * self.row_bytes,
                               "global": PER_RANK * world * self.row_bytes})

    return StepBytes()


def batch_bytes_run(rank: int, world: int) -> dict[str, Any]:
    """One fit on this launched rank; its per-step received and read bytes."""
    from benchmarks.lit_runs import run_fit
    from benchmarks.model import GPTShape
    from lightning_gsched import GeneralParallel

    with ReceivedRows() as seen:
        counter = _step_counter(seen, world)
        run_fit(GeneralParallel("1f1b", data_parallel_size=G), rank, world, STEPS, PER_RANK,
                GPTShape(**SHAPE), [counter])
    return {"steps": counter.steps}


def _row(ranks: list[dict[str, Any]]) -> Result:
    steady = [[s for s in r["steps"][1:]] for r in ranks]
    worst = max(range(len(ranks)),
                key=lambda r: max(s["received"] / s["read"] for s in steady[r]))
    received = max(s["received"] for s in steady[worst])
    read = min(s["read"] for s in steady[worst])
    per_rank = ", ".join(f"r{r} {max(s['received'] for s in steps) / 1024:.1f}/"
                         f"{min(s['read'] for s in steps) / 1024:.1f}"
                         for r, steps in enumerate(steady))
    first = ", ".join(f"r{r} {ranks[r]['steps'][0]['received'] / 1024:.1f}"
                      for r in range(len(ranks)))
    total = ranks[0]["steps"][0]["global"]
    gather = total - total // len(ranks)
    return Result(
        "batch_bytes_per_rank", received, read, goal="<= 1.00", unit="bytes",
        notes=(f"W={WORLD} as 1f1b 2 x {G}, {PER_RANK} rows/rank; received/read KiB per steady "
               f"step: {per_rank}; first step (microbatch 0 to every rank for the build): "
               f"{first}; the old whole-batch gather: {gather / 1024:.1f} KiB per rank"),
        extra={"per_rank_steps": [r["steps"] for r in ranks], "gather_bytes": gather,
               "worst_rank": worst})


def run(quick: bool) -> list[Result]:
    """The row (the same work quick or not: 3 steps on 4 processes)."""
    return [_row(launch_ranks("benchmarks.bench_batch_bytes:batch_bytes_run", WORLD))]


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, __doc__.splitlines()[0], run, None, "", short=True)


if __name__ == "__main__":
    main()
