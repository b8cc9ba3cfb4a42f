"""Multi-node: ``Trainer(num_nodes=2, devices=2, strategy=GeneralParallel(...))``.

* torchrun, 2 nodes x 2 processes on this machine over loopback (one launcher per "node", both
  started at once, static rendezvous on a free port): Lightning sees world size 4, global ranks
  0-3 with node ranks 0, 0, 1, 1 and local ranks 0, 1, 0, 1; the plan has 4 workers; after 3
  SGD steps every rank holds the weights a single-device Trainer reaches on the same global
  batches (tolerances as in the other equivalence tests). Any failure kills both launchers and
  their workers and fails with their stderr tails; the whole job is bounded by ``JOB_TIMEOUT``.
* SLURM, without SLURM: under the variables ``srun`` sets for task 3 of a 2 x 2 job, a Trainer
  with GeneralParallel resolves SLURMEnvironment and the ranks (no process is started).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_gsched import GeneralParallel
from lightning_models import assert_same_state, make_lit_gpt, rank_loader, state_of, tokens, trainer
from multinode_script import DATA_SEED, DEVICES, GLOBAL_BATCH, NUM_NODES, STEPS

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "multinode_script.py"
JOB_TIMEOUT = 240.0  # seconds for the whole 2-node job; it takes about 30 s here
TAIL = 3000  # characters of each launcher's stderr quoted on failure


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no output)"
    return text[-TAIL:]


def _stop_launcher(process: subprocess.Popen) -> None:
    """SIGTERM first: torchrun's agent then stops its own workers; SIGKILL if it does not exit."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)  # the launcher's own session (start_new_session)
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    except ProcessLookupError:
        pass


def _stop_workers(out_dir: Path) -> None:
    """Kill the workers still alive (each wrote its pid): torchrun starts each worker in a
    session of its own, so a launcher that died abruptly leaves them running otherwise."""
    for pid_file in out_dir.glob("worker*.pid"):
        pid = int(pid_file.read_text() or 0)
        cmdline = Path(f"/proc/{pid}/cmdline")
        try:  # only a process that is still this job's worker (pids can be reused)
            if pid and SCRIPT.name in cmdline.read_bytes().decode(errors="replace"):
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass  # already gone


def _stop_job(processes: list[subprocess.Popen], out_dir: Path) -> None:
    for process in processes:
        _stop_launcher(process)
    _stop_workers(out_dir)


def _launch_nodes(out_dir: Path, port: int) -> tuple[list[subprocess.Popen], list[Path]]:
    """One torchrun per node, as a user types it on each machine (here both on loopback)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    processes, logs = [], []
    for node in range(NUM_NODES):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NUM_NODES),
                   "--node_rank", str(node), "--nproc-per-node", str(DEVICES),
                   "--master_addr", "127.0.0.1", "--master_port", str(port),
                   str(SCRIPT), str(out_dir)]
        log = out_dir / f"node{node}.log"
        with open(log, "w") as handle:  # a file, not a pipe: a full pipe would block the job
            processes.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=handle,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        logs.append(log)
    return processes, logs


def _wait_all(processes: list[subprocess.Popen], logs: list[Path], out_dir: Path,
              timeout: float) -> None:
    """Wait for every launcher; on the first failure or after ``timeout`` s stop all and fail."""
    deadline = time.monotonic() + timeout
    problem = None
    while problem is None and any(p.poll() is None for p in processes):
        failed = [i for i, p in enumerate(processes) if p.poll() not in (None, 0)]
        if failed:
            problem = f"node {failed[0]} exited with status {processes[failed[0]].returncode}"
        elif time.monotonic() > deadline:
            problem = f"the job did not finish within {timeout:.0f} s"
        else:
            time.sleep(0.2)
    if problem is None and any(p.returncode != 0 for p in processes):
        problem = "statuses " + str([p.returncode for p in processes])
    if problem is not None:
        _stop_job(processes, out_dir)
        tails = "\n".join(f"--- node {i} (status {p.returncode}) ---\n{_tail(log)}"
                          for i, (p, log) in enumerate(zip(processes, logs, strict=True)))
        pytest.fail(f"2-node torchrun job failed: {problem}\n{tails}")


@pytest.mark.distributed
def test_torchrun_two_nodes_train_like_one_device(tmp_path: Path) -> None:
    world = NUM_NODES * DEVICES
    processes, logs = _launch_nodes(tmp_path, _free_port())
    try:
        # the reference runs here while the launchers import and rendezvous
        data = tokens(GLOBAL_BATCH * STEPS, seed=DATA_SEED)
        single = make_lit_gpt()
        trainer(1, "auto", max_steps=STEPS).fit(single, rank_loader(data, GLOBAL_BATCH, 1, 0))
        want = state_of(single)
        _wait_all(processes, logs, tmp_path, JOB_TIMEOUT)
    finally:  # normally a no-op; after a failure in this process too, nothing is left running
        _stop_job(processes, tmp_path)

    for rank in range(world):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        node, local = divmod(rank, DEVICES)
        assert seen["cluster_environment"] == "TorchElasticEnvironment", seen
        assert (seen["world_size"], seen["num_nodes"]) == (world, NUM_NODES), seen
        assert (seen["global_rank"], seen["node_rank"], seen["local_rank"]) == (rank, node, local)
        assert seen["env"] == {"RANK": str(rank), "LOCAL_RANK": str(local),
                               "GROUP_RANK": str(node), "WORLD_SIZE": str(world)}, seen
        assert seen["plan_workers"] == seen["engine_world_size"] == seen["dist_world_size"] == world
        assert seen["engine_rank"] == seen["channels_rank"] == seen["dist_rank"] == rank, seen
        assert seen["global_step"] == STEPS, seen
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert_same_state(got, want, f"rank {rank} (node {node}) vs one device")


# what srun sets for global task 3 of `sbatch --nodes 2 --ntasks-per-node 2`
SLURM_TASK_3_OF_2X2 = {
    "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2",
    "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
    "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "fslpp", "SLURM_NODELIST": "node[07-08]",
}


def test_slurm_variables_give_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    for name in [n for n in os.environ if n.startswith(("SLURM_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(name)  # a test run inside a SLURM job must not leak its own values
    for name in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT",
                 "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in SLURM_TASK_3_OF_2X2.items():
        monkeypatch.setenv(name, value)
    run = Trainer(accelerator="cpu", num_nodes=2, devices=2, logger=False,
                  strategy=GeneralParallel("fslpp", R=2))
    strategy = run.strategy
    assert isinstance(strategy, GeneralParallel)
    assert isinstance(strategy.cluster_environment, SLURMEnvironment)
    assert (run.world_size, run.global_rank, run.node_rank, run.local_rank) == (4, 3, 1, 1)
    assert strategy.cluster_environment.main_address == "node07"  # the job's first node
    environment = strategy.cluster_environment
    assert environment.creates_processes_externally  # srun starts them; Lightning starts none
    # what the launcher checks before running: --ntasks-per-node matches devices, --nodes num_nodes
    environment.validate_settings(num_devices=strategy.num_processes, num_nodes=strategy.num_nodes)
    assert strategy.schedule_config.training_plan(strategy.world_size).workers == 4
