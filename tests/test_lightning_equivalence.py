"""GeneralParallel trains exactly like one device: every library schedule, W = 2 and 4.

Each test runs k=3 optimizer steps (gradient clipping by norm, a per-step LR schedule, SGD with
momentum and Adam) through a real ``Trainer.fit`` on W gloo processes, and compares with a
single-process Trainer run in this pytest process on the same global batches:

* the final weights (gathered to every rank at teardown) match (rtol 1e-5);
* the ``train_loss`` rows of rank 0's CSV log equal the single-device values per step;
* ``GeneralParallel("ddp")`` matches Lightning's own ``DDPStrategy`` (final weights);
* ``checkpoint_activations=True`` (every stage recomputes its forward in its backward) changes
  neither.
"""

from __future__ import annotations

import functools
import tempfile
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch

from dist_harness import WorkerContext
from lightning_gsched.runtime.gloo_groups import BACKEND as SHARED_BACKEND
from lightning_models import (
    as_worker,
    assert_same_state,
    csv_metric,
    make_lit_gpt,
    rank_loader,
    state_of,
    tokens,
    trainer,
)

pytestmark = pytest.mark.distributed

SCHEDULES = ["ddp", "fsdp", "gpipe", "1f1b", "lpp", "interleaved", "fslpp", "fslpp-seed",
             "zb-h1", "zb-h2", "zbv"]
SPLIT_BACKWARD = {"zb-h1", "zb-h2", "zbv", "v-half", "v-min"}
# the memory-controlled V schedules, at W=2 only, where v-min's plan is v-half's
# (test_schedule_vshape_memory); both run at W=4 in test_runtime_schedules
V_MEMORY = ["v-half"]
STEPS, GLOBAL_BATCH, CLIP = 3, 8, 0.5

WORLD_TIMEOUT = 300.0  # seconds per check: whole Trainer fits (conftest.worlds)


DEFAULT_FIT = (("max_steps", STEPS), ("gradient_clip_val", CLIP))


def _fit(world: int, rank: int, strategy: Any, optimizer: str, tmp: str, options: tuple,
         model_options: tuple = ()) -> dict:
    model = make_lit_gpt(optimizer=optimizer, **dict(model_options))
    data = tokens(GLOBAL_BATCH * 2 * STEPS)
    fit = trainer(world, strategy, tmp, **dict(options))
    fit.fit(model, rank_loader(data, GLOBAL_BATCH, world, rank))
    return state_of(model)


def fit_on_worker(ctx: WorkerContext, strategy: Any, optimizer: str, tmp: str,
                  options: tuple = DEFAULT_FIT, model_options: tuple = ()) -> dict:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    if isinstance(strategy, dict):
        strategy = GeneralParallel(**strategy)
    return _fit(ctx.world_size, ctx.rank, strategy, optimizer, tmp, options, model_options)


@functools.lru_cache(maxsize=None)
def reference(optimizer: str, options: tuple = DEFAULT_FIT,
              model_options: tuple = ()) -> tuple[dict, list]:
    """Single-process Trainer on the same global batches (computed once per configuration)."""
    tmp = tempfile.mkdtemp()
    state = _fit(1, 0, "auto", optimizer, tmp, options, model_options)
    return state, csv_metric(tmp, "train_loss")


def assert_fit_matches(states: list, tmp: str, want: dict, want_log: list, label: str) -> None:
    """Every rank's final state is one device's, and the logged losses (rank 0's CSV, the
    global batch's) are one device's at the same steps."""
    for rank, state in enumerate(states):
        assert_same_state(state, want, f"{label} rank {rank}")
    got_log = csv_metric(tmp, "train_loss")
    assert [s for s, _ in got_log] == [s for s, _ in want_log]
    for (_, got), (_, expected) in zip(got_log, want_log, strict=True):
        assert got == pytest.approx(expected, rel=1e-5)


# schedule innermost: all W=2 cases, then all W=4 ones, so the module's worker processes are
# started twice rather than once per case
@pytest.mark.parametrize("world_size,schedule", [
    (W, schedule) for W in (2, 4) for schedule in SCHEDULES + (V_MEMORY if W == 2 else [])])
def test_schedule_matches_single_device(worlds, world_size: int, schedule: str, tmp_path) -> None:
    world = worlds.get(world_size)
    # Adam at W=2 only: which rank holds which parameter's optimizer state follows from stage
    # ownership, which W=2 already exercises for every schedule; W=4 adds loops, replicas and
    # longer pipelines, which SGD checks as well (and test_lightning_checkpoint resumes Adam
    # on 4 workers). This keeps the suite inside its time budget. The zero-bubble schedules
    # run Adam at W=4 too: their B/W split changes when each weight gradient is accumulated.
    adam = world_size == 2 or schedule in SPLIT_BACKWARD
    for optimizer in ("sgd", "adam") if adam else ("sgd",):
        want, want_log = reference(optimizer)
        tmp = str(tmp_path / optimizer)
        states = world.run(fit_on_worker, {"schedule": schedule}, optimizer, tmp)
        assert_fit_matches(states, tmp, want, want_log, f"{schedule} W={world_size} {optimizer}")


# fine-tuning: the token embedding (tied to the head, on the first and the last stage), the
# position embedding and the first block frozen: stages with frozen weights beside trained ones
FROZEN = (("frozen", ("model.wte", "model.wpe", "model.blocks.0.")),)


@pytest.mark.parametrize("schedule", ["fsdp", "fslpp", "zbv"])
def test_frozen_parameters_match_single_device(worlds, schedule: str, tmp_path) -> None:
    """Parameters with ``requires_grad=False``, still in the optimizer (Adam, clipping by
    norm), under a sharded schedule (fsdp: every stage's weights fetched and its gradients
    reduce-scattered; fslpp: sharded and looped) and a split backward (zbv: a weight phase
    with nothing to compute for them): the frozen ones stay as initialised and the rest end at
    one device's weights and losses."""
    want, want_log = reference("adam", DEFAULT_FIT, FROZEN)
    initial = state_of(make_lit_gpt(**dict(FROZEN)))
    frozen = [name for name in want if name.startswith(FROZEN[0][1])]
    assert frozen and all(torch.equal(want[name], initial[name]) for name in frozen)
    states = worlds.get(2).run(fit_on_worker, {"schedule": schedule}, "adam", str(tmp_path),
                               DEFAULT_FIT, FROZEN)
    assert_fit_matches(states, str(tmp_path), want, want_log, f"{schedule} frozen")


METRIC_COLUMNS = ("train_seen_step", "train_seen_epoch", "val_seen/dataloader_idx_0",
                  "val_seen/dataloader_idx_1")


def metrics_fit(world: int, rank: int, strategy: Any, tmp: str
                ) -> tuple[list[tuple[str, float]], dict[str, list], str]:
    """Two epochs of two steps, each followed by two batches of each of two validation
    dataloaders, of a LitGPT that updates torchmetrics MeanMetrics in its training and
    validation steps: the means each epoch's end computed (over every rank's state), the logged
    metrics' CSV columns, and the dtype of a value logged as a float64 tensor."""
    model = make_lit_gpt(metrics=True)
    fit = trainer(world, strategy, tmp, max_epochs=2, limit_train_batches=2,
                  limit_val_batches=2)
    fit.fit(model, rank_loader(tokens(GLOBAL_BATCH * 2), GLOBAL_BATCH, world, rank),
            [rank_loader(tokens(GLOBAL_BATCH * 2, seed=seed), GLOBAL_BATCH, world, rank)
             for seed in (5, 6)])
    columns = {name: csv_metric(tmp, name) for name in METRIC_COLUMNS} if rank == 0 else {}
    return list(model.epoch_means), columns, str(fit.callback_metrics["train_third"].dtype)


def metrics_fit_on_worker(ctx: WorkerContext, options: dict, tmp: str
                          ) -> tuple[list[tuple[str, float]], dict[str, list], str]:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    return metrics_fit(ctx.world_size, ctx.rank, GeneralParallel(**options), tmp)


def test_torchmetrics_updated_in_the_steps_count_each_row_once(worlds, tmp_path) -> None:
    """A Metric updated in training_step and validation_step (after self(...), so on the rank
    computing the loss, once per microbatch) and computed at epoch end gives one device's
    means; one logged as an object (``self.log(name, metric)``, Lightning's idiom) gives one
    device's step values (the row-weighted mean of its forwards' values over the step's
    microbatches) and epoch values (Lightning's compute() over every rank's state). The build
    runs the first batch's whole step once more on every rank to check it, and profile_costs
    runs the code after self(...) while timing the last stage: both leave the metrics as they
    were (the first epoch's training mean was 1.4% off before). With two validation
    dataloaders Lightning computes the object at the end of each: the copies on ranks that hold
    no loss must sync too (the job stopped before). A float64 tensor is logged in float64
    (it was rounded to float32). rel 1e-5: the losses differ from one device's by float32
    summation order only (~1e-7)."""
    want, want_columns, want_dtype = metrics_fit(1, 0, "auto", str(tmp_path / "one"))
    assert [name for name, _ in want] == ["val", "train", "val", "train"]
    assert all(len(want_columns[name]) in (2, 4) for name in METRIC_COLUMNS), want_columns
    assert want_dtype == "torch.float64"
    results = worlds.get(2).run(metrics_fit_on_worker,
                                {"schedule": "1f1b", "profile_costs": True},
                                str(tmp_path / "two"))
    for rank, (got, _, dtype) in enumerate(results):
        assert dtype == want_dtype, rank
        assert [name for name, _ in got] == [name for name, _ in want], got
        for (name, value), (_, expected) in zip(got, want, strict=True):
            assert value == pytest.approx(expected, rel=1e-5), (rank, name, got, want)
    columns = results[0][1]
    for name in METRIC_COLUMNS:
        assert [s for s, _ in columns[name]] == [s for s, _ in want_columns[name]], name
        for (_, value), (_, expected) in zip(columns[name], want_columns[name], strict=True):
            assert value == pytest.approx(expected, rel=1e-5), (name, columns, want_columns)


def compiled_fit_on_worker(ctx: WorkerContext, tmp: str) -> dict[str, Any]:
    """The LitGPT with each block compiled (aot_eager) fitted under "auto" (the tuner's
    profiles run each compiled backward several times), then refused under zbv: the auto fit's
    weights, its pick, whether its memory prediction was made, and zbv's error."""
    from lightning_gsched import GeneralParallel
    from lightning_gsched.errors import StrategyConfigError

    as_worker(ctx.rank)
    options = (("compile_backend", "aot_eager"),)
    result: dict[str, Any] = {}

    class Seen(pl.Callback):  # the engine lives from the first batch to the fit's end
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            engine = trainer.strategy.engine
            result["pick"] = engine.train_plan.schedule
            result["predicted"] = engine.memory.predicted is not None

    result["state"] = _fit(ctx.world_size, ctx.rank, GeneralParallel("auto"), "adam", tmp,
                           DEFAULT_FIT + (("callbacks", [Seen()]),), options)
    try:
        _fit(ctx.world_size, ctx.rank, GeneralParallel("zbv"), "adam", f"{tmp}/zbv",
             DEFAULT_FIT, options)
    except StrategyConfigError as exc:
        result["zbv"] = str(exc)
    return result


def test_compiled_blocks_train_like_one_device_and_a_split_backward_is_refused(
        worlds, tmp_path) -> None:
    """Each block torch.compile'd (aot_eager: AOTAutograd's graphs and decomposed ops, no code
    generation). "auto" profiles each compiled backward several times and the build measures
    the stages' bytes with a backward that keeps its graph: both need AOTAutograd's buffer
    donation off (partition/compiled.py; before, "auto" failed with torch's donated-buffer
    error and a named schedule's memory report was unavailable). The pick has no split
    backward and ends at the uncompiled model's weights on one device (decomposed ops only
    reorder float32 sums, inside assert_same_state's tolerance); zbv, whose W runs a compiled
    backward a second time (wrong weights with inductor), is refused naming the modules."""
    want, want_log = reference("adam")
    results = worlds.get(2).run(compiled_fit_on_worker, str(tmp_path))
    plain = [{name.replace("._orig_mod", ""): value for name, value in r["state"].items()}
             for r in results]
    assert all(any("._orig_mod" in name for name in r["state"]) for r in results)
    assert_fit_matches(plain, str(tmp_path), want, want_log, "auto, compiled blocks")
    for r in results:
        assert r["pick"] not in SPLIT_BACKWARD and r["predicted"], r["pick"]
        assert "schedule 'zbv' splits each backward" in r["zbv"], r.get("zbv")
        assert "(model.blocks.0, model.blocks.1, model.blocks.2)" in r["zbv"], r["zbv"]
        assert "split_backward=False" in r["zbv"]


# pipelines x data parallel: every pipeline schedule at W=4 as P=2 x G=2, each stage replicated
# over the two replicas or sharded across them; placed right after the W=4 cases above, so the
# same world serves them (Trainer and Fabric in the same worker processes)
DATA_PARALLEL = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "lpp", "fslpp"]
DATA_PARALLEL_ADAM = {("1f1b", "shard"), ("zbv", "replicate")}  # optimizer state moves too


@pytest.mark.parametrize("mode", ["replicate", "shard"])
@pytest.mark.parametrize("schedule", DATA_PARALLEL)
def test_pipelines_times_data_parallel_match_single_device(worlds, schedule: str, mode: str,
                                                          tmp_path) -> None:
    """Trainer (SGD; Adam for two of them; clipping by norm; the tied embedding and head)
    and Fabric (SGD, clipping) at P=2 x G=2 end at one device's weights and losses."""
    from test_fabric import reference as fabric_reference
    from test_fabric import run_schedule

    world = worlds.get(4)
    options = {"schedule": schedule, "data_parallel_size": 2, "data_parallel": mode}
    optimizers = ("sgd", "adam") if (schedule, mode) in DATA_PARALLEL_ADAM else ("sgd",)
    for optimizer in optimizers:
        want, want_log = reference(optimizer)
        tmp = str(tmp_path / optimizer)
        states = world.run(fit_on_worker, options, optimizer, tmp)
        assert_fit_matches(states, tmp, want, want_log, f"{schedule} 2x2 {mode} {optimizer}")
    fabric_want = fabric_reference()
    fabric_options = {"data_parallel_size": 2, "data_parallel": mode}
    results = world.run(run_schedule, schedule, str(tmp_path / "fabric.ckpt"), "32-true",
                        fabric_options)
    for rank, got in enumerate(results):
        label = f"fabric {schedule} 2x2 {mode} rank {rank}"
        assert_same_state(got["weights"], fabric_want["weights"][-1], label)
        assert got["losses"] == pytest.approx(fabric_want["losses"], rel=1e-5), label


def test_data_parallel_with_activation_checkpointing_matches_single_device(worlds,
                                                                           tmp_path) -> None:
    """zb-h1 sharded over 2 replicas with every stage recomputing its forward."""
    want, want_log = reference("sgd")
    options = {"schedule": "zb-h1", "data_parallel_size": 2, "data_parallel": "shard",
               "checkpoint_activations": True}
    results = worlds.get(4).run(checkpointed_fit_on_worker, options, str(tmp_path))
    for _, flags in results:
        assert flags == [True] * 4, flags  # S doubled by sharding: 4 stages, all checkpointed
    assert_fit_matches([state for state, _ in results], str(tmp_path), want, want_log,
                       "checkpointed zb-h1 2x2 shard")


def mesh_ranks(mesh: Any) -> dict:
    """What a check compares of a DeviceMesh: its shape and names, and the global ranks of
    this rank's two sub-meshes, with the data-parallel one's group summing the ranks."""
    column = mesh["data_parallel"]
    total = torch.tensor([float(torch.distributed.get_rank())])
    torch.distributed.all_reduce(total, group=column.get_group())
    return {"shape": tuple(mesh.shape), "names": tuple(mesh.mesh_dim_names),
            "data_parallel": column.mesh.tolist(), "pipeline": mesh["pipeline"].mesh.tolist(),
            "column_sum": int(total.item())}


def means_over(mesh: Any, reduce: Callable[..., torch.Tensor]) -> dict:
    """Means of the ranks through a front end's reduction (``strategy.reduce`` or
    ``fabric.all_reduce``): over the data-parallel column and over every rank (no group), and
    the backend of each mesh group. Why: on a CPU job the mesh's and the control group's groups
    share the default group's gloo device under their own backend name, which Lightning's
    ``_sync_ddp`` does not know as gloo (it would ask gloo for AVG and fail)."""
    rank = float(torch.distributed.get_rank())
    column = mesh["data_parallel"].get_group()
    return {"column": float(reduce(torch.tensor([rank]), group=column, reduce_op="mean")),
            "world": float(reduce(torch.tensor([rank]), reduce_op="mean")),
            "backends": [torch.distributed.get_backend(mesh[name].get_group())
                         for name in mesh.mesh_dim_names]}


def mesh_on_worker(ctx: WorkerContext, tmp: str) -> dict:
    """The device mesh at W=4 as P=2 x G=2 (one launch, three front-end runs): a Trainer fit
    of 1f1b (``self.device_mesh`` in the module at fit start and in the first step,
    ``trainer.strategy.device_mesh``; the fit's weights for one-device comparison); a Fabric
    run in shard mode (``fabric.strategy.device_mesh`` after launch, one step); a Fabric
    ``"auto"`` run, whose mesh is refused before its first step and (W / G, G) after it, G
    being its pick's."""
    from lightning_gsched import GeneralParallel
    from lightning_gsched.errors import StrategyConfigError

    as_worker(ctx.rank)
    seen: dict[str, Any] = {}

    class Record(pl.Callback):
        def on_fit_start(self, trainer: Any, module: Any) -> None:
            seen["fit_start"] = mesh_ranks(module.device_mesh)

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, index: int) -> None:
            if index == 0:
                seen["module"] = mesh_ranks(module.device_mesh)
                seen["strategy"] = mesh_ranks(trainer.strategy.device_mesh)
                seen["means"] = means_over(module.device_mesh, trainer.strategy.reduce)

    model = make_lit_gpt(optimizer="sgd")
    fit = trainer(ctx.world_size, GeneralParallel("1f1b", data_parallel_size=2), tmp,
                  callbacks=[Record()], **dict(DEFAULT_FIT))
    groups = torch.distributed.distributed_c10d._world.pg_map  # torch's registry (a check)
    before = len(groups)
    fit.fit(model, rank_loader(tokens(GLOBAL_BATCH * 2 * STEPS), GLOBAL_BATCH, ctx.world_size,
                               ctx.rank))
    seen["groups_left"] = len(groups) - before  # the mesh's and the runtime's: released
    seen["state"] = state_of(model)
    seen["fabric_shard"] = _fabric_mesh(ctx, "1f1b", data_parallel_size=2, data_parallel="shard")
    try:
        seen["fabric_auto"] = _fabric_mesh(ctx, "auto", stages=2, microbatches=2)
    except StrategyConfigError as exc:
        seen["fabric_auto"] = f"refused: {exc}"
    return seen


def _fabric_mesh(ctx: WorkerContext, schedule: str, **options: Any) -> dict:
    """A Fabric run's mesh: read after launch (an undecided "auto" refuses, saying when it
    exists), then after one step; the step's loss."""
    from lightning_gsched.errors import StrategyConfigError
    from test_fabric import compute_loss, global_batches, pipelined_fabric, setup, share

    fabric = pipelined_fabric(ctx, schedule, options=options)
    try:
        before: Any = mesh_ranks(fabric.strategy.device_mesh)
    except StrategyConfigError as exc:
        before = f"refused: {exc}"
    model, _ = setup(fabric)
    batch = share(global_batches()[0], ctx.rank, ctx.world_size)
    loss = float(fabric.strategy.step(model, batch, compute_loss))
    after = mesh_ranks(fabric.strategy.device_mesh)
    means = means_over(fabric.strategy.device_mesh, fabric.all_reduce)
    G = fabric.strategy.schedule_config.data_parallel_size  # "auto": its pick's
    fabric.strategy.finish()
    return {"before": before, "after": after, "loss": loss, "G": G, "means": means}


def test_device_mesh_is_pipeline_by_data_parallel_under_trainer_and_fabric(worlds,
                                                                           tmp_path) -> None:
    """W=4 as P=2 x G=2: rank p*2 + g; ``mesh["data_parallel"]`` is the stage's column (the
    ranks whose gradients are reduced together), ``mesh["pipeline"]`` the replica's ranks.
    The Trainer fit of 1f1b at 2 x 2 also trains like one device."""
    from test_fabric import reference as fabric_reference

    results = worlds.get(4).run(mesh_on_worker, str(tmp_path))
    want, want_log = reference("sgd")
    assert_fit_matches([r["state"] for r in results], str(tmp_path), want, want_log,
                       "1f1b W=4 as 2 x 2")
    first_loss = fabric_reference()["losses"][0]
    for rank, seen in enumerate(results):
        p, g = divmod(rank, 2)
        expected = {"shape": (2, 2), "names": ("pipeline", "data_parallel"),
                    "data_parallel": [2 * p, 2 * p + 1], "pipeline": [g, 2 + g],
                    "column_sum": 4 * p + 1}
        assert seen["fit_start"] == seen["module"] == seen["strategy"] == expected, rank
        assert seen["groups_left"] == 0, (rank, seen["groups_left"])
        shard = seen["fabric_shard"]
        assert shard["before"] == shard["after"] == expected, rank
        # means through either front end, over a mesh group and over every rank, on mesh
        # groups that share the default group's device (no transport thread of their own)
        for means in (seen["means"], shard["means"]):
            assert means["column"] == pytest.approx(2 * p + 0.5), (rank, means)
            assert means["world"] == pytest.approx(1.5), (rank, means)
            assert means["backends"] == [SHARED_BACKEND] * 2, (rank, means)
        assert shard["loss"] == pytest.approx(first_loss, rel=1e-5)
        auto = seen["fabric_auto"]
        assert auto["before"].startswith("refused: device_mesh is made once"), auto["before"]
        assert "at the first batch for schedule='auto'" in auto["before"]
        # the pick's G (the tuner's, from timings: 1 or 2 here), laid out as rank p*G + g
        G = auto["G"]
        p, g = divmod(rank, G)
        column = [p * G + h for h in range(G)]
        assert auto["after"] == {"shape": (4 // G, G), "names": ("pipeline", "data_parallel"),
                                 "data_parallel": column,
                                 "pipeline": [q * G + g for q in range(4 // G)],
                                 "column_sum": sum(column)}, (rank, G)
        assert auto["loss"] == pytest.approx(first_loss, rel=1e-5)


def test_fsdp_with_two_stages_per_worker_matches_single_device(worlds, tmp_path) -> None:
    """fsdp at W=2 with S=4 (the fsdp_vs_torch configuration): each rank frees a fetched stage
    after its forward and fetches it again for its backward; SGD, as above."""
    want, want_log = reference("sgd")
    tmp = str(tmp_path / "sgd")
    states = worlds.get(2).run(fit_on_worker, {"schedule": "fsdp", "stages": 4}, "sgd", tmp)
    assert_fit_matches(states, tmp, want, want_log, "fsdp S=4 W=2")


@pytest.mark.parametrize("world_size", [2])
def test_ddp_schedule_matches_lightning_ddp(worlds, world_size: int, tmp_path) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    world = worlds.get(world_size)
    ours = world.run(fit_on_worker, {"schedule": "ddp"}, "adam", str(tmp_path / "ours"))
    theirs = world.run(fit_on_worker, DDPStrategy(), "adam", str(tmp_path / "theirs"))
    for rank in range(world_size):
        assert_same_state(ours[rank], theirs[rank], f"rank {rank}")
    # (the CSV logs differ on purpose: DDPStrategy logs rank 0's own loss unless sync_dist=True,
    # GeneralParallel the loss of the global batch, as one device would)


def test_adam_premise_reordering_noise_is_bounded() -> None:
    """The premise behind comparing Adam runs with atol 1e-6 on any CPU, measured here.

    A schedule sums each step's gradient over microbatches and ranks in another order than one
    device. This measures those reordering differences on this CPU (whole global batch against
    2, 4 and 8 microbatches, forward and reversed order, for each of the first 4 global
    batches) and requires the first-order bound on how far Adam's steps can carry them (4 steps,
    LR decaying by 0.7 per step) to stay under a quarter of the atol that
    test_lightning_checkpoint and this module compare Adam weights with.
    """
    import torch.nn.functional as F

    from lightning_models import ADAM_EPS

    model = make_lit_gpt(optimizer="adam")
    lr = model.configure_optimizers()["optimizer"].defaults["lr"]
    data = tokens(GLOBAL_BATCH * 4)

    def gradient(batch: torch.Tensor, pieces: int, reverse: bool) -> list[torch.Tensor]:
        model.zero_grad()
        chunks = list(batch.chunk(pieces))
        for chunk in reversed(chunks) if reverse else chunks:
            logits = model(chunk[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), chunk[:, 1:].reshape(-1))
            (loss / pieces).backward()
        return [p.grad.clone() for p in model.parameters()]

    # Per element: sqrt(v) >= |g_t| / sqrt(t) at step t (bias-corrected v holds g_t^2 with
    # weight at least 1/t), so a reordering difference delta_i of element i moves its step by at
    # most 2 * lr * delta_i / (|g_i| / 2 + eps) within the first 4 steps.
    worst, delta = 0.0, 0.0
    for batch in data.split(GLOBAL_BATCH):
        whole = gradient(batch, 1, False)
        for pieces, reverse in ((2, False), (4, False), (8, False), (4, True)):
            split = gradient(batch, pieces, reverse)
            for a, b in zip(whole, split, strict=True):  # one gradient per parameter
                delta = max(delta, float((a - b).abs().max()))
                worst = max(worst, float(((a - b).abs() / (a.abs() / 2 + ADAM_EPS)).max()))
    lr_sum = sum(0.7**step for step in range(4))
    bound = 2 * lr * lr_sum * worst
    print(f"delta {delta:.3g}, bound on the weight difference after 4 steps {bound:.3g}")
    assert 0 < delta and bound < 1e-6 / 4, (delta, bound)


LOOP_FEATURES = [
    ("fslpp", (("max_steps", STEPS), ("accumulate_grad_batches", 2),
               ("gradient_clip_val", CLIP))),
    ("1f1b", (("max_steps", STEPS), ("gradient_clip_val", 0.01),
              ("gradient_clip_algorithm", "value"))),
    ("fsdp", (("max_steps", STEPS), ("gradient_clip_val", 0.05))),  # clipping actually bites
    ("zbv", (("max_steps", STEPS), ("accumulate_grad_batches", 2),
             ("gradient_clip_val", CLIP))),
]


@pytest.mark.parametrize("schedule, options", LOOP_FEATURES,
                         ids=["accumulate", "clip_value", "clip_norm_tight", "accumulate_zbv"])
def test_loop_features_match_single_device(worlds, schedule: str, options: tuple,
                                           tmp_path) -> None:
    want, want_log = reference("sgd", options)
    states = worlds.get(2).run(fit_on_worker, {"schedule": schedule}, "sgd", str(tmp_path),
                               options)
    for rank, state in enumerate(states):
        assert_same_state(state, want, f"{schedule} {options} rank {rank}")
    got_log = csv_metric(str(tmp_path), "train_loss")
    assert [v for _, v in got_log] == pytest.approx([v for _, v in want_log], rel=1e-5)
    if dict(options).get("gradient_clip_algorithm", "norm") == "norm":
        unclipped, _ = reference("sgd", (("max_steps", STEPS),))
        assert any(not torch.allclose(unclipped[n], want[n]) for n in want)  # clipping bit


def test_bf16_mixed_on_cpu_tracks_single_device(worlds, tmp_path) -> None:
    """bf16 autocast: results equal one device's up to bf16 rounding of reordered sums."""
    options = (("max_steps", STEPS), ("gradient_clip_val", CLIP), ("precision", "bf16-mixed"))
    want, want_log = reference("sgd", options)
    fp32, _ = reference("sgd")
    states = worlds.get(2).run(fit_on_worker, {"schedule": "gpipe"}, "sgd", str(tmp_path),
                               options)
    # The tolerance is measured, not chosen: a distributed bf16 run differs from the
    # single-device bf16 run because microbatches and reductions re-round a subset of the same
    # bf16 roundings in another order, so their distance is of the order of the total bf16
    # rounding of the single run, i.e. its distance to the float32 run on the same batches.
    # Measured on Xeon: 0.54 of it over all weights, 0.25-0.77 per tensor (small tensors
    # fluctuate more, hence the factor 2 there).
    def distance(a: dict, b: dict, names: list[str]) -> float:
        return float(torch.cat([(a[n] - b[n]).double().flatten() for n in names]).norm())

    names = list(want)
    bf16_rounding = distance(want, fp32, names)
    assert bf16_rounding > 1e-5  # the reference really ran in bf16 (float32 reordering: ~1e-7)
    assert distance(states[0], want, names) <= bf16_rounding
    for name in names:
        assert distance(states[0], want, [name]) <= 2 * distance(want, fp32, [name]), name
    # The logged loss is float32 cross-entropy of bf16 logits: one bf16 ulp of a logit is 2^-8
    # relative, which moves the loss by at most about that much; rel 1e-2 is 2.5 ulps.
    got_log = csv_metric(str(tmp_path), "train_loss")
    assert [v for _, v in got_log] == pytest.approx([v for _, v in want_log], rel=1e-2)


def custom_placement(stage: int, micro: int, phase: Any) -> tuple[int, int]:
    """Weights of stage s live on s % 2; microbatch b runs stage s on (s // 2 + b) % 2."""
    return stage % 2, (stage // 2 + micro) % 2


def custom_priority(stage: int, micro: int, phase: Any) -> tuple[int, int]:
    return (micro, stage)


def test_custom_schedule_from_two_callables(worlds, tmp_path) -> None:
    want, _ = reference("sgd")
    options = {"schedule": "mine", "placement": custom_placement, "priority": custom_priority,
               "stages": 4, "microbatches": 4}
    states = worlds.get(2).run(fit_on_worker, options, "sgd", str(tmp_path))
    for rank, state in enumerate(states):
        assert_same_state(state, want, f"custom rank {rank}")


class _CheckpointedStages(pl.Callback):
    """Which stages the running executor checkpoints (read during the fit: the engine and its
    runtime are gone after teardown)."""

    def __init__(self) -> None:
        self.flags: list[bool] | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.flags = list(trainer.strategy.engine.executor.compute.checkpointed)


def checkpointed_fit_on_worker(ctx: WorkerContext, options: dict, tmp: str) -> tuple:
    from lightning_gsched import GeneralParallel

    as_worker(ctx.rank)
    seen = _CheckpointedStages()
    state = _fit(ctx.world_size, ctx.rank, GeneralParallel(**options), "sgd", tmp,
                 DEFAULT_FIT + (("callbacks", [seen]),))
    return state, seen.flags


def test_activation_checkpointing_matches_single_device(worlds, tmp_path) -> None:
    """GeneralParallel(checkpoint_activations=True): every stage's forward is recomputed in its
    backward (zbv: split backward, two stages per rank, the loss on rank 0), and the fit still
    ends at the single-device weights and losses."""
    want, want_log = reference("sgd")
    options = {"schedule": "zbv", "checkpoint_activations": True}
    results = worlds.get(2).run(checkpointed_fit_on_worker, options, str(tmp_path))
    for _, flags in results:
        assert flags == [True] * 4, flags  # the runtime was handed the plan's flags
    assert_fit_matches([state for state, _ in results], str(tmp_path), want, want_log,
                       "checkpointed zbv")


def fit_counting_builds(ctx: WorkerContext, strategy: dict, optimizer: str, tmp: str) -> dict:
    """:func:`fit_on_worker`, counting the partitions and training plans this rank made."""
    from lightning_gsched.engine import config, cut

    counts = {"partitions": 0, "training_plans": 0}
    partition, plan_arguments = cut.partition, config.plan_arguments

    def counted_partition(*args: Any, **kwargs: Any) -> Any:
        counts["partitions"] += 1
        return partition(*args, **kwargs)

    def counted_plan(arguments: Any, workers: int, **kwargs: Any) -> Any:
        counts["training_plans"] += not kwargs.get("forward_only", False)
        return plan_arguments(arguments, workers, **kwargs)

    cut.partition, config.plan_arguments = counted_partition, counted_plan
    try:
        state = fit_on_worker(ctx, strategy, optimizer, tmp)
    finally:
        cut.partition, config.plan_arguments = partition, plan_arguments
    return {"state": state, **counts}


def test_balance_time_partitions_and_plans_once_per_rank(worlds, tmp_path) -> None:
    """balance='time': rank 0 times the units and keeps its partition, the other ranks cut at
    the same places with its costs; the tied GPT's training plan is made once, with its ties
    (the setup only checks the arguments). Training still equals one device."""
    want, want_log = reference("sgd")
    tmp = str(tmp_path / "sgd")
    out = worlds.get(2).run(fit_counting_builds, {"schedule": "1f1b", "balance": "time"},
                            "sgd", tmp)
    assert_fit_matches([o["state"] for o in out], tmp, want, want_log, "1f1b balance=time")
    assert [o["partitions"] for o in out] == [1, 1]
    assert [o["training_plans"] for o in out] == [1, 1]
