"""Train the tiny GPT from a YAML config: ``python examples/train_gpt.py fit --config configs/fslpp.yaml``.

A stock ``LightningCLI``: the strategy is whatever the config's ``trainer.strategy`` names, so
the same entry point runs Lightning's own ``ddp`` (``configs/ddp_lightning.yaml``) and every
``GeneralParallel`` schedule (``configs/<schedule>.yaml``). Override anything on the command
line, e.g. ``--trainer.devices 2 --trainer.max_steps 30 --data.batch_size 16``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so `gpt` imports from any cwd
from gpt import GPT, CharDataModule  # noqa: E402

try:  # importing the strategy registers the ``gsched_<schedule>`` names for ``--trainer.strategy``
    from lightning_gsched import GeneralParallel  # noqa: F401
except ImportError:  # the strategy is not installed: Lightning's own strategies still work
    pass


def main() -> None:
    LightningCLI(GPT, CharDataModule, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
