"""Pure-Python scheduling layer (never imports torch).

``plan(name, workers=W, ...)`` returns a :class:`Plan` whose ``programs`` the runtime executes
and whose ``metrics`` and ``timeline`` the CLI prints and draws.
"""

from lightning_gsched.schedule.arguments import ScheduleArguments
from lightning_gsched.schedule.dryrun import dry_run
from lightning_gsched.schedule.jobs import Job, Phase, StageGraph
from lightning_gsched.schedule.library import LIBRARY, ScheduleSpec, get_schedule
from lightning_gsched.schedule.lower import lower
from lightning_gsched.schedule.metrics import PlanMetrics, WorkerMetrics, measure
from lightning_gsched.schedule.orders import bfs, normalise_caps, one_f_one_b
from lightning_gsched.schedule.placements import (
    DDP,
    FSDP,
    FSLPP,
    LPP,
    FSLPPSeed,
    GPipe,
    PlacementTable,
)
from lightning_gsched.schedule.plan import Plan, plan
from lightning_gsched.schedule.predict import StepPrediction, predict_step_time
from lightning_gsched.schedule.program import Action, Op, Programs
from lightning_gsched.schedule.simulate import Costs, Slot, Timeline, simulate

__all__ = [
    "Action", "Costs", "DDP", "FSDP", "FSLPP", "FSLPPSeed", "GPipe", "Job", "LIBRARY", "LPP",
    "Op", "Phase", "Plan", "PlacementTable", "PlanMetrics", "Programs", "ScheduleSpec", "Slot",
    "StageGraph", "StepPrediction", "Timeline", "WorkerMetrics", "bfs", "dry_run", "get_schedule", "lower",
    "measure", "normalise_caps", "one_f_one_b", "plan", "predict_step_time", "simulate",
]
