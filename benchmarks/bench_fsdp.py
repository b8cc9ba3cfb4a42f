"""``fsdp_vs_torch``: our ``fsdp`` schedule against torch's FSDP2 (``fully_shard``) on CPU/gloo.

Both sides train the benchmark GPT (:mod:`benchmarks.model`, seed 0, untied, ~3.3M parameters)
on 2 processes, data parallel: each rank takes its own ``PER_RANK`` rows of every global batch
(:func:`benchmarks.model.rank_loader`), SGD with momentum 0.9 and lr 0.05, loss = the mean
``lm_loss`` of the global batch.

* Ours: :func:`fit_probed` (the fit of :func:`benchmarks.lit_runs.fit_timed`, through
  :func:`benchmarks.lit_runs.run_fit`, plus the byte probes below) with
  ``GeneralParallel("fsdp", stages=4, microbatches=2)``: one stage per transformer block
  (the partitioner cuts the 4-block GPT at the block boundaries: wte+wpe+block 0, block 1,
  block 2, block 3+ln_f+head), the granularity FSDP2 shards at; B=2 (the schedule's default
  at W=2) is one microbatch per rank (= that rank's rows). Rank 0 owns stages 0 and 2, rank 1
  stages 1 and 3; each rank fetches the other two, frees a fetched stage after its forward and
  fetches it again for its backward, except rank 0's stage 3, whose forward and backward run
  back to back under one fetch (``gsched plan fsdp -w 2 -s 4 --programs``;
  docs/schedules.md). So a rank holds its two stages plus one fetched stage at a time: its
  peak is 3/4 of the model, where the schedule's default S=2 peaks at the whole model (each
  rank owns one half and fetches the other; measured 12.62 MiB per rank). A step is
  Lightning's whole training batch (forward, backward, transfers, optimizer step, logging):
  ours carries Lightning's per-batch work (hooks, logging, the input all-gather, the loss
  exchange; about 10-20 ms per step in a cProfile run), the anchors are bare loops.
* Anchor: a plain torch loop (:func:`torch_timed`, ``mode="fsdp2"``): FSDP2 at its best
  (:func:`fsdp2_at_its_best`): ``fully_shard`` on the embeddings, each block and the head as
  groups of their own, then the (empty) root; async unshard; explicit forward and backward
  prefetch one group ahead. A step = forward + backward + ``optimizer.step`` + ``zero_grad``.
  Before 2026-11-25 the anchor was FSDP2's defaults (blocks + root, the root's embeddings and
  head unsharded for the whole step, no async unshard, implicit prefetch only).
  FSDP2 runs on CPU tensors over gloo in torch 2.13 (it was checked before writing this; the
  loss agrees with ours, see ``loss_*`` in the row).
* Second row ``fsdp_vs_torch[ddp]``: the same loop with
  ``DistributedDataParallel`` (no sharding), the cheapest data-parallel baseline, for scale.

The three sides alternate in rounds (:mod:`benchmarks.rounds`): each row's ratio is the median
of the per-round ratios, with their min and max as its spread. Rows carry every steady step
time per round (``ours_round_ms``, ``anchor_round_ms``) so the noise of a shared machine can be
judged, and each side's median process CPU time per step summed over both ranks (all threads,
gloo's included) with their ratio ``cpu_ratio``: on a machine shared with other jobs the wall
times swing by tens of percent while CPU times stay put.

Resident parameter bytes per rank (``extra``), both sides measured, not computed from sizes:

* ours, at rest: after each training batch (optimizer step done), the sum of the real storage
  bytes of the executor's stage buffers (``ModelRuntime.memory().resident_bytes``), checked
  against the unique storages of the LightningModule's parameters (they must agree);
  peak: the runtime's own counter ``peak_resident_param_bytes`` of the last step (storage bytes
  of owned + fetched stage buffers, sampled at the start, at every ``FETCH_W`` and at the end;
  fetched weights are received straight into the stage buffer, so there is no other copy).
  Beside it, ``planned_peak``: the planner's figure for the same programs
  (``schedule.metrics.resident_bytes`` over the stage buffers' sizes, what the strategy's
  start-up summary prints); ``ours_peak_as_planned`` says whether they agree on every rank.
* FSDP2, at rest: after the last timed step, the unique storages of the parameters' local
  shards (padded ``_sharded_param_data``). Peak: one extra, untimed step during which
  ``FSDPParamGroup.unshard`` and ``wait_for_unshard`` are wrapped to sample, after each call,
  the storage bytes of every parameter's sharded data plus its unsharded storage
  (``all_gather_outputs``) when allocated (memory only grows at those calls). The flat
  all-gather buffers (FSDP2 gathers into one buffer per group and copies out into the
  per-parameter storage) are sampled at the same points and reported separately as
  ``*_with_allgather_buffers``. These read FSDP2 internals of torch 2.13.
* DDP: every parameter is whole on every rank; the same unique-storage count at rest and
  during the step.

``python -m benchmarks.bench_fsdp [--quick] [--json] [--profile]``: print the rows;
``--profile`` also runs ours and FSDP2 once under cProfile (both ranks, steady steps only) and
prints the top functions in ms per step.
"""

from __future__ import annotations

import cProfile
import gc
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    Result,
    bench_main,
    dump_profile,
    launch,
    profile_summary,
)
from benchmarks.rounds import Side, measure, ratio_result

WORLD = 2
STAGES = 4  # one stage per block of the 4-block benchmark GPT (FSDP2 shards per block)
MICROBATCHES = 2  # the fsdp schedule's default at W=2 (one microbatch per rank), set explicitly
PER_RANK = 16  # global batch 32 rows of 64 tokens
WARMUP = 2
# the issue's goal against FSDP2: peak resident parameter bytes <= FSDP2's on every rank (see
# ``peak_goal_met``) at a wall step-time ratio <= 1.00; the DDP row is for scale only
GOAL = "<= 1.00, peak <= FSDP2's"
DDP_GOAL = "report"
MODULE = "benchmarks.bench_fsdp"  # not __name__: that is "__main__" under python -m
# steps per fit (warm-up included) and alternated rounds (benchmarks.rounds); quick is what
# `make bench` runs
QUICK = {"steps": 6, "rounds": 4, "ddp": True}
FULL = {"steps": 10, "rounds": 8, "ddp": True}


# --------------------------------------------------------------------------- byte counting


def _storage_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (empty ones count 0)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def module_param_bytes(module: Any) -> int:
    """Unique storage bytes of a module's parameters (DTensors: their local shards)."""
    from torch.distributed.tensor import DTensor

    return _storage_bytes([p.to_local() if isinstance(p, DTensor) else p
                           for p in module.parameters()])


def _fsdp_groups(model: Any) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    groups = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            groups.extend(m._get_fsdp_state()._fsdp_param_groups)
    return groups


def fsdp2_bytes(groups: list[Any]) -> dict[str, int]:
    """Storage held now by FSDP2's parameters: sharded, unsharded, flat all-gather buffers."""
    sharded, unsharded, buffers = [], [], []
    for g in groups:
        for fp in g.fsdp_params:
            sharded.append(fp._sharded_param_data)
            unsharded.extend(getattr(fp, "all_gather_outputs", []) or [])
            unsharded.extend(getattr(fp, "_unsharded_inner_tensors", []) or [])
        if g._all_gather_result is not None:
            buffers.append(g._all_gather_result.all_gather_output)
        state = getattr(g.comm_ctx, "all_gather_state", None)
        if state is not None:
            buffers.append(state.all_gather_result.all_gather_output)
    s, u, b = _storage_bytes(sharded), _storage_bytes(unsharded), _storage_bytes(buffers)
    return {"params": s + u, "sharded": s, "unsharded": u, "allgather_buffers": b}


class Fsdp2Sampler:
    """Wraps FSDPParamGroup.unshard / wait_for_unshard to sample bytes after each call."""

    def __init__(self, model: Any) -> None:
        self.groups = _fsdp_groups(model)
        self.peak = {"params": 0, "with_buffers": 0}
        self.samples = 0
        self._saved: dict[str, Any] = {}

    def sample(self) -> None:
        now = fsdp2_bytes(self.groups)
        self.samples += 1
        self.peak["params"] = max(self.peak["params"], now["params"])
        self.peak["with_buffers"] = max(self.peak["with_buffers"],
                                        now["params"] + now["allgather_buffers"])

    def __enter__(self) -> "Fsdp2Sampler":
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        sampler = self
        for name in ("unshard", "wait_for_unshard"):
            original = getattr(FSDPParamGroup, name)
            self._saved[name] = original

            def wrapped(group: Any, *args: Any, _original: Any = original, **kw: Any) -> Any:
                out = _original(group, *args, **kw)
                sampler.sample()
                return out

            setattr(FSDPParamGroup, name, wrapped)
        self.sample()
        return self

    def __exit__(self, *exc: Any) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        self.sample()
        for name, original in self._saved.items():
            setattr(FSDPParamGroup, name, original)


# --------------------------------------------------------------------------- the anchors


def torch_timed(rank: int, world: int, mode: str, steps: int, per_rank: int,
                shape: dict[str, int] | None = None, warmup: int = WARMUP,
                profile_dir: str | None = None) -> dict[str, Any]:
    """One rank of a plain torch data-parallel loop (``mode`` = ``"fsdp2"`` (at its best),
    ``"fsdp2_defaults"`` (blocks + root, the earlier anchor) or ``"ddp"``)."""
    import torch.distributed as dist

    owned = not dist.is_initialized()  # in reused processes (benchmarks.rounds) it exists
    if owned:
        dist.init_process_group("gloo")
    try:
        # the model (and DDP's reducer, which holds the process group) must be gone before the
        # group is destroyed: destroying gloo's group from the reducer's destructor can deadlock
        # on the GIL with gloo's work thread (seen here: a DDP rank hung at exit)
        result = _torch_loop(rank, world, mode, steps, per_rank, shape, warmup, profile_dir)
        gc.collect()
        dist.barrier()
        return result
    finally:
        if owned:
            dist.destroy_process_group()


def fsdp2_at_its_best(core: Any) -> list[Any]:
    """Shard the benchmark GPT with FSDP2 as well as its API allows here; the groups in order.

    Why each setting (issue 25: the anchor had been FSDP2's defaults, which leave it slower
    than it can be):

    * **root modules sharded separately**: the embeddings (``wte`` + ``wpe``) and the head
      (``ln_f`` + ``head``) are groups of their own, so the root group holds no parameters and
      nothing stays unsharded for the whole step (the defaults left them in the root group,
      gathered at the start and kept until the end);
    * **async unshard** (``_set_unshard_async_op(True)``): the all-gathers are issued without
      waiting, so on gloo they run on its thread while the rank computes;
    * **explicit prefetch**: every group starts the next group's all-gather in forward
      (``set_modules_to_forward_prefetch``) and the previous group's in backward
      (``set_modules_to_backward_prefetch``), one group ahead, as our ``fsdp`` fetches one
      stage ahead; without it, an async unshard would only be waited on at once.
    """
    from torch.distributed.fsdp import fully_shard

    embed = fully_shard([core.wte, core.wpe])
    blocks = [fully_shard(block) for block in core.blocks]
    head = fully_shard([core.ln_f, core.head])
    fully_shard(core)
    groups = [embed[0], *blocks, head[0]]
    for before, after in zip(groups, groups[1:], strict=False):  # neighbours
        before.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([before])
    core._set_unshard_async_op(True)
    return groups


def _torch_loop(rank: int, world: int, mode: str, steps: int, per_rank: int,
                shape: dict[str, int] | None, warmup: int,
                profile_dir: str | None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from benchmarks.model import GPTShape, build_core, lm_loss, rank_loader

    gshape = GPTShape(**(shape or {}))
    core = build_core(gshape, seed=0)
    full_bytes = module_param_bytes(core)
    if mode == "fsdp2":
        fsdp2_at_its_best(core)
        model = core
    elif mode == "fsdp2_defaults":  # the earlier anchor, kept to compare the two by hand
        from torch.distributed.fsdp import fully_shard

        for block in core.blocks:
            fully_shard(block)
        fully_shard(core)
        model = core
    elif mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(core)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # one extra batch for the untimed byte-sampling step after the timed ones
    batches = list(rank_loader(gshape, per_rank, steps + 1, rank, world))
    times: list[float] = []
    cpu_times: list[float] = []
    losses: list[float] = []
    prof = cProfile.Profile() if profile_dir else None
    for i, (x, y) in enumerate(batches[:steps]):
        if prof is not None and i == warmup:
            prof.enable()
        cpu = time.process_time()
        start = time.perf_counter()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
        losses.append(float(loss.detach()))
    if prof is not None:
        prof.disable()
        dump_profile(prof, profile_dir, rank, steps - warmup)
    at_rest = module_param_bytes(model)
    x, y = batches[steps]
    if mode.startswith("fsdp2"):
        with Fsdp2Sampler(model) as sampler:
            lm_loss(model(x), y).backward()
        peak, peak_buf, samples = sampler.peak["params"], sampler.peak["with_buffers"], \
            sampler.samples
    else:
        lm_loss(model(x), y).backward()
        peak = peak_buf = module_param_bytes(model)
        samples = 1
    opt.zero_grad()
    # global-batch loss of each timed step: mean over the ranks' equal-sized slices
    mean = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean)
    mean /= world
    mem = {"at_rest": at_rest, "peak": peak, "peak_with_allgather_buffers": peak_buf,
           "samples": samples}
    per_rank_mem: list[Any] = [None] * world
    dist.all_gather_object(per_rank_mem, mem)
    return {"times": times, "cpu_times": cpu_times, "loss": float(mean[-1]),
            "losses": mean.tolist(),
            "mem": per_rank_mem, "full_model_bytes": full_bytes,
            "threads": torch.get_num_threads()}


# --------------------------------------------------------------------------- ours


def resident_bytes_probe() -> Any:
    """A Lightning callback: after each training batch, what the strategy's executor holds here.

    It reads the real storage of the executor's stage buffers (at rest), the runtime's
    ``peak_resident_param_bytes`` counter of that step and the module's parameter storages into
    its ``steps``; at the end of training the last step's entry is all-gathered into its
    ``per_rank``. (A factory, so that importing this module does not import Lightning.)
    """
    import lightning.pytorch as pl

    class ResidentBytesProbe(pl.Callback):
        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []
            self.per_rank: list[Any] | None = None

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            from lightning_gsched.schedule.memory import resident_bytes

            engine = trainer.strategy.engine
            runtime = engine.runtime
            memory = runtime.memory()
            c = runtime.executor.last_counters
            planned = resident_bytes(engine.train_plan.programs, memory.stage_bytes,
                                     memory.tie_bytes)
            self.steps.append({
                "at_rest": memory.resident_bytes,
                "module_params": module_param_bytes(pl_module),
                "peak": c.peak_resident_param_bytes,
                "planned_peak": planned[trainer.global_rank].peak,
                "peak_stages": c.peak_resident_stages,
                "owned_stages": memory.owned_stages,
                "stage_bytes": memory.stage_bytes,
                "weight_fetches": c.weight_fetches,
                "bytes_sent": c.bytes_sent, "bytes_received": c.bytes_received,
            })

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            import torch.distributed as dist

            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, self.steps[-1] if self.steps else None)
            self.per_rank = gathered

    return ResidentBytesProbe()


def fit_probed(rank: int, world: int, strategy: dict[str, Any], steps: int, per_rank: int,
               shape: dict[str, int] | None = None, profile_dir: str | None = None,
               warmup: int = WARMUP) -> dict[str, Any]:
    """``fit_timed``'s fit, plus resident bytes per rank (and cProfile).

    :func:`benchmarks.lit_runs.run_fit` with two callbacks: a
    :class:`~benchmarks.lit_runs.StepTimer` (every step's wall time; with ``profile_dir``, cProfile
    during batches ``>= warmup`` only) and, after it, :func:`resident_bytes_probe` (so the probe
    runs outside the timed window). Returns ``fit_timed``'s keys (``times``, ``loss``: the last
    logged ``train_loss``, ``threads``) plus ``mem`` (every rank's probe of the last step,
    all-gathered) and ``consistent`` (after every step on this rank, the stage buffers' bytes
    matched the module's parameter storages).
    """
    import torch

    from benchmarks.lit_runs import StepTimer, make_strategy, run_fit
    from benchmarks.model import GPTShape

    timer = StepTimer(cpu=True, profiler=cProfile.Profile() if profile_dir else None,
                      profile_from=warmup)
    probe = resident_bytes_probe()
    trainer = run_fit(make_strategy(strategy, world), rank, world, steps, per_rank,
                      GPTShape(**(shape or {})), [timer, probe])
    if profile_dir:
        dump_profile(timer.profiler, profile_dir, rank, timer.profiled_steps)
    loss = trainer.callback_metrics.get("train_loss")
    return {"times": timer.times, "cpu_times": timer.cpu_times,
            "loss": None if loss is None else float(loss),
            "threads": torch.get_num_threads(), "mem": probe.per_rank,
            "consistent": all(s["at_rest"] == s["module_params"] for s in probe.steps)}


# --------------------------------------------------------------------------- the benchmark


OURS_STRATEGY = {"kind": "gsched", "schedule": "fsdp", "stages": STAGES,
                 "microbatches": MICROBATCHES}


def _ours(steps: int) -> Side:
    return Side(f"{MODULE}:fit_probed",
                {"strategy": OURS_STRATEGY, "steps": steps, "per_rank": PER_RANK})


def _torch(mode: str, steps: int) -> Side:
    return Side(f"{MODULE}:torch_timed", {"mode": mode, "steps": steps, "per_rank": PER_RANK})


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _bytes_note(mem: list[dict[str, Any]]) -> str:
    return "; ".join(f"r{r} rest {_mib(m['at_rest'])} peak {_mib(m['peak'])}"
                     + (f" ({_mib(m['peak_with_allgather_buffers'])} with all-gather buffers)"
                        if m.get("peak_with_allgather_buffers", m["peak"]) != m["peak"] else "")
                     for r, m in enumerate(mem))


def peak_goal_met(ours: list[dict[str, Any]], anchor: list[dict[str, Any]]) -> bool:
    """Ours' peak parameter bytes <= the anchor's on every rank, each side counting every byte
    it holds for parameters at that moment, its communication buffers included.

    Why the anchor's all-gather buffers count: ours receives a fetched stage straight into
    the stage's own buffer (the buffer *is* the parameters; ``peak_resident_param_bytes``
    counts it), while FSDP2 all-gathers into a flat buffer and copies out into the unsharded
    parameters, so at its peak it holds both. Its parameters alone (``peak``) leave out memory
    it really holds; both figures are in the row's notes."""
    return all(m["peak"] <= a.get("peak_with_allgather_buffers", a["peak"])
               for m, a in zip(ours, anchor, strict=True))


def run(quick: bool) -> list[Result]:
    cfg = QUICK if quick else FULL
    steps, rounds = cfg["steps"], cfg["rounds"]
    wall = time.perf_counter()
    sides = {"ours": _ours(steps), "fsdp2": _torch("fsdp2", steps)}
    if cfg["ddp"]:
        sides["ddp"] = _torch("ddp", steps)
    runs = measure(sides, WORLD, rounds, WARMUP)
    wall = time.perf_counter() - wall
    last = {name: run.last() for name, run in runs.items()}
    ours = last["ours"]
    full = last["fsdp2"]["full_model_bytes"]
    common = {
        "steps_per_run": steps, "warmup": WARMUP,
        "per_rank": PER_RANK, "global_batch": PER_RANK * WORLD, "microbatches": MICROBATCHES,
        "full_model_param_bytes": full, "wall_s": wall,
        "ours_param_bytes_per_rank": ours["mem"],
        "ours_bytes_checked_against_module": ours["consistent"],
        "ours_peak_as_planned": all(m["peak"] == m["planned_peak"] for m in ours["mem"]),
        "loss_ours": ours["loss"],
    }
    shape = (f"W=2, GeneralParallel('fsdp', stages={STAGES}, microbatches={MICROBATCHES}): one "
             "stage per block, each rank owns 2 and holds one fetched stage at a time (freed "
             "after its forward, fetched again for its backward); global batch "
             f"{PER_RANK * WORLD}x64 tokens, {PER_RANK} rows per rank")
    rows = []
    for key, name, label, goal in (
        ("fsdp2", "fsdp_vs_torch", "FSDP2 at its best (embeddings, blocks, head sharded "
         "apart; async unshard; explicit prefetch)", GOAL),
        ("ddp", "fsdp_vs_torch[ddp]", "DistributedDataParallel", DDP_GOAL),
    ):
        if key not in last:
            continue
        anchor = last[key]
        loss_a = anchor["loss"]
        diff = None if ours["loss"] is None else abs(ours["loss"] - loss_a)
        peak_ok = peak_goal_met(ours["mem"], anchor["mem"])
        notes = (f"{shape}; anchor = {label}, plain torch loop on gloo/CPU (ours includes "
                 f"Lightning's per-batch work); param bytes per rank "
                 f"(full model {_mib(full)}): ours {_bytes_note(ours['mem'])} (peak as planned: "
                 f"{common['ours_peak_as_planned']}); {key} {_bytes_note(anchor['mem'])}; "
                 f"peak ours <= {key}: {peak_ok}; loss after {steps} steps ours "
                 f"{ours['loss']:.4f} vs {key} {loss_a:.4f}")
        rows.append(ratio_result(
            name, runs["ours"], runs[key], goal, notes,
            extra={
                **common,
                "anchor": key,
                "peak_goal_met": peak_ok,
                "anchor_param_bytes_per_rank": anchor["mem"],
                "loss_anchor": loss_a, "loss_abs_diff": diff,
                "anchor_losses": anchor["losses"],
            },
        ))
    return rows


def profile(quick: bool) -> str:
    """Run ours and FSDP2 once under cProfile; the summaries (for development)."""
    steps = (QUICK if quick else FULL)["steps"]
    with tempfile.TemporaryDirectory(prefix="gsched_prof_") as tmp:
        ours_dir, anchor_dir = str(Path(tmp) / "ours"), str(Path(tmp) / "fsdp2")
        launch(f"{MODULE}:fit_probed", WORLD, profile_dir=ours_dir, strategy=OURS_STRATEGY,
               steps=steps, per_rank=PER_RANK)
        launch(f"{MODULE}:torch_timed", WORLD, mode="fsdp2", steps=steps, per_rank=PER_RANK,
               profile_dir=anchor_dir)
        return ("######## ours (GeneralParallel fsdp) ########\n" + profile_summary(ours_dir)
                + "\n######## torch FSDP2 ########\n" + profile_summary(anchor_dir))


def _step_lines(row: Result) -> list[str]:
    return [f"step ms per round, ours: {row.extra['ours_round_ms']}",
            f"step ms per round, {row.extra['anchor']}: {row.extra['anchor_round_ms']}"]


def main(argv: list[str] | None = None) -> None:
    # the total goes to stderr, so that --json prints nothing but the rows on stdout
    bench_main(argv, __doc__.splitlines()[0], run, profile,
               "also run ours and FSDP2 under cProfile and print the top functions",
               total_file=sys.stderr,
               skip_keys=("anchor_losses", "ours_round_ms", "anchor_round_ms"),
               more_lines=_step_lines)


if __name__ == "__main__":
    main()
