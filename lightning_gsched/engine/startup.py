"""What rank 0 prints when the pipeline is built, from every worker's own numbers.

Why a module of its own: the start-up summary is the user's first view of the plan and must
stay one screen at W=8 and beyond, while a large plan lowers each rank's program only where it
is read (schedule/lazy_ranks.py). So each rank computes its own worker's row
(:func:`startup_rows`, one gather) and rank 0 joins them with the plan's ranges, the command
that prints the full table and the partition's stage table (:func:`startup_text`).
"""

from __future__ import annotations

from typing import Any

from lightning_gsched.engine.control import Collective
from lightning_gsched.engine.logsync import exchange
from lightning_gsched.engine.workers import Workers
from lightning_gsched.partition import Partition
from lightning_gsched.runtime import ParameterMemory
from lightning_gsched.schedule.describe import (
    StartupRow,
    plan_command,
    startup_row,
    startup_summary,
)
from lightning_gsched.schedule.plan import Plan


def startup_rows(plan: Plan, memory: ParameterMemory, workers: Workers, group: Any,
                 collective: Collective) -> list[StartupRow]:
    """Every worker's row of the start-up summary, each computed by its own rank from its own
    program and gathered (collective).

    Why not rank 0 reading every program: a plan of many ranks lowers each rank's program when
    first read (schedule/lazy_ranks.py); reading all W of them on rank 0 costs a minute and
    gigabytes at W=1024. Gathered, the summary is the same text."""
    mine = startup_row(plan, memory.stage_bytes, memory.tie_bytes, workers.worker)
    rows = collective("the start-up summary's gather",
                      lambda: exchange(mine, workers.ranks, group))
    return workers.one_each(rows)  # a worker's T ranks report the same row


def startup_text(plan: Plan, partition: Partition, memory: ParameterMemory, custom: bool,
                 memory_lines: str | None = None, header: str = "",
                 rows: list[StartupRow] | None = None) -> str:
    """What rank 0 prints when the pipeline is built: one screen at W=8 and beyond.

    The plan's per-worker numbers as ranges over the workers (:func:`startup_summary`), the
    command that prints the full per-worker table (not for a ``custom`` placement, which the
    CLI cannot express), and the partition's stage table without the per-stage unit lists
    (2-3 lines per stage), which ``partition.report()`` gives in full. ``header``: what
    comes first (``schedule="auto"``: how the plan was chosen). ``rows``: every worker's
    numbers, gathered from the ranks (:func:`startup_rows`); None: read off
    every program here.
    """
    command = None if custom else plan_command(plan)
    return "\n".join([
        *([header] if header else []),
        startup_summary(plan, memory.stage_bytes, memory.tie_bytes, command, rows),
        *([memory_lines] if memory_lines else []),
        partition.report(units=False),
        "(the units of each stage: strategy.engine.partition.report() during the run)",
    ])
