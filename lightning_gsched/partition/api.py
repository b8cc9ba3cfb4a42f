"""``partition()``: trace, measure, cut and build the stages; ``Partition``: the result.

Every rank of a job calls :func:`partition` on its own copy of the model and must get the same
split: tracing and the ``"params"`` costs are deterministic, and so is the DP; for ``"time"``
rank 0's ``part.unit_costs`` must be passed to the other ranks' calls as ``unit_costs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Sequence

import torch.fx as fx
from torch import nn

from lightning_gsched.partition import arguments
from lightning_gsched.partition.balance_check import warn_if_unbalanced
from lightning_gsched.partition.costs import TimeProfiler, parameter_costs
from lightning_gsched.partition.cuts import (
    CutPlan,
    balanced_cuts,
    check_stage_count,
    cuts_from_sizes,
    cuts_from_split_points,
)
from lightning_gsched.partition.errors import BalanceError, PartitionError
from lightning_gsched.partition.execute import run_example
from lightning_gsched.partition.meta_run import (
    has_meta_parameters,
    keeps_meta_values,
    traced_without_weights,
)
from lightning_gsched.partition.report import format_report
from lightning_gsched.partition.stage import StageModule, build_stages
from lightning_gsched.partition.tracer import TracedModel, trace_model
from lightning_gsched.partition.units import (
    UnitTable,
    canonical_buffer_names,
    canonical_parameter_names,
)
from lightning_gsched.partition.verify import Verdict, check_verify, verify_split
from lightning_gsched.schedule import validate

BALANCE_MODES = arguments.BALANCE_MODES
DEFAULT_TOLERANCE = 0.1


class Partition:
    """The stages of a module and what the runtime needs to know about them.

    Attributes (all indexed by stage where they are lists):
        stages: the :class:`StageModule` s, ``len == num_stages``.
        shared_parameters: ``{canonical fqn: sorted stage indices}`` for parameters read by more
            than one stage (tied weights): fetch them for each stage and sum their gradients.
        parameter_stages: the same for every parameter the forward reads.
        stage_of_parameter: ``{canonical fqn: first stage that reads it}``.
        stage_parameter_names / stage_buffer_names: canonical FQNs each stage reads, in
            ``module.named_parameters()`` order. (A stage's own ``named_parameters()`` yields the
            path it reaches a tensor by, which for a tied alias such as ``head.weight`` is the
            alias; :meth:`canonical_name` maps tensors to canonical names.)
        unused_parameters: parameters no stage reads (their gradient stays ``None``).
        unit_names / stage_units: the cuttable units, all and per stage.
        unit_costs / stage_costs / cost_unit: per-unit and per-stage estimated cost and its unit
            (``"params"``: parameter elements read; ``"ns"``: profiled forward+backward time).
        stage_param_counts: distinct parameter elements per stage.
        boundary_names / boundary_bytes: values handed from stage k to k+1 and their size on
            the example input.
        auto_leaf_modules: ``{fqn: reason}`` for submodules the tracer could not enter.
        trace_attempts: how each tracing mode tried ended, in order (see docs/partition.md).
        static_shapes: ``None``, or the input shapes every call must have (static-shape trace).
        mode_dependent: ``None``, or why the traced code differs between train() and eval().
        graph_per_mode: with ``mode_dependent``, whether every stage holds a graph per mode
            (else the stages run in the traced mode only; see docs/partition.md).
        verified: what ``verify`` did (passed, or skipped and why; a mismatch raised).
        fixed_keywords: keyword arguments every call is traced with although the example
            omits them: ``{"use_cache": False}`` for a forward with a cache (:mod:`.cache_off`).
        cache_off_modules: submodules whose calls omit ``use_cache``, traced as if with False.
    """

    def __init__(
        self,
        module: nn.Module,
        table: UnitTable,
        plan: CutPlan,
        stages: list[StageModule],
        unit_costs: list[float],
        cost_unit: str,
        value_bytes: dict[fx.Node, int],
        balance: Any,
    ) -> None:
        self.module = module
        self.stages = stages
        self.num_stages = len(stages)
        self.cuts = plan.cuts
        self.split_method = plan.how
        self.balance = balance
        self.best_bottleneck = plan.best_bottleneck
        bounds = [0, *plan.cuts, len(table)]
        self.unit_names = [u.name for u in table.units]
        # in-place changes a cut puts in a later stage than their value (the receiving stage
        # changes its own copy: right unless a view of the value crosses the cut too)
        self.separated_changes = [
            f"unit {unit.name!r} changes {value!r} across the cut before "
            f"{self.unit_names[cut]!r}"
            for cut in plan.cuts for unit, value in table.mutations_across(cut)]
        self.stage_units = [self.unit_names[a:b] for a, b in pairwise(bounds)]
        self.unit_costs = list(unit_costs)
        self.cost_unit = cost_unit
        self.stage_costs = [sum(self.unit_costs[a:b]) for a, b in pairwise(bounds)]
        self.auto_leaf_modules = dict(table.traced.auto_leaves)
        self.trace_attempts = list(table.traced.attempts)  # how each tracing mode ended
        self.mode_dependent = table.traced.mode_dependent
        # mode-dependent code: True when every stage holds a train and an eval graph
        self.graph_per_mode = bool(self.mode_dependent) and all(
            s.has_graph_per_mode for s in stages)
        self.static_shapes = table.traced.inputs.static_shapes  # None unless sizes are baked in
        # keywords every call is traced with although it omits them (use_cache=False)
        self.fixed_keywords = dict(table.traced.inputs.fixed_keywords)
        # submodules whose calls leave use_cache out, traced as if they passed False (cache_off)
        self.cache_off_modules = list(table.traced.cache_off)
        self.boundary_names = [list(s.output_names) for s in stages[:-1]]
        self.boundary_bytes = [
            sum(value_bytes.get(v, 0) for v in table.live_at(cut)) for cut in plan.cuts
        ]
        self._describe = [u.describe() for u in table.units]
        # top-level module invocation each unit runs in (None: code of the root forward)
        self._groups = [u.scope[0] if u.scope else None for u in table.units]
        self._index_stage_tensors()
        self.verified: Verdict | None = None  # set by partition(): what verify did

    def _index_stage_tensors(self) -> None:
        param_names = canonical_parameter_names(self.module)
        buffer_names = canonical_buffer_names(self.module)
        order = {name: i for i, name in enumerate(param_names.values())}
        border = {name: i for i, name in enumerate(buffer_names.values())}
        self._canonical = {**buffer_names, **param_names}
        self.stage_parameter_names: list[list[str]] = []
        self.stage_buffer_names: list[list[str]] = []
        self.stage_param_counts: list[int] = []
        self.parameter_stages: dict[str, list[int]] = {}
        for index, stage in enumerate(self.stages):
            params = {id(p): p for p in stage.parameters() if id(p) in param_names}
            names = sorted((param_names[i] for i in params), key=order.__getitem__)
            self.stage_parameter_names.append(names)
            self.stage_param_counts.append(sum(p.numel() for p in params.values()))
            buffers = {id(b) for b in stage.buffers() if id(b) in buffer_names}
            self.stage_buffer_names.append(
                sorted((buffer_names[i] for i in buffers), key=border.__getitem__)
            )
            for name in names:
                self.parameter_stages.setdefault(name, []).append(index)
        self.parameter_stages = dict(
            sorted(self.parameter_stages.items(), key=lambda item: order[item[0]])
        )
        self.shared_parameters = {n: s for n, s in self.parameter_stages.items() if len(s) > 1}
        self.stage_of_parameter = {n: s[0] for n, s in self.parameter_stages.items()}
        self.unused_parameters = [
            n for n in param_names.values() if n not in self.parameter_stages
        ]

    def canonical_name(self, tensor: Any) -> str:
        """The canonical FQN (first name in the original module) of a parameter or buffer."""
        try:
            return self._canonical[id(tensor)]
        except KeyError:
            raise KeyError("not a parameter or buffer of the partitioned module") from None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run all stages in sequence on this process: same result as ``module(*args, **kwargs)``."""
        carried = self.stages[0](*args, **kwargs)
        for stage in self.stages[1:]:
            carried = stage(carried)
        return carried

    def __len__(self) -> int:
        return self.num_stages

    def report(self, verbose: bool = False, units: bool = True) -> str:
        """A table of the stages (units, parameters, estimated cost, hand-over) and their nodes.

        Nodes are listed per stage with runs of units inside one top-level module folded into
        ``blocks.0 (38 units)``; ``verbose=True`` lists every unit as ``name = target(...)``;
        ``units=False`` leaves the lists out (the table and notes only).
        """
        return format_report(self, self._describe, None if verbose else self._groups, units)

    def __str__(self) -> str:
        return self.report()

    def __repr__(self) -> str:
        return (
            f"Partition({type(self.module).__name__}, num_stages={self.num_stages}, "
            f"units={[len(u) for u in self.stage_units]})"
        )


@dataclass
class _Traced:
    """A trace, its units, their costs and the bytes of every value (one example run)."""

    traced: TracedModel
    table: UnitTable
    costs: list[float]
    cost_unit: str
    value_bytes: dict[fx.Node, int]


def _keeps_meta_values(result: _Traced) -> bool:
    """Whether a trace on meta tensors kept what needs values (partition/meta_run.py)."""
    other = result.traced.other_mode_graph
    nodes = [*result.traced.graph.nodes, *(other.nodes if other is not None else ())]
    return keeps_meta_values(nodes, result.traced.constants)


def _costs(
    table: UnitTable, balance: Any, unit_costs: Sequence[float] | None, args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[list[float], str, dict[fx.Node, int]]:
    """(unit costs, their unit, bytes of every value) — runs the example once."""
    profiler = TimeProfiler(len(table)) if balance == "time" and unit_costs is None else None
    value_bytes = run_example(table, args, kwargs, hook=profiler)
    given = arguments.check_unit_costs(unit_costs, len(table))
    if given is not None:
        return given, "ns" if balance == "time" else "given", value_bytes
    if profiler is not None:
        return list(profiler.costs), "ns", value_bytes
    return list(parameter_costs(table.units)), "params", value_bytes


def partition(
    module: nn.Module,
    num_stages: int,
    example_args: Sequence[Any] = (),
    example_kwargs: dict[str, Any] | None = None,
    balance: str | Sequence[int] = "params",
    leaf_modules: Sequence[type | str] = (),
    split_points: Sequence[str] | None = None,
    *,
    unit_costs: Sequence[float] | None = None,
    balance_tolerance: float = DEFAULT_TOLERANCE,
    auto_leaf: bool = True,
    static_shapes: bool | None = None,
    verify: str | bool = "auto",
) -> Partition:
    """Split ``module`` into ``num_stages`` stages that together compute ``module(*args, **kwargs)``.

    Args:
        module: any nn.Module (a LightningModule too) whose ``forward`` torch.fx can trace.
        num_stages: number of contiguous stages.
        example_args, example_kwargs: one call of ``forward``. Tensors become stage-0 inputs;
            plain values (ints, flags, ``None``) are fixed at trace time, so calls must repeat them.
        balance: ``"params"`` (parameter elements per stage), ``"time"`` (profiled
            forward+backward) or an explicit list of unit counts per stage.
        leaf_modules: module classes, class names or FQNs the tracer keeps whole (never cut).
        split_points: ``num_stages - 1`` module FQNs (or unit names) to cut before.
        unit_costs: per-unit costs to use instead of measuring (``part.unit_costs`` of rank 0).
        balance_tolerance: accept stages up to this fraction costlier than the optimum to cut
            between blocks and where less data crosses.
        auto_leaf: make submodules whose forward cannot be traced leaves instead of failing.
        static_shapes: ``None`` (default) traces symbolically and, if that fails or keeps a
            submodule whole that holds more than 1.5x an even share of the parameters, again
            with the example's sizes baked in (then calls must use the same input shapes);
            ``True``/``False`` force or forbid that. A split left degenerate by such a
            submodule warns (``UnbalancedPartitionWarning``).
        verify: run the split (stage by stage, through copies, as a pipeline does) and the
            model once on the example and compare outputs and gradients; a difference raises
            ``SplitMismatchError`` naming the first stage that differs. ``"auto"`` (default)
            checks models with real parameters up to 1 GiB, ``True`` always, ``False`` never
            (:mod:`.verify`; ``part.verified`` says what was done).
    """
    if not isinstance(module, nn.Module):
        raise PartitionError(
            f"module={type(module).__name__} is not valid: partition() splits an nn.Module (a "
            "LightningModule too); e.g. partition(model, 2, (x,))"
        )
    num_stages = arguments.check_num_stages(num_stages)
    args, kwargs = arguments.check_example(example_args, example_kwargs)
    balance, leaf_modules, split_points, static_shapes = arguments.check_options(
        balance, leaf_modules, split_points, static_shapes, num_stages)
    arguments.check_unit_costs(unit_costs)
    balance_tolerance = validate.non_negative_number(
        "balance_tolerance", balance_tolerance, str(DEFAULT_TOLERANCE), BalanceError)
    auto_leaf = validate.flag("auto_leaf", auto_leaf, PartitionError)
    verify = check_verify(verify)
    # a model built without weights (parameters on meta): traced as meta_run.py says
    deferred = has_meta_parameters(module)
    if deferred and balance == "time" and unit_costs is None:
        raise BalanceError(
            f"balance='time' times every unit on the example, but {type(module).__name__} has "
            "no weights yet (its parameters are on the meta device: deferred initialisation). "
            "Use balance='params', or build the model with its weights."
        )
    def trace_and_size(run_args: tuple[Any, ...], run_kwargs: dict[str, Any]) -> _Traced:
        traced = trace_model(
            module, run_args, run_kwargs, leaf_modules, auto_leaf=auto_leaf,
            static_shapes=static_shapes, num_stages=num_stages,
        )
        table = UnitTable(traced)
        check_stage_count(num_stages, table, module)
        return _Traced(traced, table, *_costs(table, balance, unit_costs, run_args, run_kwargs))

    result = (traced_without_weights(module, args, kwargs, trace_and_size, _keeps_meta_values)
              if deferred else trace_and_size(args, kwargs))
    table, costs, value_bytes = result.table, result.costs, result.value_bytes
    if split_points is not None:
        plan = cuts_from_split_points(split_points, table, module)
    elif not isinstance(balance, str):
        plan = cuts_from_sizes(balance, len(table))
    else:
        plan = balanced_cuts(costs, num_stages, table, value_bytes, balance_tolerance)
    stages = build_stages(table, plan.cuts)
    part = Partition(module, table, plan, stages, costs, result.cost_unit, value_bytes, balance)
    warn_if_unbalanced(table, part.split_method, part.stage_param_counts)
    part.verified = verify_split(part, args, kwargs, verify)
    return part
