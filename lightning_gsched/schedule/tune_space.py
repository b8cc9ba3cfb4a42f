"""The tuner's search space: which (schedule, G, mode, R, S, B, checkpointing) it considers; the
part a user constrains (``gsched tune -s 4 --dp 2``) and the engine must agree with before
anything is planned (it profiles the smallest microbatch: :func:`most_microbatches`).

G: each divisor of W below W, in both modes. A candidate's ``micro`` is B per replica, as ``plan()``
counts it (a step cuts the global batch into B x G microbatches); B takes P, 2P and 4P (P = W / G),
so the step's microbatch counts (W, 2W, 4W) and sizes are the same for every G and one profile
serves them all. Left out unless the user fixes G, as searched under another name: G = W (a
one-worker pipeline in W replicas is ddp or fsdp) and lpp with G > 1 (lpp is itself replicas of an
R-deep loop; tests/test_schedule_tune_dp.py compares the predictions).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from lightning_gsched.errors import GschedError
from lightning_gsched.schedule.arguments import ScheduleArguments
from lightning_gsched.schedule.data_parallel import ALREADY_DATA_PARALLEL, MODES, pipeline_size
from lightning_gsched.schedule.library import LIBRARY, get_schedule
from lightning_gsched.schedule.plan import resolve_arguments


@dataclass(frozen=True)
class Candidate:
    """One configuration: what ``plan()`` is asked for. ``micro``: B per data-parallel replica;
    ``replicas``: G; ``rows``: rows of one microbatch (the global batch / (B x G)); ``cap``: a
    uniform activation cap per worker, None for the schedule's default."""

    schedule: str
    stages: int
    micro: int
    R: int | None
    checkpoint: bool
    rows: int
    cap: int | None = None
    replicas: int = 1
    mode: str = "replicate"

    @property
    def step_micro(self) -> int:
        """Microbatches one step cuts the global batch into: B x G."""
        return self.micro * self.replicas

    def shape_text(self) -> str:
        """Schedule, S, B, R, cap and checkpointing (the table's candidate column)."""
        r = f" R={self.R}" if self.R is not None else ""
        cap = f" cap={self.cap}" if self.cap is not None else ""
        return (f"{self.schedule} S={self.stages} B={self.micro}{r}{cap}"
                + (" ckpt" if self.checkpoint else ""))

    def text(self) -> str:
        """The whole configuration in one line: :meth:`shape_text`, then G and the mode."""
        return self.shape_text() + (f" G={self.replicas} {self.mode}" if self.replicas > 1 else "")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def replica_counts(workers: int, fixed: int | None = None) -> list[int]:
    """The G values searched: each divisor of W below W (1 when W = 1), or the user's ``fixed``."""
    if fixed is not None:
        return [fixed]
    return [G for G in _divisors(workers) if G < workers or G == 1]


def microbatch_counts(workers: int, global_rows: int, micro: int | None = None,
                      replicas: int = 1) -> list[int]:
    """The B values per replica searched at G = ``replicas``: those giving W, 2W and 4W
    microbatches per step that divide the global batch, else the largest step count <= W that
    divides it and that G divides; only the user's ``micro`` (when B x G divides the batch)."""
    G = replicas
    if micro is not None:
        return [micro] if G == 1 or global_rows % (micro * G) == 0 else []
    counts = [T for T in dict.fromkeys((workers, 2 * workers, 4 * workers))
              if global_rows % T == 0]
    if not counts:
        counts = [T for T in _divisors(global_rows) if T <= workers and T % G == 0][-1:]
    return [T // G for T in counts]


def most_microbatches(workers: int, global_rows: int, micro: int | None = None,
                      replicas: int | None = None) -> int:
    """The most microbatches any candidate cuts a step into (B x G): the tuner profiles a
    microbatch of ``global_rows`` / that many rows, the smallest any candidate runs."""
    steps = [B * G for G in replica_counts(workers, replicas)
             for B in microbatch_counts(workers, global_rows, micro, G)]
    return max(steps, default=micro or 1)


def _Rs(name: str, pipeline: int, R: int | None) -> list[int | None]:
    """The R values of a schedule on a P-worker replica: the user's, else the default and the
    divisors of P strictly between 1 and P (R = 1 and R = P are ddp's and gpipe's placements:
    seed, Table 1); none other where the default is one group of all P (interleaved)."""
    spec = get_schedule(name)
    if R is not None:
        return [R]
    if spec.default_R is None:
        return [None]
    default = spec.default_R(pipeline)
    middle = [d for d in _divisors(pipeline) if 1 < d < pipeline]
    return list(dict.fromkeys([default] + (middle if default < pipeline else [])))


def _default_stages(name: str, workers: int, R: int | None, G: int, mode: str) -> int:
    """``plan()``'s default S for this shape; for an R it refuses (the user's, not dividing P),
    the P-worker default, so that the candidate's verdict names the reason."""
    try:
        return resolve_arguments(ScheduleArguments(
            schedule=name, R=R, data_parallel_size=G, data_parallel=mode), workers)[0]
    except GschedError:
        return get_schedule(name).stages(workers // G, R or 1)


def candidates(workers: int, global_rows: int, schedules: Sequence[str] | None = None,
               checkpoint: Sequence[bool] = (False, True), *, stages: int | None = None,
               micro: int | None = None, R: int | None = None,
               replicas: int | None = None) -> list[Candidate]:
    """The search space: every library schedule, at every G in each mode it takes, with its R
    choices on each replica's P workers, its default S for that shape and twice that, each B per
    replica, checkpointing off and on. ``stages``, ``micro``, ``R``, ``replicas``: fixed by the
    user; with R, only the schedules that take one (the looped ones)."""
    if replicas is not None:
        pipeline_size(workers, replicas)  # G divides W, or the error naming the divisors
    out: list[Candidate] = []
    for G in replica_counts(workers, replicas):
        micros = microbatch_counts(workers, global_rows, micro, G)
        for name in schedules or list(LIBRARY):
            if R is not None and get_schedule(name).default_R is None:
                continue
            if G == 1:
                modes: Sequence[str] = ["replicate"]
            elif name in ALREADY_DATA_PARALLEL or (name == "lpp" and replicas is None):
                modes = []  # refused by plan(), or searched already (module docstring)
            else:
                modes = MODES
            for mode in modes:
                for r in _Rs(name, workers // G, R):
                    default_s = _default_stages(name, workers, r, G, mode)
                    Ss = [stages] if stages is not None else [default_s, 2 * default_s]
                    out += [Candidate(name, S, B, r, ckpt, global_rows // (B * G), None, G, mode)
                            for S, B, ckpt in itertools.product(Ss, micros, checkpoint)]
    return out
