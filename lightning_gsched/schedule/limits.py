"""How large a plan the planner builds, refused before any work when it is larger.

``plan()`` simulates every job and builds and checks every rank's program, at about 10-30
microseconds and 1-3 KB per job on one core. A shape far beyond that (``fsdp`` at W=100,000 is
2 x 10^10 jobs) would run for hours and exhaust memory instead of answering.
"""

from __future__ import annotations

from lightning_gsched.errors import PlanTooLargeError

MAX_JOBS = 1 << 24  # 16,777,216 jobs: every library schedule's default shape at W=1024 fits


def check_size(name: str, workers: int, stages: int, micro: int, phases: int) -> None:
    """Refuse a plan of more than :data:`MAX_JOBS` jobs (S x B x phases)."""
    jobs = stages * micro * phases
    if jobs <= MAX_JOBS:
        return
    most = MAX_JOBS // phases
    raise PlanTooLargeError(
        f"{name} with W={workers}, S={stages}, B={micro} is {jobs:,} jobs ({phases} per stage "
        f"and microbatch), more than the {MAX_JOBS:,} a plan may have (the planner builds and "
        f"checks every rank's program, about 1-3 KB and 10-30 us per job). Give fewer stages "
        f"or microbatches so that S x B <= {most:,} (e.g. microbatches="
        f"{max(1, most // stages)} at S={stages}); where a schedule's placement ties S or B to "
        "W (ddp: B a multiple of W; fsdp: S and B; gpipe, 1f1b, zb-*: S; the V schedules: S "
        "a multiple of 2W; lpp, fslpp: S a multiple of R and B of W/R), there may be none at "
        "this W: plan fewer workers (every library schedule's default shape fits up to "
        "W=1024)"
    )
