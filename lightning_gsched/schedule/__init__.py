"""Pure-Python scheduling layer (never imports torch). ``plan(name, workers=W, ...)`` returns a
:class:`Plan`: ``programs`` for the runtime, ``metrics`` and ``timeline`` for the CLI. ``__all__``
is the public API; the planner's internals are imported from their modules."""

from lightning_gsched.schedule.arguments import ScheduleArguments
from lightning_gsched.schedule.dryrun import dry_run
from lightning_gsched.schedule.jobs import Phase, StageGraph
from lightning_gsched.schedule.library import LIBRARY, ScheduleSpec, get_schedule
from lightning_gsched.schedule.memory import predict_memory
from lightning_gsched.schedule.metrics import PlanMetrics, WorkerMetrics
from lightning_gsched.schedule.placements import (
    DDP,
    FSDP,
    FSLPP,
    LPP,
    FSLPPSeed,
    GPipe,
    PlacementTable,
)
from lightning_gsched.schedule.plan import Plan, plan, plan_arguments
from lightning_gsched.schedule.predict import StepPrediction, predict_step_time
from lightning_gsched.schedule.program import Action, Op, Programs
from lightning_gsched.schedule.runtime_costs import RuntimeCosts
from lightning_gsched.schedule.simulate import Costs, Timeline
from lightning_gsched.schedule.tune import TuneResult, tune

__all__ = [
    "Action", "Costs", "DDP", "FSDP", "FSLPP", "FSLPPSeed", "GPipe", "LIBRARY", "LPP", "Op",
    "Phase", "Plan", "PlacementTable", "PlanMetrics", "Programs", "RuntimeCosts",
    "ScheduleArguments", "ScheduleSpec", "StageGraph", "StepPrediction", "Timeline",
    "TuneResult", "WorkerMetrics", "dry_run", "get_schedule", "plan", "plan_arguments",
    "predict_memory", "predict_step_time", "tune",
]
