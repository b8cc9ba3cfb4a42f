"""One pipeline stage: a slice of the traced graph plus the original modules it runs.

Stage-boundary contract (what the runtime relies on):

* stage 0 is called like the original module: ``stages[0](*args, **kwargs)``;
* stage ``k > 0`` is called with ONE positional argument, the tuple stage ``k - 1`` returned:
  ``stages[k](carried)``;
* every stage but the last returns a ``tuple`` of the values live at its end boundary (tensors,
  ints, shapes, ``None``... anything the graph computed), in the order of
  ``stage.output_names``; values only passed through are returned as the very same objects;
* the last stage returns exactly what ``module.forward`` returns (any pytree).

Parameter names: the stage owns a shallow tree of fresh container modules that mirrors the
original hierarchy down to the modules and tensors it actually uses, which are the ORIGINAL
objects (no copies). So ``stage.named_parameters()`` / ``named_buffers()`` / ``state_dict()``
use the original fully qualified names (e.g. ``blocks.0.attn.qkv.weight``) and ``is`` the
original parameters; buffers keep their persistence.

Models whose traced code reads ``self.training`` (dropout flags in transformers' models, for
example) trace to different graphs in train and eval mode. Such a stage holds one graph per
mode, cut at the same unit boundaries, and :meth:`StageModule.forward` runs the graph of the
mode its traced modules are in, as the original module would (see :func:`_other_mode_slices`).
Where the other mode cannot be cut the same way, the stage keeps one graph and refuses the
other mode with a :class:`ModeMismatchError` that says why.
"""

from __future__ import annotations

import linecache
from dataclasses import replace
from typing import Any, Sequence

import torch.fx as fx
from torch import nn

from lightning_gsched.partition.errors import ModeMismatchError, PartitionError, StageInputError
from lightning_gsched.partition.layout import InputLayout, OutputLayout
from lightning_gsched.partition.recording import mutated_value, writable_copy
from lightning_gsched.partition.tracer import TracedModel, target_name
from lightning_gsched.partition.units import UnitTable


class StageModule(nn.Module):
    """Runs units ``[start, stop)`` of the traced graph; see the module docstring for the contract."""

    def __init__(
        self,
        index: int,
        num_stages: int,
        graph: fx.Graph,
        owner: str,
        inputs: InputLayout | None,
        outputs: OutputLayout | None,
        mode_watch: list[tuple[nn.Module, bool]] | None,
        mode_reason: str | None,
        other_mode_graph: fx.Graph | None = None,
    ) -> None:
        super().__init__()
        self.stage_index = index
        self.num_stages = num_stages
        self.input_names: tuple[str, ...] = tuple(
            n.name for n in graph.nodes if n.op == "placeholder"
        )
        out = next(n for n in graph.nodes if n.op == "output")
        self.output_names: tuple[str, ...] = tuple(
            str(a) for a in (out.args[0] if isinstance(out.args[0], (tuple, list)) else ())
        )
        self._gsched_owner = owner
        self._gsched_graph = graph
        self._gsched_inputs = inputs
        self._gsched_outputs = outputs
        self._gsched_mode_watch = mode_watch
        self._gsched_mode_reason = mode_reason
        # training flag -> graph: the traced mode's, and the other mode's when it could be cut
        # at the same boundaries
        traced_training = mode_watch[0][1] if mode_watch else True
        self._gsched_graphs: dict[bool, fx.Graph] = {traced_training: graph}
        if other_mode_graph is not None:
            self._gsched_graphs[not traced_training] = other_mode_graph
        self._gsched_traced_training = traced_training
        self._gsched_fns = self._compile_all()

    @property
    def traced_graph(self) -> fx.Graph:
        """The graph this stage runs in the mode it was traced in (read it, do not change it)."""
        return self._gsched_graph

    @property
    def is_first_stage(self) -> bool:
        return self._gsched_inputs is not None

    @property
    def is_last_stage(self) -> bool:
        return self._gsched_outputs is not None

    @property
    def has_graph_per_mode(self) -> bool:
        """True when the stage runs a train-mode and an eval-mode graph of its own."""
        return len(self._gsched_graphs) == 2

    def called_modules(self) -> set[str]:
        """The names of the submodules this stage calls as modules (``call_module`` in either
        mode's graph): leaves, whose own submodules then run as modules inside them. A module
        above them (a block the trace went into) only holds them; its own ``forward`` and hooks
        never run in the stage."""
        return {str(n.target) for g in self._gsched_graphs.values() for n in g.nodes
                if n.op == "call_module"}

    @property
    def code(self) -> str:
        """The Python source this stage runs (fx's code of its graph in the traced mode), to
        read what a stage does or paste it into a bug report."""
        return str(self._gsched_graph.python_code(root_module="self").src)

    @property
    def code_filename(self) -> str:
        """The name the traced mode's forward is compiled under (shown in tracebacks)."""
        return self._filename(self._gsched_traced_training)

    def _filename(self, training: bool) -> str:
        suffix = "" if training == self._gsched_traced_training else (
            ", train mode" if training else ", eval mode")
        return f"<gsched stage {self.stage_index} of {self._gsched_owner}{suffix}>"

    def failing_unit(self, exc: BaseException) -> str | None:
        """The statement of this stage's code that raised ``exc`` (``"linear_1 = ..."``), if any.

        Why: an exception inside a stage otherwise points at torch internals; the generated line
        names the unit (the graph node, as in ``part.report()``) that failed.
        """
        filenames = {self._filename(mode) for mode in self._gsched_graphs}
        filename, line = self.code_filename, None
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename in filenames:
                filename, line = tb.tb_frame.f_code.co_filename, tb.tb_lineno
            tb = tb.tb_next
        if line is None:
            return None
        statement = linecache.getline(filename, line).split(";")[0].strip()
        return statement or None

    def _compile_all(self) -> dict[bool, Any]:
        return {mode: self._compile(graph, self._filename(mode))
                for mode, graph in self._gsched_graphs.items()}

    @staticmethod
    def _compile(graph: fx.Graph, filename: str) -> Any:
        code = graph.python_code(root_module="self")
        linecache.cache[filename] = (len(code.src), None, code.src.splitlines(True), filename)
        namespace = dict(code.globals)
        exec(compile(code.src, filename, "exec"), namespace)  # noqa: S102 - fx-generated code
        return namespace["forward"]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_gsched_fns", None)  # exec'd code is not picklable; rebuilt from the graphs
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]  # nn.Module's: unannotated
        self._gsched_fns = self._compile_all()

    def _current_mode(self) -> bool:
        """The mode whose graph runs now: that of the modules whose code was traced."""
        watch = self._gsched_mode_watch
        if not watch:
            return self._gsched_traced_training
        modes = {m.training for m, _ in watch}
        if len(modes) == 1 and next(iter(modes)) in self._gsched_fns:
            return next(iter(modes))
        traced = "train" if self._gsched_traced_training else "eval"
        if len(modes) > 1:
            why = ("its traced modules are now in different modes (some train, some eval); "
                   "call train() or eval() on the whole model")
        else:
            why = ("the other mode's graph could not be cut at the same stage boundaries, so "
                   "this stage runs in one mode only. Partition again after train()/eval(), or "
                   "make the mode-dependent code a leaf module (nn.Dropout instead of "
                   "F.dropout(training=self.training)) so it reads the mode at run time")
        raise ModeMismatchError(
            f"{self._gsched_owner} was partitioned in {traced} mode and its traced code depends "
            f"on the mode ({self._gsched_mode_reason}), but {why}."
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        run = self._gsched_fns[self._current_mode()]
        if self._gsched_inputs is not None:
            flat: Sequence[Any] = self._gsched_inputs.flatten(args, kwargs)
        else:
            if kwargs or len(args) != 1 or not isinstance(args[0], (tuple, list)):
                raise StageInputError(
                    f"Stage {self.stage_index} of {self._gsched_owner} takes one positional "
                    "argument: the tuple returned by the previous stage."
                )
            flat = args[0]
            if len(flat) != len(self.input_names):
                raise StageInputError(
                    f"Stage {self.stage_index} of {self._gsched_owner} expects "
                    f"{len(self.input_names)} values {self.input_names}, got {len(flat)}."
                )
        out = run(self, *flat)
        return self._gsched_outputs.rebuild(out) if self._gsched_outputs is not None else out

    def extra_repr(self) -> str:
        return (
            f"stage {self.stage_index} of {self.num_stages}, inputs={list(self.input_names)}, "
            f"outputs={list(self.output_names) if not self.is_last_stage else 'module output'}"
        )


class ModuleShell(nn.Module):
    """Stands in a stage for a module the trace went into: it holds the submodules the stage
    calls under their original path, but not the original's code (which the stage runs
    inline). ``original_type``: the original module's class name, for messages."""

    def __init__(self, original_type: str) -> None:
        super().__init__()
        self.original_type = original_type


def _install(stage: nn.Module, traced: TracedModel, target: str) -> None:
    """Make ``target`` reachable on ``stage`` under its original path, sharing the original object."""
    if target in traced.constants:
        object.__setattr__(stage, target, traced.constants[target])
        return
    atoms = target.split(".")
    holder, original = stage, traced.module
    for atom in atoms[:-1]:
        child = getattr(original, atom)
        existing = holder._modules.get(atom)
        if existing is child:
            return  # an ancestor is installed as the original module: target already reachable
        if existing is None:
            existing = ModuleShell(type(child).__name__)
            existing.training = child.training  # shells report the original's mode
            holder.add_module(atom, existing)
        holder, original = existing, child
    name, obj = atoms[-1], getattr(original, atoms[-1])
    if isinstance(obj, nn.Module):
        holder.add_module(name, obj)
    elif name in original._parameters:
        holder.register_parameter(name, obj)
    elif name in original._buffers:
        holder.register_buffer(
            name, obj, persistent=name not in original._non_persistent_buffers_set
        )
    else:  # a plain tensor attribute stays a plain attribute (not in state_dict, like the original)
        object.__setattr__(holder, name, obj)


def _original_order(module: nn.Module) -> dict[str, tuple[int, int, str]]:
    """Sort key of every module/parameter/buffer path in the original's traversal order.

    Installing a stage's targets in this order makes ``stage.named_parameters()`` list them in
    the same relative order as ``module.named_parameters()`` (and ancestors before descendants).
    """
    order: dict[str, tuple[int, int, str]] = {}
    for index, (path, sub) in enumerate(module.named_modules(remove_duplicate=False)):
        order.setdefault(path, (index, -1, path))
        for k, name in enumerate([*sub._parameters, *sub._buffers]):
            full = f"{path}.{name}" if path else name
            order.setdefault(full, (index, k, full))
    return order


def _slice_graph(table: UnitTable, start: int, stop: int, last: bool) -> fx.Graph:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = table.placeholders if start == 0 else table.live_at(start)
    for value in inputs:
        env[value] = graph.placeholder(value.name)
    if start > 0:  # received values this stage changes in place: a copy of its own
        changed = {mutated_value(u.node, table.traced.resolve) for u in table.units[start:stop]}
        for value in inputs:
            if value in changed:
                env[value] = graph.call_function(writable_copy, (env[value],))

    def load(node: fx.Node) -> fx.Node:
        if node not in env:
            if node.op != "get_attr":
                raise AssertionError(f"value {node.name} is not live in this stage")
            env[node] = graph.get_attr(target_name(node))  # re-created per stage: never carried
        return env[node]

    for unit in table.units[start:stop]:
        env[unit.node] = graph.node_copy(unit.node, load)
    if last:
        graph.output(fx.node.map_arg(table.output.args[0], load))
    else:
        graph.output(tuple(load(v) for v in table.live_at(stop)))
    graph.lint()
    return graph


def _other_mode_slices(table: UnitTable, cuts: Sequence[int]) -> list[fx.Graph] | None:
    """The other mode's graph cut at the same boundaries as ``table``'s, or None if it cannot be.

    Why this is safe: a cut is named by the first unit after it, and fx names nodes
    deterministically from the code, so the same statement has the same name in both traces
    (the mode only changes arguments such as ``training=`` or which branch runs). The other
    graph is cut before the units of the same names, and the result is accepted only if every
    stage hands over as many values in both modes (a stage's output tuple is read by position,
    by the next stage's graph of the same mode) and no parameter read in both modes moves to
    another stage; the runtime's stage boundaries and ownership then hold in
    both (a stage also holds what only one mode reads).
    """
    traced = table.traced
    if traced.other_mode_graph is None:
        return None
    other = UnitTable(replace(traced, graph=traced.other_mode_graph))
    index = {unit.name: unit.index for unit in other.units}
    other_cuts = [index.get(table.units[c].name) for c in cuts]
    if any(c is None for c in other_cuts) or other_cuts != sorted(set(other_cuts)):  # type: ignore[type-var]
        return None
    mapped = [c for c in other_cuts if c is not None]
    for c, o in zip(cuts, mapped, strict=True):  # stages hand over tuples: same arity
        if len(table.live_at(c)) != len(other.live_at(o)):
            return None
    bounds, other_bounds = [0, *cuts, len(table)], [0, *mapped, len(other)]
    last = len(bounds) - 2
    mine = [_parameter_targets(_slice_graph(table, bounds[k], bounds[k + 1], k == last), traced)
            for k in range(len(bounds) - 1)]
    everywhere = set().union(*mine)
    graphs = []
    for k in range(len(bounds) - 1):
        graph = _slice_graph(other, other_bounds[k], other_bounds[k + 1], k == last)
        # a parameter both modes read stays in its stage (else it would become shared between
        # stages); one only the other mode reads joins this stage
        if not (_parameter_targets(graph, traced) & everywhere) <= mine[k]:
            return None
        graphs.append(graph)
    return graphs


def _parameter_targets(graph: fx.Graph, traced: Any) -> set[int]:
    """ids of the parameters a stage graph reads (through modules and get_attr)."""
    found: set[int] = set()
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr"):
            obj = traced.resolve(node.target)
            params = obj.parameters() if isinstance(obj, nn.Module) else [obj]
            found.update(id(p) for p in params if isinstance(p, nn.Parameter))
    return found


def build_stages(table: UnitTable, cuts: Sequence[int]) -> list[StageModule]:
    """One :class:`StageModule` per segment between ``cuts`` (a graph per mode if needed)."""
    traced = table.traced
    bounds = [0, *cuts, len(table)]
    num_stages = len(bounds) - 1
    owner = type(traced.module).__name__
    watch = None
    other_graphs: list[fx.Graph] | None = None
    if traced.mode_dependent is not None:
        watch = [(m, traced.traced_training) for m in traced.traced_into.values()]
        other_graphs = _other_mode_slices(table, cuts)
    order = _original_order(traced.module)
    stages = []
    for index in range(num_stages):
        last = index == num_stages - 1
        graph = _slice_graph(table, bounds[index], bounds[index + 1], last)
        other = other_graphs[index] if other_graphs is not None else None
        stage = StageModule(
            index=index,
            num_stages=num_stages,
            graph=graph,
            owner=owner,
            inputs=traced.inputs if index == 0 else None,
            outputs=traced.outputs if last else None,
            mode_watch=watch,
            mode_reason=traced.mode_dependent,
            other_mode_graph=other,
        )
        stage.training = traced.module.training  # not .train(): that would recurse into originals
        targets = {n.target for g in (graph, other) if g is not None for n in g.nodes
                   if n.op in ("call_module", "get_attr")}
        for target in sorted(targets, key=lambda t: order.get(t, (len(order), 0, t))):
            try:
                _install(stage, traced, target)
            except KeyError as exc:  # add_module: name clashes with a StageModule attribute
                raise PartitionError(
                    f"Cannot rebuild {target!r} inside stage {index}: {exc}. Rename that "
                    "attribute of the model."
                ) from None
        stages.append(stage)
    return stages
