"""Named schedules (``gsched plan NAME``, ``GeneralParallel(NAME)``): a placement factory, a
default order and cap, and defaults for S, B and R (workers per looped group) as functions of W."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from lightning_gsched.errors import ScheduleConfigError, UnknownScheduleError
from lightning_gsched.schedule.orders import CapSpec, one_f_one_b_caps
from lightning_gsched.schedule.placements import (
    DDP,
    FSDP,
    FSLPP,
    LPP,
    FSLPPSeed,
    GPipe,
    LibraryPlacement,
    VShape,
)


def _per_worker(workers: int, stages: int) -> int:
    """k = S/W stages per worker: a microbatch in flight stashes k on a worker, so caps scale."""
    return max(1, stages // workers)


def v_half_caps(workers: int, stages: int) -> int:
    """V-Half's activation memory (Qi et al. 2024) in stage-chunks: (S/W)(W+2)/2, rounded down.
    Not the paper's (W+2)//2 microbatches: at odd W that floor is one stage-chunk below what the
    steady state holds, and the greedy scheduler's bubble then grows with B."""
    return (_per_worker(workers, stages) * (workers + 2)) // 2


def v_min_caps(workers: int, stages: int) -> int:
    """V-Min's (Qi et al. 2024): (S/W)(W+4)/3 stage-chunks, rounded down as v_half_caps."""
    return (_per_worker(workers, stages) * (workers + 4)) // 3


def interleaved_caps(workers: int, stages: int) -> int:
    """S + 1 stage-chunks per worker. S is the smallest uniform cap that keeps the uncapped
    latency at equal stage costs (``cap='auto'`` finds it at every shape
    tests/test_schedule_sweep.py checks), but with it the first worker waits for the first
    backward before its next forward, so any stage costlier than the others (a last stage with
    the head and the loss, a first stage with only the embedding) stalls the loop: under stage
    costs drawn within 30% of each other, cap S+1 plans 2-9% shorter steps on average (W=2..8;
    a draw at W=8 can lose up to about 1%: a greedy order is not monotone in its cap;
    tests/test_schedule_sweep.py). One chunk more than S is still at most the
    first rank's peak in Megatron's and torch's order, S + W - 1."""
    return stages + 1


def _even_r(workers: int) -> int:
    """Default R for the looped family: groups of two when W is even, else one group."""
    return 2 if workers % 2 == 0 else workers


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    trade_off: str
    make_placement: Callable[[int, int, int], LibraryPlacement]  # (W, S, R) -> placement
    order: str
    cap: Callable[[int, int], CapSpec] = lambda W, S: None  # (W, S) -> default cap
    stages: Callable[[int, int], int] = lambda W, R: W  # (W, R) -> default S
    micro: Callable[[int, int], int] = lambda W, R: 2 * W  # (W, R) -> default B
    default_R: Callable[[int], int] | None = None  # None: R is not a parameter of this schedule
    split_backward: bool = False  # B then W (zero-bubble schedules)


def _two_w(W: int, R: int) -> int:
    return 2 * W


LIBRARY: dict[str, ScheduleSpec] = {spec.name: spec for spec in [
    ScheduleSpec("ddp", "no transfers except one all-reduce, but every worker holds all weights "
                 "and all activations of its microbatches", lambda W, S, R: DDP(W), "bfs",
                 stages=lambda W, R: 1, micro=lambda W, R: W),
    ScheduleSpec("fsdp", "DDP's latency with one stage per worker at rest; pays a weight fetch "
                 "for every non-owned stage in forward and again in backward",
                 lambda W, S, R: FSDP(W), "bfs", micro=lambda W, R: W),
    ScheduleSpec("gpipe", "weights never move, only activations between neighbours; bubble "
                 "(W-1)/(B+W-1) and each worker stashes all B microbatches",
                 lambda W, S, R: GPipe(W, S), "gpipe"),
    ScheduleSpec("1f1b", "GPipe's placement and latency, but backward-first with a cap: worker "
                 "r stashes at most W-r microbatches instead of B", lambda W, S, R: GPipe(W, S),
                 "1f1b", one_f_one_b_caps),
    ScheduleSpec("lpp", "looped pipeline: G=W/R replicas of an R-deep loop; smaller bubble than "
                 "GPipe, weights replicated G times (all-reduce among replicas)",
                 lambda W, S, R: LPP(W, R), "bfs", stages=lambda W, R: 2 * R, default_R=_even_r),
    ScheduleSpec("interleaved", "one loop over all W workers with S=2W stages in Megatron's "
                 "interleaved 1F1B order: GPipe's bubble divided by S/W, twice the activation "
                 "messages", lambda W, S, R: LPP(W, W), "interleaved", interleaved_caps,
                 stages=_two_w, default_R=lambda W: W),
    ScheduleSpec("fslpp", "LPP's compute with every stage owned once (at most ceil(S/W) per "
                 "worker): weights fetched within groups instead of replicated",
                 lambda W, S, R: FSLPP(W, R), "bfs", default_R=_even_r),
    ScheduleSpec("fslpp-seed", "the seed's literal owner map h(s,s): same traffic pattern as "
                 "fslpp but ownership concentrated on a few workers",
                 lambda W, S, R: FSLPPSeed(W, R), "bfs", default_R=_even_r),
    ScheduleSpec("zb-h1", "1F1B's placement with the backward split into B and W, W filling the "
                 "bubbles: about a third of 1F1B's bubble at the same peak stash (W "
                 "microbatches)", lambda W, S, R: GPipe(W, S), "zb",
                 lambda W, S: _per_worker(W, S) * W, split_backward=True),
    ScheduleSpec("zb-h2", "zb-h1 with 2W-1 microbatches in flight: extra warm-up forwards "
                 "remove the bubble, for about twice zb-h1's activation memory",
                 lambda W, S, R: GPipe(W, S), "zb", lambda W, S: _per_worker(W, S) * (2 * W - 1),
                 split_backward=True),
    ScheduleSpec("zbv", "two stages per worker in a V (worker r holds stages r and 2W-1-r) with "
                 "a split backward: near-zero bubble at 1F1B's activation memory, weights never "
                 "move", lambda W, S, R: VShape(W, S), "zb", lambda W, S: S, stages=_two_w,
                 split_backward=True),
    ScheduleSpec("v-half", "zbv's V with the activation cap at about half of 1F1B's ((W+2)/2 "
                 "microbatches per worker, reserved at a microbatch's first forward there): half "
                 "of 1F1B's bubble (Qi et al. 2024, V-Half)",
                 lambda W, S, R: VShape(W, S, reserves_stash=True), "zb", v_half_caps,
                 stages=_two_w, split_backward=True),
    ScheduleSpec("v-min", "zbv's V with the activation cap at about a third of 1F1B's ((W+4)/3 "
                 "microbatches per worker, reserved): the least memory of the V family; its "
                 "bubble grows with B except at W=2 and 4 (Qi et al. 2024, V-Min, without its "
                 "exact offsets)", lambda W, S, R: VShape(W, S, reserves_stash=True), "zb",
                 v_min_caps, stages=_two_w, split_backward=True),
]}


def get_schedule(name: str) -> ScheduleSpec:
    try:
        return LIBRARY[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(str(name), LIBRARY, n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownScheduleError(
            f"unknown schedule {name!r}{hint} Known schedules: {', '.join(LIBRARY)}; or pass "
            "placement= and priority= callables for a custom schedule") from None


def check_R(spec: ScheduleSpec, R: int | None) -> None:
    """Only looped schedules take an R (here None or a positive int; checked without W)."""
    if spec.default_R is None and R not in (None, 1):
        raise ScheduleConfigError(
            f"{spec.name} has no R parameter (R groups workers of looped schedules: lpp, "
            "interleaved, fslpp, fslpp-seed); drop R")


def resolve_shape(schedule: str, workers: int, stages: int | None, microbatches: int | None,
                  R: int | None) -> tuple[int, int, int | None]:
    """(S, B, R) for a library schedule on ``workers`` ranks, defaults filled in (every front
    end resolves here, so they agree)."""
    spec = get_schedule(schedule)
    check_R(spec, R)
    if spec.default_R is None:
        R = None
    elif R is None:
        R = spec.default_R(workers)
    elif spec.name == "interleaved" and R != workers:
        raise ScheduleConfigError(
            f"interleaved is lpp with a single group (R=W={workers}); got R={R}. Use schedule "
            "'lpp' for several groups")
    if R is not None and workers % R:
        raise ScheduleConfigError(
            f"R={R} does not divide the {workers} devices (num_nodes x devices), W={workers}; "
            f"choose R among {[r for r in range(1, workers + 1) if workers % r == 0]}")
    return (stages if stages is not None else spec.stages(workers, R or 1),
            microbatches if microbatches is not None else spec.micro(workers, R or 1), R)
