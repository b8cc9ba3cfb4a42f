"""``tp_vs_lightning_model_parallel``: our tensor-parallel stages vs ModelParallelStrategy.

Lightning's own ``ModelParallelStrategy`` with the same tensor-parallel plan (issue 35).

W=2 CPU processes (gloo) as P=1 pipeline worker x T=2 tensor-parallel ranks: the narrowest
case where both strategies do the same thing, so what the row measures is what our runtime adds
(or saves) around torch's ``parallelize_module``, not a different parallel layout.

* **Model.** The benchmark GPT (:mod:`benchmarks.model`, 4 blocks of width 256, 8 heads,
  3.3 M parameters) built with ``shardable=True``: q, k, v as three ``Linear(256, 256)`` and
  ``-1`` heads, the only change a column-wise shard needs (same parameter count and init
  distribution as the fused ``qkv`` of the other rows).
* **Plan** (:func:`plan`), the same on both sides: ``blocks.*.q/k/v`` and ``blocks.*.fc``
  column-wise, ``blocks.*.proj`` and ``blocks.*.out`` row-wise; embeddings, norms and the head
  stay replicated. Ours names the modules under the LightningModule (``core.blocks.*.q``), as
  ``GeneralParallel``'s plan does; the anchor applies ``parallelize_module(self.core,
  self.device_mesh["tensor_parallel"], ...)`` in ``configure_model``, as Lightning's docs do.
* **Ours:** ``GeneralParallel("gpipe", microbatches=1, tensor_parallel_size=2,
  tensor_parallel_plan=..., data_loading="per_replica")``: one stage, one microbatch, i.e. one
  forward and one backward of the whole batch per step, what ``ModelParallelStrategy`` runs.
* **Anchor:** ``ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)``.
* **Same data, optimizer, Trainer:** both through :func:`benchmarks.lit_runs.run_fit` (the
  Trainer options of every Lightning row), SGD with momentum 0.9 (``BenchLit``), and every rank
  reads the whole global batch of :data:`GLOBAL_BATCH` rows (a worker's T ranks compute on the
  same rows; no data parallelism on either side). No gradient clipping: Lightning's clipping
  under ``ModelParallelStrategy`` fails on a model that mixes DTensor and plain parameters
  (docs/tensor_parallel.md). The last step's loss of both sides is reported
  (``loss_abs_diff``): the weights are equal (``tests/test_lightning_tensor_parallel.py``).

**Time** (the row's ratio): alternated rounds in reused processes (:mod:`benchmarks.rounds`),
per round ours' median steady step over the anchor's on rank 0, warm-up steps dropped; the
row's ratio is the median over rounds.

**Peak bytes per rank** (``extra``): measured from outside both runtimes exactly as the
``auto_vs_best_torch`` and ``pp_dp_shard_vs_fsdp2_pp`` rows measure theirs: one extra, untimed
batch of each fit under :class:`benchmarks.allocator_peak.ProfilerPeak` (a census of the tensor
storages alive at its start plus the peak of the profiler's allocation events during it; an
upper bound), less a census taken before the fit built anything
(:func:`benchmarks.allocator_peak.fit_peak`). Every fit measures it; each rank's figure is the
median over rounds (:func:`peak_figures` says why). ``peak_ratio`` is the worst rank's bytes,
ours / the anchor's; ``peak_goal_met``: ours <= the anchor's on every rank.

    python -m benchmarks.bench_tp [--quick] [--json]
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import Result, bench_main, median
from benchmarks.model import BenchLit
from benchmarks.rounds import Side, SideRuns, measure, ratio_result

MODULE = "benchmarks.bench_tp"
NAME = "tp_vs_lightning_model_parallel"
WORLD = 2
T = 2  # tensor-parallel ranks per worker: P = WORLD / T = 1
GLOBAL_BATCH = 16  # rows per step, every rank reads all of them (ddp_vs_lightning: 2 x 8)
WARMUP = 3
# steps per fit (warm-up included, the extra peak batch not) and alternated rounds: those of
# the other Lightning rows (bench_lightning); quick is what `make bench` runs (~1 min here)
QUICK = {"steps": 9, "rounds": 6}
FULL = {"steps": 14, "rounds": 10}
GOAL = "<= 1.00, peak <= ModelParallelStrategy's"
# each ShardableBlock layer's style: attention by heads, the MLP by its hidden width
STYLES = {"q": "colwise", "k": "colwise", "v": "colwise", "proj": "rowwise",
          "fc": "colwise", "out": "rowwise"}


def plan(prefix: str = "") -> dict[str, str]:
    """The tensor-parallel plan on ``GPTCore``'s names, each led by ``prefix``: ``"core."`` for
    ours (names under the LightningModule), ``""`` for ``parallelize_module(self.core, ...)``."""
    return {f"{prefix}blocks.*.{layer}": style for layer, style in STYLES.items()}


def sequence_plan(prefix: str = "", layers: int = 4) -> dict[str, str]:
    """Megatron-style sequence parallelism on ``GPTCore``'s names, by the styles' names (the
    ``memory[...+sp]`` rows of :mod:`benchmarks.bench_memory`, ``check_3d --sequence``): between
    blocks every rank holds its part of the sequence (the residual stream, sent stage to stage
    as such); the norms run on it (``"sequence"``), the column-wise layers after them gather the
    sequence and the row-wise layers before the residual adds scatter it again; the first
    block's input is cut to this rank's part and the last block's output (``layers - 1``) joined
    for the final norm and the head. The blocks must be leaf modules of the split
    (``leaf_modules=("ShardableBlock",)``), or their own hooks would not run
    (docs/tensor_parallel.md)."""
    by_style = {"colwise": "colwise_from_sequence", "rowwise": "rowwise_to_sequence"}
    blocks = f"{prefix}blocks"
    return {f"{blocks}.0": "sequence_input",
            f"{blocks}.*.ln1": "sequence", f"{blocks}.*.ln2": "sequence",
            **{f"{blocks}.*.{layer}": by_style[style] for layer, style in STYLES.items()},
            f"{blocks}.{layers - 1}": "sequence_output"}


def ours_strategy() -> dict[str, Any]:
    """Our strategy's keywords (:func:`benchmarks.lit_runs.make_strategy`): S=1, B=1; the one
    replica's batch loaded by both ranks (``data_loading="per_replica"``: no batch-size
    exchange before a step, the ranks' batches checked with its losses), as Lightning's side
    has every rank read it and checks nothing."""
    return {"kind": "gsched", "schedule": "gpipe", "microbatches": 1,
            "tensor_parallel_size": T, "tensor_parallel_plan": plan("core."),
            "data_loading": "per_replica"}


class ModelParallelBench(BenchLit):
    """The anchor's module: ``BenchLit(shardable=True)`` sharding its core in ``configure_model``
    over Lightning's ``tensor_parallel`` mesh dimension (what ``ModelParallelStrategy`` requires
    a user to write)."""

    def configure_model(self) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        from lightning_gsched.partition.tensor_parallel import style_of

        mesh = self.device_mesh  # set by the strategy before this hook
        assert mesh is not None
        styles = {k: style_of(v, k) for k, v in plan().items()}
        parallelize_module(self.core, mesh["tensor_parallel"], styles)


def _side_model_and_strategy(side: str, world: int) -> tuple[BenchLit, Any]:
    from benchmarks.lit_runs import make_strategy

    if side == "ours":
        return BenchLit(shardable=True), make_strategy(ours_strategy(), world)
    if side == "anchor":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return (ModelParallelBench(shardable=True),
                ModelParallelStrategy(data_parallel_size=world // T, tensor_parallel_size=T))
    raise ValueError(f"side must be 'ours' or 'anchor', got {side!r}")


def fit_side(rank: int, world: int, side: str, steps: int,
             global_batch: int = GLOBAL_BATCH) -> dict[str, Any]:
    """One fit of ``side`` (``"ours"`` or ``"anchor"``) in this rank: ``steps`` timed batches,
    then one untimed batch under the profiler (its peak, every rank's); the last loss."""
    import torch
    import torch.distributed as dist

    from benchmarks.allocator_peak import ProfilerPeak, census_now, fit_peak
    from benchmarks.lit_runs import StepTimer, run_fit
    from benchmarks.model import GPTShape, rank_loader

    before_fit = census_now()  # before the model exists: earlier fits' leftovers excluded
    model, strategy = _side_model_and_strategy(side, world)
    shape = GPTShape()
    timer = StepTimer(cpu=True)
    probe = ProfilerPeak(batch=steps, timeline=False)
    # world=1, rank=0: every rank reads the whole global batch (one worker, no data parallel)
    loader = rank_loader(shape, global_batch, steps + 1, 0, 1)
    trainer = run_fit(strategy, rank, world, steps + 1, global_batch, shape, [timer, probe],
                      model=model, loader=loader)
    peaks: list[Any] = [None] * world
    dist.all_gather_object(peaks, None if probe.events is None
                           else fit_peak(probe.events, before_fit))
    loss = trainer.callback_metrics.get("train_loss")
    return {"times": timer.times[:steps], "cpu_times": (timer.cpu_times or [])[:steps],
            "loss": None if loss is None else float(loss), "peaks": peaks,
            "threads": torch.get_num_threads()}


def round_peaks(runs: SideRuns) -> list[list[int]]:
    """Every round's peak bytes per rank (``[round][rank]``), from rank 0's gathered list."""
    return [[peak["total"] for peak in runs.outputs[r][0]["peaks"]] for r in range(runs.rounds)]


def peak_figures(ours: list[list[int]], anchor: list[list[int]]) -> dict[str, Any]:
    """The row's bytes figures from both sides' :func:`round_peaks`: per rank the median over
    rounds, ``[ours, anchor]`` (``peak_bytes_ours_anchor``); the worst rank's ours / the
    anchor's (``peak_ratio``); whether ours <= the anchor's on every rank (``peak_goal_met``).

    Why a median over rounds and not one fit's figure (the ``pp_dp_shard_vs_fsdp2_pp`` row
    reads the last round): the bytes allocated in the step moved by 1-2 MiB (of ~67) from
    one fit of the same side to the next in the first runs, as much as the gap between sides."""
    def per_rank(rounds: list[list[int]]) -> list[int]:
        return [int(median([float(b) for b in rank])) for rank in zip(*rounds, strict=True)]

    pairs = [[o, a] for o, a in zip(per_rank(ours), per_rank(anchor), strict=True)]
    worst_ours, worst_anchor = max(o for o, _ in pairs), max(a for _, a in pairs)
    return {"peak_bytes_ours_anchor": pairs, "peak_ratio": worst_ours / worst_anchor,
            "peak_goal_met": all(o <= a for o, a in pairs)}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def row_result(ours: SideRuns, anchor: SideRuns, steps: int) -> Result:
    """The table row: time ratio over rounds, peak bytes and losses in ``extra`` and notes."""
    last_ours, last_anchor = ours.last(), anchor.last()
    peaks = peak_figures(round_peaks(ours), round_peaks(anchor))
    loss_o, loss_a = last_ours["loss"], last_anchor["loss"]
    per_rank = ", ".join(f"r{r} {_mib(o)}/{_mib(a)}"
                         for r, (o, a) in enumerate(peaks["peak_bytes_ours_anchor"]))
    extra: dict[str, Any] = {
        "world": WORLD, "tensor_parallel_size": T, "pipeline": WORLD // T,
        "global_batch": GLOBAL_BATCH, "steps_per_fit": steps, "warmup_dropped": WARMUP,
        "ours_strategy": ours_strategy(), "plan": plan(), **peaks,
        "peak_rounds_ours": round_peaks(ours), "peak_rounds_anchor": round_peaks(anchor),
        "peak_detail_ours": last_ours["peaks"], "peak_detail_anchor": last_anchor["peaks"],
        "loss_ours": loss_o, "loss_anchor": loss_a,
        "loss_abs_diff": None if loss_o is None or loss_a is None else abs(loss_o - loss_a)}
    notes = (f"W={WORLD} = P={WORLD // T} x T={T}; GeneralParallel('gpipe', microbatches=1, "
             f"tensor_parallel_size={T}) vs Lightning ModelParallelStrategy(data_parallel_size"
             f"=1, tensor_parallel_size={T}), same plan (q/k/v/fc colwise, proj/out rowwise), "
             f"benchmark GPT with q, k, v split, SGD, {GLOBAL_BATCH} rows per step on every "
             f"rank; peak bytes per rank held by the fit, MiB ours/Lightning, median over "
             f"rounds (census + allocation events of one untimed step, less a census before "
             f"the fit; both sides alike): {per_rank}; peak ratio (worst rank) {peaks['peak_ratio']:.3f}, "
             f"ours <= Lightning on every rank: {peaks['peak_goal_met']}; last loss ours "
             f"{loss_o}, Lightning {loss_a}")
    return ratio_result(NAME, ours, anchor, GOAL, notes, extra=extra)


def run(quick: bool) -> list[Result]:
    """The row: both sides alternated in one launch of W=2 reused processes."""
    cfg = QUICK if quick else FULL
    sides = {side: Side(f"{MODULE}:fit_side", {"side": side, "steps": cfg["steps"]})
             for side in ("ours", "anchor")}
    runs = measure(sides, WORLD, cfg["rounds"], WARMUP)
    return [row_result(runs["ours"], runs["anchor"], cfg["steps"])]


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, __doc__.splitlines()[0], run, None, "",
               skip_keys=("ours_round_ms", "anchor_round_ms", "peak_detail_ours",
                          "peak_detail_anchor", "peak_rounds_ours", "peak_rounds_anchor", "plan",
                          "ours_strategy"), short=True)


if __name__ == "__main__":
    main()
