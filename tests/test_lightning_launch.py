"""How users start GeneralParallel: registered names, YAML configs, spawn, and the script launcher.

* every library schedule is a registered strategy name that resolves to GeneralParallel;
* every ``configs/*.yaml`` parses through LightningCLI into the intended strategy (no training);
* ``start_method="spawn"`` (Lightning's multiprocessing launcher, as in notebooks) trains to the
  single-device weights and brings them back to the launching process;
* ``examples/drop_in.py`` (the script launcher re-running the script per rank) trains the same
  model to the same validation loss under ``ddp`` and ``gsched_fslpp``.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_gsched import GeneralParallel
from lightning_gsched.schedule.library import LIBRARY
from lightning_models import RankSlices, make_lit_gpt, rank_loader, state_of, tokens, trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", [*LIBRARY, "auto"])
def test_registered_names_resolve(name: str) -> None:
    run = pl.Trainer(accelerator="cpu", devices=2, strategy=f"gsched_{name}", logger=False)
    assert isinstance(run.strategy, GeneralParallel)
    assert run.strategy.schedule_config.schedule == name


def _cli_from(path: Any, monkeypatch: Any) -> Any:
    """The example GPT's LightningCLI built from a YAML config (not run): what the user gets."""
    from lightning.pytorch.cli import LightningCLI

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    monkeypatch.chdir(ROOT)
    try:
        from gpt import GPT, CharDataModule

        return LightningCLI(GPT, CharDataModule, run=False, args=["--config", str(path)],
                            save_config_callback=None)
    finally:
        sys.path.remove(os.path.join(ROOT, "examples"))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))),
                         ids=lambda p: os.path.basename(p))
def test_yaml_configs_build_the_intended_strategy(path: str, monkeypatch) -> None:
    from lightning.pytorch.cli import LightningCLI

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    monkeypatch.chdir(ROOT)
    try:
        from gpt import GPT, CharDataModule

        cli = LightningCLI(GPT, CharDataModule, run=False, args=["--config", path],
                           save_config_callback=None)
    finally:
        sys.path.remove(os.path.join(ROOT, "examples"))
    name = os.path.basename(path)[: -len(".yaml")]
    if name == "ddp_lightning":
        assert type(cli.trainer.strategy).__name__ == "DDPStrategy"
        return
    assert isinstance(cli.trainer.strategy, GeneralParallel)
    schedule, _, variant = name.partition("_")  # 1f1b_dp: 1f1b on a (pipeline, data) mesh
    assert cli.trainer.strategy.schedule_config.schedule == schedule
    if schedule == "auto":  # decided at the first batch: no plan before it
        config = cli.trainer.strategy.schedule_config
        config.check(4)
        assert not config.decided
        # auto_tp: T searched over [1, 2], every rank loading its own rows
        assert config.tensor_parallel_candidates(4) == ((1, 2) if variant == "tp" else (1,))
        assert config.rows_per_rank == (variant == "tp")
        return
    devices = cli.trainer.num_devices
    plan = cli.trainer.strategy.schedule_config.training_plan(devices)  # the plan it would run
    T = plan.tensor_parallel_size
    assert plan.workers * T == devices
    if variant == "3d":  # 2 pipeline positions x 2 replicas x 2 tensor-parallel ranks
        assert (plan.pipeline_size, plan.data_parallel_size, T) == (2, 2, 2)
        assert set(cli.trainer.strategy.tensor_parallel_plan.values()) == {"colwise", "rowwise"}
    if variant == "sp":  # sequence parallelism by name on 2 pipeline positions x 2 TP ranks
        from lightning_gsched.partition.tensor_parallel import style_of

        assert (plan.pipeline_size, plan.data_parallel_size, T) == (2, 1, 2)
        styles = cli.trainer.strategy.tensor_parallel_plan
        assert {type(style_of(v, k)).__name__ for k, v in styles.items()} == {
            "SequenceInput", "SequenceParallel", "SequenceGather", "ColwiseParallel",
            "RowwiseParallel", "PrepareModuleOutput"}
        assert styles["blocks.3"] == "sequence_output"  # the demo GPT's last of 4 blocks
    # zbv's order from the stages' measured seconds (the YAML spelling of the option)
    assert cli.trainer.strategy.schedule_config.profile_costs == (name == "zbv")
    if variant.startswith("dp"):  # 2 replicas of a 2-worker pipeline, as the file says
        mode = "shard" if variant == "dp_shard" else "replicate"
        assert (plan.pipeline_size, plan.data_parallel_size, plan.data_parallel) == (2, 2, mode)
    # dp_per_replica: every rank of a replica loads its batch (Lightning's sampler: 2 shares)
    strategy = cli.trainer.strategy
    assert strategy.schedule_config.per_replica == (variant == "dp_per_replica")
    if variant == "dp_per_replica":
        from lightning_gsched.engine.options import sampler_kwargs

        assert [sampler_kwargs(devices, r, strategy.schedule_config)["rank"]
                for r in range(devices)] == [0, 1, 0, 1]


@pytest.mark.parametrize("value, nbytes", [("20GiB", 20 * 2**30), ("512 MiB", 512 * 2**20),
                                           ("1000000", 10**6)])
def test_yaml_auto_takes_a_memory_budget(value: str, nbytes: int, tmp_path, monkeypatch) -> None:
    """``configs/auto.yaml`` with its commented budget line switched on parses; the budget is
    a string with a unit, or bytes."""

    with open(os.path.join(ROOT, "configs", "auto.yaml")) as handle:
        text = handle.read()
    old = "      # memory_budget: 20GiB"
    assert old in text
    path = tmp_path / "budget.yaml"
    path.write_text(text.replace(old, f"      memory_budget: {value}"))
    cli = _cli_from(path, monkeypatch)
    config = cli.trainer.strategy.schedule_config
    assert config.is_auto and config.memory_budget == nbytes


@pytest.mark.parametrize("value, sizes", [("[1, 2]", (1, 2)), ("auto", (1, 2, 4))])
def test_yaml_auto_searches_the_tensor_parallel_size(value: str, sizes: tuple, tmp_path,
                                                     monkeypatch) -> None:
    """``configs/auto.yaml`` with ``tensor_parallel_size`` a list or ``auto`` (and a plan):
    the T values ``"auto"`` tries at the first batch, every rank loading its own rows."""

    with open(os.path.join(ROOT, "configs", "auto.yaml")) as handle:
        text = handle.read()
    old = "      # memory_budget: 20GiB"
    path = tmp_path / "searched.yaml"
    path.write_text(text.replace(old, f"      tensor_parallel_size: {value}\n"
                                      "      tensor_parallel_plan: {'blocks.*.attn.q': colwise}"))
    cli = _cli_from(path, monkeypatch)
    config = cli.trainer.strategy.schedule_config
    assert config.rows_per_rank and config.tensor_parallel_candidates(4) == sizes


@pytest.mark.parametrize("value, flags", [("true", (True,) * 4),
                                          ("[true, false, true, false]", (True, False) * 2)])
def test_yaml_init_args_take_checkpoint_activations(value: str, flags: tuple, tmp_path,
                                                    monkeypatch) -> None:
    """``checkpoint_activations`` from a LightningCLI YAML: one bool, or a list per stage."""

    with open(os.path.join(ROOT, "configs", "1f1b.yaml")) as handle:
        text = handle.read()
    old = "init_args: {schedule: 1f1b, stages: 4, microbatches: 8}"
    assert old in text
    path = tmp_path / "checkpointed.yaml"
    path.write_text(text.replace(old, old[:-1] + f", checkpoint_activations: {value}}}"))
    cli = _cli_from(path, monkeypatch)
    assert cli.trainer.strategy.schedule_config.training_plan(4).checkpointed == flags


@pytest.mark.distributed
def test_spawn_launcher_trains_like_one_device() -> None:
    data = tokens(8 * 3)
    single = make_lit_gpt()
    trainer(1, "auto", max_steps=3).fit(single, rank_loader(data, 8, 1, 0))
    model = make_lit_gpt()
    run = trainer(2, GeneralParallel("fslpp", start_method="spawn"), max_steps=3)
    run.fit(model, datamodule=RankSlices(data, 8))
    want = state_of(single)
    for name, value in state_of(model).items():  # weights came back to this process
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_drop_in_example_same_result_under_ddp_and_fslpp() -> None:
    """The example as a user runs it, under DDP and under fslpp: the same validation loss.
    Both runs start at once (each process's imports take seconds during which a core is
    idle; tests/launched_jobs.py says why this overlaps well) and are awaited in turn; each
    picks a free port of its own (no MASTER_PORT inherited)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}

    def started(strategy: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "examples/drop_in.py", "--strategy", strategy, "--devices", "2",
             "--max-epochs", "1"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(env, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
            start_new_session=True)

    def val_loss(run: subprocess.Popen[str]) -> float:
        try:
            stdout, stderr = run.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.communicate()
            pytest.fail(f"{run.args} did not end within 300 s")
        assert run.returncode == 0, stderr[-3000:]
        found = re.findall(r"val[_ ]loss[^0-9]*([0-9.]+)", stdout)
        assert found, stdout[-2000:]
        return float(found[-1])

    runs = {strategy: started(strategy) for strategy in ("gsched_fslpp", "ddp")}
    try:
        losses = {strategy: val_loss(run) for strategy, run in runs.items()}
    finally:
        for run in runs.values():
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.communicate()
    assert losses["gsched_fslpp"] == pytest.approx(losses["ddp"], abs=2e-4)  # printed to 4 places


@pytest.mark.parametrize("value, want", [("true", True), ("false", False), ("auto", "auto")])
def test_yaml_init_args_take_stream_checkpoint(value: str, want: object, tmp_path,
                                               monkeypatch) -> None:
    """``stream_checkpoint`` from a LightningCLI YAML: a bool or ``auto``."""

    with open(os.path.join(ROOT, "configs", "1f1b.yaml")) as handle:
        text = handle.read()
    old = "init_args: {schedule: 1f1b, stages: 4, microbatches: 8}"
    path = tmp_path / "streamed.yaml"
    path.write_text(text.replace(old, old[:-1] + f", stream_checkpoint: {value}}}"))
    cli = _cli_from(path, monkeypatch)
    assert cli.trainer.strategy.stream_checkpoint == want
