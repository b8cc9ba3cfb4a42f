"""``gsched``: plan, draw and compare schedules from the command line (no torch needed).

    gsched plan fslpp --workers 4 --stages 4 --microbatches 8 --R 2 --png fslpp.png
    gsched plan 1f1b -w 4 -b 8 --json
    gsched plan fsdp -w 4 --forward-only --programs      # validation/test/predict programs
    gsched plan fsdp -w 2 -s 4 --stage-bytes 3486720,3159040,3159040,3423232   # + bytes held
    gsched plan 1f1b -w 8 --tp 2 --stage-bytes 4096,4096,4096,4096   # 4 workers of 2 ranks
    gsched compare --workers 4 --stages 4 --microbatches 8
    gsched tune examples/gpt.py:tune_target -w 4 --global-batch 32 --budget 12MiB
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

from lightning_gsched.errors import GschedError, ScheduleConfigError
from lightning_gsched.schedule import LIBRARY, Plan, plan, validate
from lightning_gsched.schedule.arguments import CAP_WORDS, ScheduleArguments
from lightning_gsched.schedule.data_parallel import (
    ALREADY_DATA_PARALLEL,
    MODES,
    pipeline_size,
    tensor_parallel_workers,
)
from lightning_gsched.schedule.describe import (
    EVERY_WORKER_HINT,
    MAX_ROWS,
    describe,
    hidden_workers,
    layout_text,
    listed_workers,
    micro_text,
    text_table,
    workers_text,
)
from lightning_gsched.schedule.memory import (
    resident_bytes,
    sharded_fractions,
    tensor_parallel_share,
)
from lightning_gsched.schedule.orders import ORDER_NAMES
from lightning_gsched.schedule.plan import plan_arguments, resolve_arguments
from lightning_gsched.schedule.render import ascii_timeline, save_png
from lightning_gsched.schedule.runtime_costs import DEFAULT_COSTS


def _option(check: Callable[[Any], Any], parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type=``: parse the text, then apply the library's own check of the value.

    Why: ``gsched compare -w 0`` must fail like any argparse error (usage, one line naming the
    option, exit status 2) with the same rule ``plan()`` and ``GeneralParallel`` apply. Text
    that does not parse goes to the check as it is, which refuses it with its usual message.
    """

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            value = text
        try:
            return check(value)
        except GschedError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _numbers(text: str) -> float | list[float]:
    """'2' -> 2.0; '1,1,2,2' -> per-stage list."""
    values = [float(v) for v in text.split(",")]
    return values[0] if len(values) == 1 else values


def _parse_cap(text: str) -> int | str | None | list[int]:
    """'none' -> None (uncapped); 'auto'/'default' stay words; '2' -> 2; '4,3,2,1' -> per worker."""
    if text in ("none", "None"):
        return None
    if text in ("auto", "default"):
        return text
    values = [int(v) for v in text.split(",")]
    return values[0] if len(values) == 1 else values


def _stage_list(text: str) -> list[int]:
    """'0,2' or '0-3,6' -> stage indices (the form the startup summary prints)."""
    stages: list[int] = []
    try:
        for part in text.split(","):
            low, _, high = part.partition("-")
            first, last = int(low), int(high) if high else int(low)
            if first < 0 or last < first:
                raise ValueError(part)
            stages.extend(range(first, last + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--checkpoint-stages {text!r} is not valid: give stage indices >= 0, comma-separated, "
            "with ranges as a-b; e.g. --checkpoint-stages 0,2 or 0-3,6") from None
    return stages


def _checkpoint_activations(args: argparse.Namespace, arguments: ScheduleArguments
                            ) -> bool | list[bool]:
    """``--checkpoint-activations`` or ``--checkpoint-stages`` as plan()'s argument; the
    stages named are checked against the S ``arguments`` resolve to (plan()'s own
    resolution: a replica's default S with ``--dp``)."""
    if args.checkpoint_stages is None:
        return bool(args.checkpoint_activations)
    stages = resolve_arguments(arguments, args.workers)[0]
    beyond = [s for s in args.checkpoint_stages if s >= stages]
    if beyond:
        raise ScheduleConfigError(
            f"--checkpoint-stages names stages {beyond}, but the plan has S={stages} stages "
            f"(0-{stages - 1}); e.g. --checkpoint-stages 0")
    chosen = set(args.checkpoint_stages)
    return [s in chosen for s in range(stages)]


def _tie_group(text: str) -> list[int]:
    """'0,3' -> the stages that read one tied weight (plan() checks them against S)."""
    try:
        stages = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--tie {text!r} is not valid: give the stages that read one tied weight, "
            "comma-separated; e.g. --tie 0,3") from None
    return stages


def _parse_bytes(text: str) -> list[int]:
    """'3486720,3159040' -> per-stage byte counts."""
    return [int(v) for v in text.split(",")]


def _checked_bytes(value: Any) -> list[int]:
    if not isinstance(value, list) or any(v < 0 for v in value):
        raise validate.invalid("stage_bytes", value, "must be one int >= 0 per stage",
                               "3486720,3159040")
    return value


def _checked_sharded(value: Any) -> Any:
    """``--tp-sharded`` as given, once its fractions are checked (their count needs S)."""
    sharded_fractions(value)
    return value


def _checked_cap(cap: Any) -> Any:
    validate.cap_form(cap, CAP_WORDS)
    return cap


def _count(name: str, example: str) -> Callable[[str], Any]:
    return _option(partial(validate.positive_int, name, example=example), int)


def _cost(name: str) -> Callable[[str], Any]:
    return _option(partial(validate.costs, name), _numbers)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-w", "--workers", type=_count("workers", "4"), required=True, help="W: number of workers (ranks)")
    parser.add_argument("-s", "--stages", type=_count("stages", "4"), default=None, help="S: pipeline stages (default: per schedule)")
    parser.add_argument("-b", "--microbatches", type=_count("microbatches", "8"), default=None, help="B: microbatches per step (default: per schedule)")
    parser.add_argument("--R", type=_count("R", "2"), default=None, help="workers per looped group (lpp, fslpp, ...)")
    parser.add_argument("--forward-cost", type=_cost("forward_cost"), default=1.0, help="F duration: one number or one per stage")
    parser.add_argument("--backward-cost", type=_cost("backward_cost"), default=2.0, help="B duration: one number or one per stage (the input-gradient part when W is split off)")
    parser.add_argument("--weight-cost", type=_cost("weight_cost"), default=None, help="W duration (schedules with a split backward: zb-h1, zb-h2, zbv, v-half, v-min); default: half of --backward-cost, the other half going to B")


def data_parallel_options(parser: argparse.ArgumentParser) -> None:
    """``--data-parallel-size``/``--dp`` and ``--data-parallel``: G replicas of the schedule,
    each on P = W / G workers (plan(), GeneralParallel and the configs take the same two)."""
    parser.add_argument("--dp", "--data-parallel-size", dest="data_parallel_size",
                        type=_count("data_parallel_size", "2"), default=1, metavar="G",
                        help="G data-parallel replicas of the schedule, each on P = W / G "
                             "workers (rank p*G + g is pipeline position p of replica g); "
                             "-s, -b, --R and --cap are one replica's. Default 1. Not with "
                             f"{' or '.join(ALREADY_DATA_PARALLEL)} (data parallel already)")
    parser.add_argument("--data-parallel", choices=MODES, default="replicate",
                        help="with --dp G > 1: 'replicate' (each replica holds its stages; one "
                             "gradient all-reduce per stage over its G replicas) or 'shard' "
                             "(each stage owned once across its column of G workers, fetched "
                             "once per step, its gradient reduced to the owner)")


def tensor_parallel_option(parser: argparse.ArgumentParser) -> None:
    """``--tensor-parallel-size``/``--tp``: each worker of the schedule is T ranks sharing its
    stages' layers (plan(), GeneralParallel and the configs take the same T)."""
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tensor_parallel_size",
                        type=_count("tensor_parallel_size", "2"), default=1, metavar="T",
                        help="T tensor-parallel ranks per worker: -w counts ranks, W = P x G x "
                             "T, and the schedule runs on W / T workers (worker w is ranks "
                             "w*T .. w*T+T-1, sharding its stages' layers); every per-worker "
                             "figure is one worker's. Default 1")


def _tensor_parallel_sharded_option(parser: argparse.ArgumentParser) -> None:
    """``--tp-sharded``: what share of ``--stage-bytes`` the worker's T ranks divide."""
    parser.add_argument("--tp-sharded", "--tensor-parallel-sharded",
                        dest="tensor_parallel_sharded", metavar="FRACTION", default=None,
                        type=_option(_checked_sharded, _numbers),
                        help="with --tp T > 1 and --stage-bytes (the unsharded model's): the "
                             "fraction of each stage's parameter bytes the tensor-parallel plan "
                             "shards, one number or one per stage; a rank then holds that part "
                             "/ T plus the rest whole (norms, a row-wise layer's bias, layers "
                             "the plan leaves out). Default 1: a rank holds 1/T of every stage. "
                             "0: nothing divided (--stage-bytes already one rank's shards)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gsched", description="Plan and compare lightning_gsched schedules.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="simulate one schedule; print its metrics and timeline")
    p.add_argument("schedule", help=f"one of: {', '.join(LIBRARY)}")
    _common(p)
    data_parallel_options(p)
    tensor_parallel_option(p)
    p.add_argument("--order", choices=ORDER_NAMES, default=None, help="tie-break order n(s,b,d)")
    p.add_argument("--cap", type=_option(_checked_cap, _parse_cap), default="default", help="activation cap: int, list, 'auto' or 'none'")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object instead of text: the plan's shape, owners, "
                        f"latency and per-worker metrics; up to W={MAX_ROWS} every worker's "
                        "row, timeline slot and program, beyond only the rows the text table "
                        "shows (\"complete\": false), unless --programs is given")
    p.add_argument("--png", metavar="FILE", default=None,
                   help="also draw the timeline to FILE (missing parent folders are created)")
    p.add_argument("--programs", action="store_true",
                   help="also print every rank's program; with --json at any W, every "
                        "worker's row, slot and program (lowers every rank: slow at large W)")
    ckpt = p.add_mutually_exclusive_group()
    ckpt.add_argument("--checkpoint-activations", action="store_true",
                      help="activation checkpointing on every stage: F keeps only the stage's "
                           "inputs, B recomputes the forward (its cost grows by F's)")
    ckpt.add_argument("--checkpoint-stages", metavar="STAGES", type=_stage_list, default=None,
                      help="activation checkpointing on these stages only, e.g. 0,2 or 0-3,6")
    p.add_argument("--split-backward", action=argparse.BooleanOptionalAction, default=None,
                   help="split every backward into B and W (default: the schedule's: on for "
                        "zb-h1, zb-h2, zbv, v-half, v-min), as GeneralParallel(split_backward=)")
    p.add_argument("--fetch-window", type=_count("fetch_window", "1"), default=None,
                   help="most fetched stages a worker holds at once (default: no limit; the "
                        "one-compute-early prefetch holds at most 2)")
    p.add_argument("--tie", metavar="STAGES", type=_tie_group, action="append", default=None,
                   help="stages that read one tied weight (e.g. 0,3: a tied embedding and "
                   "head); repeatable. The tie is owned with its lowest stage and fetched by "
                   "the workers computing the others")
    p.add_argument("--stage-bytes", type=_option(_checked_bytes, _parse_bytes), default=None,
                   help="every stage's parameter bytes, comma-separated: adds each worker's "
                        "owned bytes and the peak of owned + fetched bytes its program implies "
                        "(with --tp T > 1: one rank's share, see --tp-sharded)")
    _tensor_parallel_sharded_option(p)
    p.add_argument("--forward-only", action="store_true",
                   help="plan forward jobs only (validate/test/predict); same owners as training, "
                        "the cap is ignored")
    c = sub.add_parser("compare", help="the seed's Table 1 with numbers, every library schedule side by side")
    _common(c)
    data_parallel_options(c)
    tensor_parallel_option(c)
    c.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    _tune_parser(sub)
    k = sub.add_parser("consolidate", help="write a sharded checkpoint directory as one full "
                                           ".ckpt file, for plain Lightning or torch.load")
    k.add_argument("directory", help="the directory state_dict_type='sharded' wrote")
    k.add_argument("out", help="the file to write (replaced if it exists)")
    return parser


def _tune_parser(sub: Any) -> None:
    t = sub.add_parser("tune", help="profile a model and rank schedule x data-parallel G and "
                                    "mode x S x B x R x cap x checkpointing by predicted step "
                                    "time within a memory budget")
    t.add_argument("target", help="FILE.py:FUNCTION or MODULE:FUNCTION returning (model, args) or "
                                  "(model, args, loss_fn): the model and one microbatch")
    t.add_argument("-w", "--workers", type=_count("workers", "4"), required=True)
    t.add_argument("--global-batch", type=_count("global_batch", "32"), required=True,
                   help="rows of one optimizer step over all workers")
    t.add_argument("--budget", type=_option(partial(validate.byte_size, "memory_budget"), str),
                   default=None, help="bytes per rank, e.g. 20GiB or 512MiB (default: none)")
    t.add_argument("--optimizer-factor",
                   type=_option(partial(validate.non_negative_number, "optimizer_factor",
                                        example="2"), float), default=2.0,
                   help="optimizer state per parameter byte: 2 Adam (default), 1 SGD+momentum")
    t.add_argument("--schedules", nargs="*", default=None, choices=sorted(LIBRARY),
                   metavar="SCHEDULE", help="only these library schedules")
    t.add_argument("--no-checkpointing", action="store_true",
                   help="do not try activation checkpointing")
    t.add_argument("-s", "--stages", type=_count("stages", "4"), default=None,
                   help="only this S (as GeneralParallel('auto', stages=...))")
    t.add_argument("-b", "--microbatches", type=_count("microbatches", "8"), default=None,
                   help="only this B (per data-parallel replica)")
    t.add_argument("--R", type=_count("R", "2"), default=None,
                   help="only the looped schedules, with this R")
    t.add_argument("--data-parallel-size", "--dp", dest="data_parallel_size",
                   type=_count("data_parallel_size", "2"), default=None,
                   help="only this G: G replicas of each schedule on W/G workers, both modes "
                        "(as GeneralParallel('auto', data_parallel_size=...)); default: every "
                        "divisor of W below W")
    t.add_argument("--tp", "--tensor-parallel-size", dest="tensor_parallel_size", nargs="+",
                   type=_count("tensor_parallel_size", "2"), default=[1], metavar="T",
                   help="T ranks per worker (-w counts ranks: W / T workers); each T > 1 is "
                        "profiled sharded by --tp-plan in T processes on this host. Several "
                        "(e.g. --tp 1 2 4): each tuned, then the fastest fitting over all")
    t.add_argument("--tp-plan", "--tensor-parallel-plan", dest="tensor_parallel_plan",
                   default=None, metavar="PLAN",
                   help="with --tp T > 1: how a stage is sharded, as tensor_parallel_plan: JSON "
                        "('{\"blocks.*.attn.q\": \"colwise\", ...}') or FILE.py:NAME (a dict "
                        "of styles, or a function parallelize(stage_module, tp_mesh))")
    t.add_argument("--leaf-modules", dest="leaf_modules", nargs="+", default=[],
                   metavar="NAME",
                   help="module class names or names the split keeps whole, as "
                        "GeneralParallel(leaf_modules=...); a dict plan's styled modules and "
                        "their holders are kept whole already (a function plan's are not "
                        "known: name them here)")
    d = DEFAULT_COSTS
    t.add_argument("--latency", type=float, default=None,
                   help=f"seconds a message is in flight besides its bytes (default {d.latency:g})")
    t.add_argument("--bandwidth", type=float, default=None,
                   help=f"bytes per second per link (default {d.bandwidth:g})")
    t.add_argument("--message-cpu", type=float, default=None,
                   help=f"CPU seconds per message on each end, sender and receiver (default "
                        f"{d.send_cpu:g} / {d.recv_cpu:g})")
    t.add_argument("--job-overhead", type=float, default=None,
                   help=f"the runtime's seconds per compute job beyond the profiled compute "
                        f"(default {d.job_cpu:g})")
    t.add_argument("--top", type=_count("top", "20"), default=20,
                   help="rows of the table: the fastest that fit, ranked exactly (the search "
                        "skips candidates whose lower bounds rule them out)")


def compare_rows(workers: int, stages: int | None, micro: int | None, R: int | None,
                 forward_cost: float | Sequence[float], backward_cost: float | Sequence[float],
                 weight_cost: float | Sequence[float] | None = None,
                 data_parallel_size: int = 1,
                 data_parallel: str = "replicate",
                 tensor_parallel_size: int = 1) -> list[dict[str, Any]]:
    """One row per library schedule (``gsched compare``), or ``{"schedule", "error"}`` where
    the sizes do not fit it, or ``{"schedule", "skipped"}`` for ddp and fsdp with
    ``data_parallel_size`` > 1 (data parallel over every rank already: nothing to compose).
    ``workers`` counts ranks; with ``tensor_parallel_size`` T each row is the plan of W / T
    workers (:func:`~lightning_gsched.schedule.plan`'s rule)."""
    rows: list[dict[str, Any]] = []
    for name in LIBRARY:
        if data_parallel_size > 1 and name in ALREADY_DATA_PARALLEL:
            rows.append({"schedule": name, "skipped": "data parallel over all W ranks already"})
            continue
        try:
            uses_R = LIBRARY[name].default_R is not None
            split = LIBRARY[name].split_backward
            result = plan(name, workers=workers, stages=stages, microbatches=micro,
                          R=R if uses_R and name != "interleaved" else None,
                          forward_cost=forward_cost, backward_cost=backward_cost,
                          weight_cost=weight_cost if split else None,
                          data_parallel_size=data_parallel_size, data_parallel=data_parallel,
                          tensor_parallel_size=tensor_parallel_size,
                          # a table of the plans' figures: the dry run that proves each runs
                          # is `gsched plan`'s (it doubled compare's time at W=256)
                          verify=False)
        except GschedError as exc:
            rows.append({"schedule": name, "error": str(exc)})
            continue
        m = result.metrics
        rows.append({
            "schedule": name, "stages": result.stages, "microbatches": result.micro, "R": result.R,
            "latency": m.latency, "bubble_fraction": m.bubble_fraction,
            "activation_msgs_per_worker": m.max_of("activation_recvs") + m.max_of("input_grad_recvs"),
            "weight_fetches_per_worker": m.max_of("weight_fetches"),
            "grad_sends_per_worker": m.max_of("grad_sends"),
            "activation_storage_per_worker": m.max_of("peak_activations"),
            "weight_storage_per_worker": m.max_of("peak_resident_stages"),
            "owned_stages_max": m.max_of("owned_stages"),
        })
    return rows


def _compare_workers(workers: int, data_parallel_size: int, data_parallel: str,
                     tensor_parallel_size: int = 1) -> str:
    """``W=8``, or ``W=8 (P=4 x G=2, replicate)``: the head of ``gsched compare``'s table
    (:func:`~lightning_gsched.schedule.describe.layout_text`, as ``gsched plan`` writes it)."""
    head = layout_text(workers, data_parallel_size, data_parallel, tensor_parallel_size)
    return head + ("; B counts every replica's microbatches" if data_parallel_size > 1 else "")


def _compare_text(rows: list[dict[str, Any]], head: str) -> str:
    header = ["scheme", "S", "B", "R", "latency", "bubble", "act msgs/w", "w fetches/w",
              "g reduces/w", "act store/w", "w store/w", "owned max"]
    table, errors, skipped = [], [], []
    for r in rows:
        if "error" in r:
            errors.append(f"  {r['schedule']}: {r['error']}")
            continue
        if "skipped" in r:
            skipped.append(r["schedule"])
            continue
        table.append([r["schedule"], r["stages"], r["microbatches"], r["R"] if r["R"] is not None else "-",
                      f"{r['latency']:g}", f"{r['bubble_fraction']:.1%}",
                      r["activation_msgs_per_worker"], r["weight_fetches_per_worker"],
                      r["grad_sends_per_worker"], r["activation_storage_per_worker"],
                      r["weight_storage_per_worker"], r["owned_stages_max"]])
    text = (f"{head}; per-worker columns are the maximum over workers; storage counts "
            "microbatch-stages (activations) and stages (weights)\n" + text_table(table, header))
    if errors:
        text += "\nnot valid for these sizes:\n" + "\n".join(errors)
    if skipped:
        text += (f"\nnot run with --dp > 1: {', '.join(skipped)} (data parallel over all W "
                 "ranks already; compare them with --dp 1)")
    return text


def _write_png(result: Plan, path: str) -> bool:
    """Draw the plan to ``path``, creating missing parent folders as ``mkdir -p`` would.

    A path that still cannot be written (a file where a folder should be, no permission) or a
    missing matplotlib is one line on stderr, not a traceback; returns False then.
    """
    title = (f"{result.schedule}: {workers_text(result)} S={result.stages} "
             f"{micro_text(result)}"
             + (" (forward only)" if result.forward_only else ""))
    if path.endswith(("/", os.sep)) or Path(path).is_dir():
        print(f"gsched: error: --png {path}: a folder, not a file; give the picture's file "
              f"name, e.g. --png {Path(path) / 'plan.png'}", file=sys.stderr)
        return False
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_png(result.timeline, path, title)
    except ImportError as exc:
        print(f"gsched: error: --png needs matplotlib ({exc}); pip install matplotlib",
              file=sys.stderr)
        return False
    except OSError as exc:
        print(f"gsched: error: --png {path}: cannot write it ({exc.strerror or exc}); give a "
              "path in a writable folder", file=sys.stderr)
        return False
    return True


def _schedule_arguments(args: argparse.Namespace) -> ScheduleArguments:
    """``gsched plan``'s options as the one arguments type (options named as its fields)."""
    given = {name: getattr(args, name) for name in ScheduleArguments.names()
             if name not in ("checkpoint_activations", "ties") and hasattr(args, name)}
    arguments = ScheduleArguments(**given, ties=args.tie)
    return arguments.replace(checkpoint_activations=_checkpoint_activations(args, arguments))


def _rank_bytes(result: Plan, args: argparse.Namespace) -> list[int] | None:
    """``--stage-bytes`` as one rank holds them: with ``--tp`` T > 1 its share of the worker's
    stages (:func:`~lightning_gsched.schedule.memory.tensor_parallel_share`), else as given.
    The one place the CLI's per-stage parameter bytes enter the bytes model."""
    given: list[int] | None = args.stage_bytes
    sharded = args.tensor_parallel_sharded
    if sharded is not None and (result.tensor_parallel_size == 1 or given is None):
        raise ScheduleConfigError(
            "--tp-sharded says what share of --stage-bytes a worker's T ranks divide, so it "
            "needs --tp T > 1 and --stage-bytes; give both, or drop --tp-sharded")
    if given is None:
        return None
    # the plan's S, which data-parallel sharding may have raised from the one asked for (and
    # before tensor_parallel_share counts --tp-sharded by it)
    if len(given) != result.stages:
        raise ScheduleConfigError(
            f"--stage-bytes has {len(given)} values but the plan has S={result.stages} "
            "stages: give one byte count per stage")
    if result.tensor_parallel_size == 1:
        return given
    return tensor_parallel_share(given, result.tensor_parallel_size,
                                 1.0 if sharded is None else sharded)


def _rank_bytes_note(result: Plan, args: argparse.Namespace) -> str | None:
    """With T > 1, the line saying the byte columns are one rank's share (None: as given)."""
    T = result.tensor_parallel_size
    if T == 1 or args.stage_bytes is None:
        return None
    sharded = args.tensor_parallel_sharded
    if sharded is None or sharded == 1.0:
        return (f"bytes are one rank's: each of a worker's T={T} ranks holds 1/{T} of every "
                "stage's --stage-bytes (given for the unsharded model; --tp-sharded sets the "
                "part divided)")
    return (f"bytes are one rank's: each of a worker's T={T} ranks holds the sharded part "
            f"(--tp-sharded {_fraction_text(sharded)}) of every stage's --stage-bytes / {T}, "
            "plus the rest whole (--stage-bytes given for the unsharded model)")


def _fraction_text(sharded: float | list[float]) -> str:
    """``0.9`` or ``1,0.5,1``: ``--tp-sharded`` as given."""
    return ",".join(f"{v:g}" for v in sharded) if isinstance(sharded, list) else f"{sharded:g}"


def _plan_json(result: Plan, stage_bytes: list[int] | None, every: bool) -> dict[str, Any]:
    """``gsched plan --json``: the plan's JSON, with ``--stage-bytes`` each listed worker's
    owned and peak resident bytes added to its row (with ``--tp`` T > 1 one rank's share,
    which the caller puts in ``stage_bytes_per_rank``).

    Up to :data:`MAX_ROWS` workers, or with ``every`` (``--programs``), every worker's row,
    slot and program; beyond, the rows the text table shows, each read off its own program,
    and a note naming what is left out. Why: the rest costs every rank's lowering (over a
    minute at W=1024) and millions of slots, while the answer's head reads neither.
    """
    listed = None if every else listed_workers(result.workers)
    out = result.to_json(listed)
    if listed is not None:
        out["omitted"] = (f"the rows of workers {hidden_workers(result.workers)}, the timeline "
                          f"and the programs (W > {MAX_ROWS}): {EVERY_WORKER_HINT}; it "
                          "lowers every rank, slow at large W")
    if stage_bytes is not None:
        ranks = [row["worker"] for row in out["per_worker"]]
        held = resident_bytes(result.programs, stage_bytes, ranks=ranks)
        for row, h in zip(out["per_worker"], held, strict=True):
            row.update(owned_bytes=h.owned, peak_resident_bytes=h.peak)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "plan":
            result = plan_arguments(_schedule_arguments(args), args.workers,
                                    forward_only=args.forward_only)
            stage_bytes = _rank_bytes(result, args)
            # JSON and text list the same rows beyond MAX_ROWS workers; --programs: every one
            text = None if args.json else describe(result, stage_bytes,
                                                   bytes_note=_rank_bytes_note(result, args))
            out = _plan_json(result, stage_bytes, args.programs) if args.json else None
            if out is not None and stage_bytes is not None and result.tensor_parallel_size > 1:
                out.update(stage_bytes=args.stage_bytes, stage_bytes_per_rank=stage_bytes)
            if args.png and not _write_png(result, args.png):
                return 2
            if out is not None:
                print(json.dumps(out))
            else:
                print(text)
                print()
                print(ascii_timeline(result.timeline))
                if args.programs:
                    print()
                    print(result.programs.text())
                if args.png:
                    print(f"wrote {args.png}")
        elif args.command == "tune":
            from lightning_gsched.cli_tune import tune_command

            return tune_command(args)
        elif args.command == "consolidate":  # torch and the engine only for this command
            from lightning_gsched.engine.checkpoint_sharded import consolidate

            written = consolidate(args.directory, args.out)
            print(f"wrote {args.out}, a full checkpoint with the keys {sorted(written)}")
        else:
            # one error for all rows where T or G does not divide W (each row would repeat it)
            pipeline_size(tensor_parallel_workers(args.workers, args.tensor_parallel_size),
                          args.data_parallel_size)
            rows = compare_rows(args.workers, args.stages, args.microbatches, args.R,
                                args.forward_cost, args.backward_cost, args.weight_cost,
                                args.data_parallel_size, args.data_parallel,
                                args.tensor_parallel_size)
            head = _compare_workers(args.workers, args.data_parallel_size, args.data_parallel,
                                    args.tensor_parallel_size)
            print(json.dumps(rows) if args.json else _compare_text(rows, head))
    except GschedError as exc:
        print(f"gsched: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader left early (`gsched plan ... | head`): as other Unix tools, stop quietly.
        # stdout is pointed at devnull so the interpreter's final flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
