"""What every benchmark shares: results, medians, the benchmark model, and a torchrun-like launcher.

Also what the ``bench_*`` modules' command lines share: cProfile summaries in ms per step,
row printing, and the ``[--quick] [--json] [--profile]`` command line (:func:`bench_main`).

Why a launcher of our own: each measured configuration runs in fresh interpreters (no state or
warm caches carried over from the previous configuration), W processes started like torchrun
(``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*`` in the environment). Lightning sees
``LOCAL_RANK`` and uses the processes as they are; plain torch baselines call
``init_process_group("gloo")`` from the same variables. Every process runs with one intra-op
thread (``OMP_NUM_THREADS=1``): on the 2-core machine two ranks then use one core each, and both
sides of every ratio run with the same setting.

A job is ``module:function`` plus JSON keyword arguments; each rank calls it and rank 0's return
value (JSON) comes back to the parent
(:func:`launch`), or every rank's (:func:`launch_ranks`).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
THREADS_PER_RANK = 1


def core_plan(world_size: int) -> list[int | None]:
    """The core each rank is pinned to (``None``: not pinned).

    Why pin: a rank's gloo threads (the ones that move its sends and receives) are separate OS
    threads. Unpinned, on the 2-core machine the scheduler runs rank 0's gloo thread on the core
    where rank 1 is computing whenever it likes, so one rank's messages steal the other rank's
    compute time at moments that differ from run to run: the main reason a round's ratio moved
    by 10-20%. Pinned, every thread of rank r (its compute and its gloo threads, which inherit
    the affinity) shares core r, so a message costs CPU on the rank that sends or receives it,
    which is also what the planner's cost model charges. Both sides of every ratio run pinned
    the same way. With fewer cores than ranks, or ``GSCHED_BENCH_PIN=0`` in the environment,
    nothing is pinned.
    """
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return [None] * world_size
    if os.environ.get("GSCHED_BENCH_PIN", "1") == "0" or len(cores) < world_size:
        return [None] * world_size
    return [cores[rank] for rank in range(world_size)]


@dataclass
class Result:
    """One row of the table: our median step time, the anchor's, and ours / anchor.

    Rows measured in alternated rounds (:mod:`benchmarks.rounds`) also carry the ratio of every
    round (``round_ratios``): their ``ratio`` is then the median of those, and ``spread`` their
    minimum and maximum, printed next to the ratio. ``ours_cpu_s`` / ``anchor_cpu_s``: median
    process CPU seconds per step summed over all ranks (``None`` where not measured), and
    ``round_cpu_ratios`` the CPU ratio of every round, so a reader sees whether a wall-time gap
    is work (CPU ratio moves with it) or waiting (it does not).
    """

    name: str
    ours_s: float | None
    anchor_s: float | None
    goal: str = ""
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    unit: str = "seconds"  # what ours_s / anchor_s hold: "seconds", or "bytes" (memory rows)
    round_ratios: list[float] = field(default_factory=list)
    ours_cpu_s: float | None = None
    anchor_cpu_s: float | None = None
    round_cpu_ratios: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        if self.round_ratios:
            return median(self.round_ratios)
        if self.ours_s is None or self.anchor_s is None or self.anchor_s == 0:
            return None
        return self.ours_s / self.anchor_s

    @property
    def spread(self) -> tuple[float, float] | None:
        """(min, max) of the per-round ratios; ``None`` for rows not measured in rounds."""
        if len(self.round_ratios) < 2:
            return None
        return min(self.round_ratios), max(self.round_ratios)

    @property
    def cpu_ratio(self) -> float | None:
        if self.round_cpu_ratios:
            return median(self.round_cpu_ratios)
        if self.ours_cpu_s is None or not self.anchor_cpu_s:
            return None
        return self.ours_cpu_s / self.anchor_cpu_s

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ratio"] = self.ratio
        out["spread"] = self.spread
        out["cpu_ratio"] = self.cpu_ratio
        return out


def median(values: list[float]) -> float:
    if not values:
        raise ValueError("no samples to take a median of")
    return float(statistics.median(values))


def spread(values: list[float]) -> float:
    """Interquartile range over the median: how noisy a set of step times was."""
    if len(values) < 4:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return float((q[2] - q[0]) / statistics.median(values))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LaunchError(RuntimeError):
    """A benchmark job failed on some rank; carries every failing rank's output."""


def launch(target: str, world_size: int, timeout: float = 600.0, **kwargs: Any) -> Any:
    """Run ``target`` (``"module:function"``) on ``world_size`` fresh processes; rank 0's result.

    The function is called as ``fn(rank, world_size, **kwargs)``; kwargs must be JSON values.
    """
    return launch_ranks(target, world_size, timeout, **kwargs)[0]


def launch_ranks(target: str, world_size: int, timeout: float = 600.0, **kwargs: Any) -> list[Any]:
    """:func:`launch`, returning every rank's result (``None`` where one was not JSON)."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="gsched_bench_") as tmp:
        out = Path(tmp) / "result.json"
        spec = json.dumps({"target": target, "kwargs": kwargs, "out": str(out)})
        procs = []
        logs = []
        cores = core_plan(world_size)
        for rank in range(world_size):
            env = dict(os.environ)
            env.update(
                RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", GROUP_RANK="0",
                WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                OMP_NUM_THREADS=str(THREADS_PER_RANK), MKL_NUM_THREADS=str(THREADS_PER_RANK),
                PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
                PYTHONWARNINGS="ignore",
                GSCHED_BENCH_CORE="" if cores[rank] is None else str(cores[rank]),
            )
            log = open(Path(tmp) / f"rank{rank}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "benchmarks.worker", spec], cwd=ROOT, env=env,
                stdout=log, stderr=subprocess.STDOUT,
            ))
        deadline = time.monotonic() + timeout
        failed = []
        for rank, proc in enumerate(procs):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                code = "timeout"
            if code != 0:
                failed.append(rank)
        if failed:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            texts = []
            for rank in failed:
                logs[rank].seek(0)
                texts.append(f"--- rank {rank} ---\n" + logs[rank].read()[-4000:])
            raise LaunchError(f"{target} failed on ranks {failed}:\n" + "\n".join(texts))
        for log in logs:
            log.close()
        return [json.loads(Path(f"{out}.{rank}").read_text())
                for rank in range(world_size)]


def run_in_worker(spec_text: str) -> None:
    """Entry point of one benchmark process (see :mod:`benchmarks.worker`)."""
    import importlib

    core = os.environ.get("GSCHED_BENCH_CORE", "")
    if core:  # first, in the main thread: every thread started later inherits this affinity
        os.sched_setaffinity(0, {int(core)})
    spec = json.loads(spec_text)
    module_name, func_name = spec["target"].split(":")
    fn = getattr(importlib.import_module(module_name), func_name)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import torch

    torch.set_num_threads(THREADS_PER_RANK)
    result = fn(rank, world, **spec["kwargs"])
    try:
        text = json.dumps(result)
    except (TypeError, ValueError):
        if rank == 0:
            raise
        text = "null"  # only rank 0's result must be JSON (what launch returns)
    Path(f"{spec['out']}.{rank}").write_text(text)
    _shutdown_process_group()
    # Skip interpreter teardown: C++ static destruction of torch's process-group machinery
    # still aborted 1 run in ~40 with "terminate called without an active exception" after
    # the group was destroyed and the result written (CI, test_memory_process[fsdp]).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def affinity(rank: int, world: int) -> list[int]:
    """The cores this rank may run on (a launch target: ``launch_ranks("benchmarks.common:affinity", 2)``
    shows how :func:`core_plan` placed the ranks)."""
    return sorted(os.sched_getaffinity(0))


def _shutdown_process_group() -> None:
    """Destroy the default process group before the interpreter exits, on every rank together.

    Left to interpreter shutdown, a gloo process group is destroyed in C++ static destruction,
    where an occasional still-joinable thread aborts the process ("terminate called without an
    active exception") after the job's work is done; about 1 run in 8 of the fidelity job did.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def machine_description() -> str:
    """CPU model, core count, memory and library versions, for the results page."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f", {int(line.split()[1]) / 2**20:.0f} GiB RAM"
                break
    except OSError:
        pass
    import lightning

    return (f"{cpu}, {os.cpu_count()} cores{mem}; Python {platform.python_version()}, "
            f"torch {torch.__version__}, lightning {lightning.__version__}; "
            f"{THREADS_PER_RANK} thread per rank, gloo on CPU")


def steady(times: list[float], warmup: int) -> list[float]:
    """Drop the first ``warmup`` steps (tracing, allocator growth, first-touch pages)."""
    if len(times) <= warmup:
        raise ValueError(f"only {len(times)} steps timed, fewer than the {warmup} warm-up steps")
    return times[warmup:]


# --------------------------------------------------------------------------- profiles


def dump_profile(prof: Any, profile_dir: str, rank: int, steps: int) -> None:
    """Write one rank's ``cProfile`` stats (``rank{rank}.prof``) and how many steps they cover."""
    Path(profile_dir).mkdir(parents=True, exist_ok=True)
    prof.dump_stats(str(Path(profile_dir) / f"rank{rank}.prof"))
    (Path(profile_dir) / f"rank{rank}.steps").write_text(str(steps))


def profile_summary(profile_dir: str, top: int = 25) -> str:
    """Top functions by cumulative and by own time, per rank, in ms per profiled step.

    Reads what :func:`dump_profile` wrote in ``profile_dir`` (every rank's).
    """
    out = []
    for path in sorted(Path(profile_dir).glob("rank*.prof")):
        steps = max(1, int(path.with_suffix(".steps").read_text()))
        for key, what in (("cumulative", "cumulative"), ("tottime", "own time")):
            buf = io.StringIO()
            pstats.Stats(str(path), stream=buf).sort_stats(key).print_stats(top)
            out.append(f"== {path.stem}: top {top} by {what}, ms per step over {steps} steps ==")
            out.append(_per_step(buf.getvalue(), steps))
    return "\n".join(out)


def _per_step(text: str, steps: int) -> str:
    """Rewrite pstats' tottime/cumtime columns as ms per step."""
    lines, started = [], False
    for line in text.splitlines():
        if line.strip().startswith("ncalls"):
            started = True
            lines.append("   calls/step  own ms/step  cum ms/step  function")
            continue
        parts = line.split(None, 5)
        if not started or len(parts) < 6:
            continue
        ncalls, tottime, _, cumtime, _, where = parts
        calls = int(ncalls.split("/")[0]) / steps
        lines.append(f"{calls:12.1f} {1000 * float(tottime) / steps:12.2f} "
                     f"{1000 * float(cumtime) / steps:12.2f}  {where}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- printing rows


def _short(value: Any) -> Any:
    """Floats (also inside dicts and lists) as strings of 4 significant digits."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return {k: _short(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_short(v) for v in value]
    return value


def ratio_text(row: Result) -> str:
    """``1.012 [0.990-1.031]``: the ratio, and the min-max of its rounds when it has them."""
    if row.ratio is None:
        return "-"
    lo_hi = row.spread
    return f"{row.ratio:.3f}" + ("" if lo_hi is None else f" [{lo_hi[0]:.3f}-{lo_hi[1]:.3f}]")


def cpu_text(row: Result) -> str:
    """``312/305 ms 1.023``: CPU ms per step (all ranks) of both sides and their ratio."""
    if row.ours_cpu_s is None or row.anchor_cpu_s is None or row.cpu_ratio is None:
        return "-"
    return (f"{1e3 * row.ours_cpu_s:.0f}/{1e3 * row.anchor_cpu_s:.0f} ms "
            f"{row.cpu_ratio:.3f}")


def byte_text(value: float) -> str:
    """Bytes as KiB below 1 MiB (a batch row's counts), else MiB (the memory rows)."""
    return f"{value / 2**10:.1f} KiB" if value < 2**20 else f"{value / 2**20:.2f} MiB"


def print_rows(rows: list[Result], as_json: bool, skip_keys: tuple[str, ...] = (),
               short: bool = False, more_lines: Any = None) -> None:
    """Print a benchmark's rows on stdout, as a ``python -m benchmarks.bench_*`` run shows them.

    ``as_json``: one JSON object per row (:meth:`Result.as_json`). Otherwise per row: a line with
    both median step times, the ratio and the goal, the notes, then the ``extra`` entries as
    ``key=value`` on one line, leaving out ``skip_keys`` (``short``: floats to 4 significant
    digits), then the lines ``more_lines(row)`` returns, if given, each on its own.
    """
    for row in rows:
        if as_json:
            print(json.dumps(row.as_json()))
            continue
        if row.unit == "bytes":
            sides = f"ours {byte_text(row.ours_s)}, anchor {byte_text(row.anchor_s)}"
        else:
            sides = f"ours {1000 * row.ours_s:.1f} ms, anchor {1000 * row.anchor_s:.1f} ms"
        print(f"{row.name}: {sides}, ratio {ratio_text(row)} (goal {row.goal}); "
              f"CPU {cpu_text(row)}")
        print(f"  {row.notes}")
        print("  " + ", ".join(f"{k}={_short(v) if short else v}"
                               for k, v in row.extra.items() if k not in skip_keys))
        for line in (more_lines(row) if more_lines is not None else []):
            print(f"  {line}")


def bench_main(argv: list[str] | None, description: str, run: Any, profile: Any,
               profile_help: str, total_file: Any = None, **row_options: Any) -> None:
    """The command line of a benchmark module: ``[--quick] [--json] [--profile]``.

    ``profile``: ``None`` for modules without a profiled mode (no ``--profile`` option).

    Prints the rows of ``run(quick)`` (:func:`print_rows` with ``row_options``), then
    ``total <s> s`` (to ``total_file``, stdout when ``None``), then with ``--profile`` the text
    ``profile(quick)`` returns.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true")
    if profile is not None:
        parser.add_argument("--profile", action="store_true", help=profile_help)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    print_rows(run(args.quick), args.json, **row_options)
    print(f"total {time.perf_counter() - start:.1f} s", file=total_file)
    if profile is not None and args.profile:
        print(profile(args.quick))
