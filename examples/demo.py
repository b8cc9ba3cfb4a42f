"""``make demo``: train the tied-embedding GPT with fslpp on 4 CPU processes.

Steps: print the plan the strategy will run (and draw its timeline to out/fslpp_w4.png), train
for 60 steps through LightningCLI with configs/fslpp.yaml (GeneralParallel on 4 gloo
processes; rank 0 prints the plan and the partition again at the first batch), then read the
CSV log and show the loss falling.
"""

from __future__ import annotations

import csv
import glob
import os
import subprocess
import sys

from lightning_gsched.cli import main as gsched

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _losses(log_dir: str) -> list[tuple[int, float]]:
    versions = sorted(glob.glob(os.path.join(log_dir, "version_*")), key=os.path.getmtime)
    with open(os.path.join(versions[-1], "metrics.csv")) as handle:
        rows = list(csv.DictReader(handle))
    return [(int(r["step"]), float(r["train_loss"])) for r in rows if r.get("train_loss")]


def main() -> None:
    os.chdir(ROOT)
    os.makedirs("out", exist_ok=True)
    print("== the plan: fslpp, W=4 workers, R=2, S=4 stages, B=8 microbatches ==")
    gsched(["plan", "fslpp", "--workers", "4", "--stages", "4", "--microbatches", "8", "--R", "2",
            "--png", "out/fslpp_w4.png"])
    print("\n== training: python examples/train_gpt.py fit --config configs/fslpp.yaml ==")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    subprocess.run([sys.executable, "examples/train_gpt.py", "fit", "--config",
                    "configs/fslpp.yaml", "--trainer.enable_progress_bar", "false"],
                   check=True, env=env)
    losses = _losses("out/logs/fslpp")
    print("\n== train_loss from the CSV log (rank 0 logs the global batch's loss) ==")
    for step, loss in losses[:: max(1, len(losses) // 6)] + losses[-1:]:
        print(f"step {step:3d}  train_loss {loss:.3f}")
    versions = sorted(glob.glob("out/logs/fslpp/version_*"), key=os.path.getmtime)
    print(f"\nschedule timeline: out/fslpp_w4.png   CSV log: {versions[-1]}/metrics.csv")


if __name__ == "__main__":
    main()
