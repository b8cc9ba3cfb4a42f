"""The package's layers, checked from the source: who may import what, and no import cycles.

docs/ARCHITECTURE.md promises that layers import downward only: ``schedule/`` (and ``errors.py``,
which it uses) is pure Python so the planner and the ``gsched`` CLI never pay for torch; the
runtime executes programs without knowing Lightning or the fx partitioner; nothing depends on the
CLI. Nothing enforced that, so a convenient import (``engine.py`` once took ``describe`` from the
CLI) went unnoticed. These tests read every module with :mod:`ast` instead of importing it, so
they see imports inside functions and ``if TYPE_CHECKING:`` blocks too, and name file, line and
imported module on failure.

The cycle check uses only import-time edges (module-level statements, ``if TYPE_CHECKING:``
bodies excluded): a cycle there makes the import order matter and half-initialised modules
possible. An import inside a function runs later and is not an edge.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import pytest

PACKAGE = "lightning_gsched"
REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = REPO_ROOT / PACKAGE

TORCH = ("torch", "functorch", "torchvision")
# the pip package in its three distributions, not lightning_gsched.lightning
LIGHTNING_PIP = ("lightning", "pytorch_lightning", "lightning_fabric")


@dataclass(frozen=True)
class ImportRecord:
    """One module that a statement imports, relative imports resolved to absolute names.

    ``from a.b import c`` records ``a.b.c`` when that is a module of the package (so
    ``from lightning_gsched import cli`` is an import of ``lightning_gsched.cli``), else ``a.b``.
    Python also runs the ``__init__`` of every package on the way (``a.b`` for ``a.b.c``) unless
    it is already running, i.e. an ancestor of the importing module: those are recorded with
    ``implicit=True`` (they matter for cycles, not for who-imports-what reports).
    ``in_function``: the statement runs when a function is called, not at import time.
    ``type_only``: inside ``if TYPE_CHECKING:``, never run.
    """

    path: str
    line: int
    target: str
    in_function: bool = False
    type_only: bool = False
    implicit: bool = False

    @property
    def at_import_time(self) -> bool:
        return not (self.in_function or self.type_only)

    def __str__(self) -> str:
        how = " (the package, run before its submodule)" if self.implicit else ""
        return f"{self.path}:{self.line} imports {self.target}{how}"


def module_name(path: Path) -> str:
    """``lightning_gsched/runtime/step.py`` -> ``lightning_gsched.runtime.step`` (``__init__`` ->
    the package itself)."""
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module that ``from <level dots><name> import ...`` in ``module`` names."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 >= len(base):
        raise ValueError(f"relative import beyond the top-level package in {module}")
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _import_module_literal(node: ast.AST) -> str | None:
    """``"x.y"`` for ``importlib.import_module("x.y")`` / ``import_module("x.y")``, else None."""
    if not (isinstance(node, ast.Call) and node.args):
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    first = node.args[0]
    if name == "import_module" and isinstance(first, ast.Constant):
        return first.value if isinstance(first.value, str) else None
    return None


def scan_source(
    source: str,
    path: str,
    module: str,
    is_package: bool = False,
    known_modules: Iterable[str] = (),
) -> list[ImportRecord]:
    """Every import in ``source`` (module ``module``), with when it runs (see ImportRecord).

    ``known_modules`` are the package's modules, used to tell ``from pkg import submodule``
    from ``from pkg import name``. ``importlib.import_module("literal")`` counts as an import.
    """
    known = set(known_modules)
    running = {".".join(module.split(".")[:k]) for k in range(1, module.count(".") + 2)}
    records: list[ImportRecord] = []

    def add(line: int, targets: Iterable[str], in_function: bool, type_only: bool) -> None:
        for target in dict.fromkeys(targets):  # ordered, without repeats
            parts = target.split(".")
            for k in range(1, len(parts)):
                parent = ".".join(parts[:k])
                if parent in known and parent not in running:
                    records.append(
                        ImportRecord(path, line, parent, in_function, type_only, implicit=True)
                    )
            records.append(ImportRecord(path, line, target, in_function, type_only))

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            add(node.lineno, [alias.name for alias in node.names], in_function, type_only)
        elif isinstance(node, ast.ImportFrom):
            base = (
                _resolve_relative(module, is_package, node.level, node.module)
                if node.level
                else node.module or ""
            )
            names = [f"{base}.{alias.name}" for alias in node.names]
            # a name that is not a submodule is read from base's __init__: base is imported
            targets = [n if n in known else base for n in names]
            add(node.lineno, targets, in_function, type_only)
        elif (literal := _import_module_literal(node)) is not None:
            add(node.lineno, [literal], in_function, type_only)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, in_function, True)
            for child in node.orelse:
                visit(child, in_function, type_only)
            return
        # a function body runs when called; a class body, loops, with and try run at import
        deferred = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or deferred, type_only)

    visit(ast.parse(source, filename=path), False, False)
    return records


def scan_package() -> dict[str, list[ImportRecord]]:
    """{module: its imports} for every module of the package, read from disk."""
    modules = package_modules()
    return {
        name: scan_source(
            path.read_text(encoding="utf-8"),
            str(path.relative_to(REPO_ROOT)),
            name,
            is_package=path.name == "__init__.py",
            known_modules=modules,
        )
        for name, path in modules.items()
    }


def _matches(target: str, prefixes: Iterable[str]) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


@dataclass(frozen=True)
class Rule:
    """Modules matching ``applies_to`` (dotted prefixes) must not import ``forbidden``."""

    name: str
    applies_to: tuple[str, ...]
    forbidden: tuple[str, ...]
    why: str
    exempt: tuple[str, ...] = ()

    def violations(self, imports: Mapping[str, list[ImportRecord]]) -> list[str]:
        found = []
        for module, records in imports.items():
            if not _matches(module, self.applies_to) or module in self.exempt:
                continue
            found += [
                f"{r} ({self.why})"
                for r in records
                if not r.implicit and _matches(r.target, self.forbidden)
            ]
        return found


# the front ends; and the engine, the measuring and the partitioner below them, from the top down
FRONT_ENDS = (f"{PACKAGE}.lightning", f"{PACKAGE}.fabric")
ABOVE_MEASURE = (f"{PACKAGE}.engine", *FRONT_ENDS)
ABOVE_PARTITION = (f"{PACKAGE}.measure", *ABOVE_MEASURE)
# the Trainer's side of the pip package (lightning.fabric is Fabric's and shared utilities)
TRAINER_PIP = ("lightning.pytorch", "pytorch_lightning")

RULES = [
    Rule(
        name="pure-python-schedule",
        applies_to=(f"{PACKAGE}.schedule", f"{PACKAGE}.errors", f"{PACKAGE}.host_random"),
        forbidden=(*TORCH, *LIGHTNING_PIP),
        why="schedule/, errors.py and host_random.py are pure Python: the planner and CLI must "
        "not load torch",
    ),
    Rule(
        name="schedule-is-the-bottom-layer",
        # the torch-backed layers load torch themselves; importing them from below would too
        applies_to=(f"{PACKAGE}.schedule", f"{PACKAGE}.errors", f"{PACKAGE}.host_random"),
        forbidden=(
            f"{PACKAGE}.partition",
            f"{PACKAGE}.runtime",
            *ABOVE_PARTITION,
            f"{PACKAGE}.cli",
        ),
        why="schedule/, errors.py and host_random.py sit below every other layer",
    ),
    Rule(
        name="partition-only-splits",
        applies_to=(f"{PACKAGE}.partition",),
        forbidden=(*LIGHTNING_PIP, f"{PACKAGE}.runtime", *ABOVE_PARTITION),
        why="partition/ splits a model with torch.fx and depends on nothing in runtime/; timing "
        "and sizing stages (which needs the runtime's code) is measure/, above both",
    ),
    Rule(
        name="runtime-below-lightning-and-partition",
        applies_to=(f"{PACKAGE}.runtime",),
        forbidden=(*LIGHTNING_PIP, f"{PACKAGE}.partition", *ABOVE_PARTITION),
        why="runtime/ executes programs on any stages; Lightning and fx partitioning sit above it",
    ),
    Rule(
        name="measure-below-the-engine",
        applies_to=(f"{PACKAGE}.measure",),
        forbidden=(*LIGHTNING_PIP, *ABOVE_MEASURE),
        why="measure/ times and sizes stages for the planner (gsched tune, the engine's auto "
        "schedule and memory report); it knows neither the engine nor Lightning",
    ),
    Rule(
        name="engine-imports-no-lightning",
        applies_to=(f"{PACKAGE}.engine",),
        forbidden=(*LIGHTNING_PIP, *FRONT_ENDS),
        why="engine/ is the pipeline both front ends share: it imports neither the lightning pip "
        "package nor a front end, so Fabric never loads lightning.pytorch",
    ),
    Rule(
        name="fabric-is-not-the-trainer",
        applies_to=(f"{PACKAGE}.fabric",),
        forbidden=(*TRAINER_PIP, f"{PACKAGE}.lightning"),
        why="the Fabric front end shares the engine, not the Trainer strategy: importing it must "
        "not load lightning.pytorch nor register Trainer strategies",
    ),
    Rule(
        name="trainer-is-not-fabric",
        applies_to=(f"{PACKAGE}.lightning",),
        forbidden=(f"{PACKAGE}.fabric",),
        why="the two front ends are independent adapters over engine/",
    ),
    Rule(
        name="front-ends-use-the-runtime-facade",
        # the engine and both strategies see ModelRuntime & co. from runtime/__init__.py only
        applies_to=(f"{PACKAGE}.engine", *FRONT_ENDS),
        forbidden=tuple(
            f"{PACKAGE}.runtime.{path.stem}"
            for path in sorted((PACKAGE_DIR / "runtime").glob("*.py"))
            if path.stem != "__init__"
        ),
        why="the engine and the front ends reach the runtime through its package interface "
        "(ModelRuntime), never its internals, so the executor can change behind the facade",
    ),
    Rule(
        name="nothing-imports-the-cli",
        applies_to=(PACKAGE,),
        forbidden=(f"{PACKAGE}.cli",),
        exempt=(f"{PACKAGE}.cli",),
        why="the CLI is the top of the stack; shared code belongs in a layer below it",
    ),
]


def _is_edge(record: ImportRecord, type_only: bool) -> bool:
    """Whether ``record`` is a graph edge: run at import time (or only for type checking)."""
    return record.at_import_time or (type_only and not record.in_function)


def import_graph(
    imports: Mapping[str, list[ImportRecord]], type_only: bool = False
) -> dict[str, set[str]]:
    """Edges between the package's own modules, self-imports dropped: those run at import time,
    plus those under ``if TYPE_CHECKING:`` when ``type_only``."""
    return {
        module: {
            r.target
            for r in records
            if _is_edge(r, type_only) and r.target in imports and r.target != module
        }
        for module, records in imports.items()
    }


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def _cycle_report(
    component: list[str], imports: Mapping[str, list[ImportRecord]], type_only: bool = False
) -> Iterator[str]:
    """The import statements that make up the edges of one cycle."""
    members = set(component)
    for module in component:
        for r in imports[module]:
            if _is_edge(r, type_only) and r.target in members and r.target != module:
                yield f"  {r}"


def _cycles_text(imports: Mapping[str, list[ImportRecord]], type_only: bool) -> str:
    report = []
    for component in cycles(import_graph(imports, type_only)):
        report.append("cycle among " + ", ".join(component) + ":")
        report += _cycle_report(component, imports, type_only)
    return "\n".join(report)


# ---------------------------------------------------------------------------- the package


@pytest.fixture(scope="module")
def package_imports() -> dict[str, list[ImportRecord]]:
    return scan_package()


def test_scanner_sees_the_package(package_imports):
    """Guard against a scanner that passes because it found nothing."""
    assert f"{PACKAGE}.schedule.plan" in package_imports
    assert f"{PACKAGE}.runtime.executor" in package_imports
    assert f"{PACKAGE}.engine.engine" in package_imports
    assert f"{PACKAGE}.measure.profile" in package_imports
    executor = {r.target for r in package_imports[f"{PACKAGE}.runtime.executor"]}
    assert "torch" in executor and f"{PACKAGE}.schedule.program" in executor
    assert sum(map(len, package_imports.values())) > 200


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.name)
def test_layer_rule(rule, package_imports):
    violations = rule.violations(package_imports)
    assert not violations, "layering violations:\n" + "\n".join(violations)


def test_front_ends_import_only_the_engine_face(package_imports):
    """Both front ends import ``lightning_gsched.engine`` (its ``__all__``: what they use), never
    an engine submodule: the engine's modules can move and merge without touching the front
    ends, and every checkpoint decision is the one service's (``engine/checkpoint.py``)."""
    submodules = sorted(f"{PACKAGE}.engine.{path.stem}"
                        for path in (PACKAGE_DIR / "engine").glob("*.py")
                        if path.stem != "__init__")
    assert f"{PACKAGE}.engine.checkpoint" in submodules
    crossing = [
        str(r) for module, records in package_imports.items() if _matches(module, FRONT_ENDS)
        for r in records if not r.implicit and _matches(r.target, submodules)
    ]
    assert not crossing, "\n".join(crossing)


def test_no_import_cycles(package_imports):
    """Module-level imports (what runs when a module is first imported) form no cycle."""
    report = _cycles_text(package_imports, type_only=False)
    assert not report, report


def test_no_cycles_through_type_only_imports_either(package_imports):
    """Also with ``if TYPE_CHECKING:`` imports: such a cycle means two modules know each
    other's types, i.e. one concept split over two files (partition/api <-> report and
    runtime/executor <-> step were; each lower module now states what it reads as a Protocol)."""
    report = _cycles_text(package_imports, type_only=True)
    assert not report, report


def _fresh_import(statement: str) -> tuple[list[str], bool]:
    """Run ``statement`` in a fresh interpreter that imports this checkout (not an installed
    copy): the modules then in ``sys.modules``, and whether a ``gsched_*`` name is in the
    Trainer's StrategyRegistry (read only if Lightning's strategies module is loaded)."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    code = (
        "import json, sys\n"
        f"{statement}\n"
        "registry = getattr(sys.modules.get('lightning.pytorch.strategies'), "
        "'StrategyRegistry', {})\n"
        "print(json.dumps([sorted(sys.modules), 'gsched_fslpp' in registry]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    modules, registered = json.loads(out.stdout.splitlines()[-1])
    return modules, registered


def _trainer_modules(modules: Iterable[str]) -> list[str]:
    return [m for m in modules if _matches(m, TRAINER_PIP)]


def test_importing_fabric_loads_no_trainer():
    """The import-time fact behind the fabric rule: ``import lightning_gsched.fabric`` loads no
    part of the Trainer front end and registers no Trainer strategy, and of ``lightning.pytorch``
    it loads nothing beyond what ``import lightning.fabric`` loads by itself. (The ``lightning``
    distribution's own ``lightning/__init__.py`` imports ``lightning.pytorch``'s Trainer, so with
    it installed no Fabric user avoids that; without such an import there, none is loaded.)"""
    loaded, registered = _fresh_import("import lightning_gsched.fabric")
    assert "lightning_gsched.fabric" in loaded and "lightning_gsched.engine.engine" in loaded
    assert [m for m in loaded if _matches(m, (f"{PACKAGE}.lightning",))] == []
    assert not registered
    by_fabric_itself, _ = _fresh_import("import lightning.fabric")
    assert _trainer_modules(loaded) == _trainer_modules(by_fabric_itself)


def test_importing_the_engine_loads_no_lightning():
    loaded, _ = _fresh_import("import lightning_gsched.engine")
    assert "lightning_gsched.engine.engine" in loaded
    assert [m for m in loaded if _matches(m, LIGHTNING_PIP)] == []


# ---------------------------------------------------------------------------- the checker


KNOWN = {
    f"{PACKAGE}",
    f"{PACKAGE}.cli",
    f"{PACKAGE}.runtime",
    f"{PACKAGE}.runtime.wire",
    f"{PACKAGE}.runtime.step",
    f"{PACKAGE}.schedule",
    f"{PACKAGE}.schedule.plan",
    f"{PACKAGE}.schedule.fake",
}


def _scan(source: str, module: str, is_package: bool = False) -> list[ImportRecord]:
    path = module.replace(".", "/") + ("/__init__.py" if is_package else ".py")
    return scan_source(source, path, module, is_package, KNOWN)


def test_scanner_resolves_every_import_form():
    source = (
        "from __future__ import annotations\n"
        "import os.path\n"
        "from typing import TYPE_CHECKING\n"
        "from . import wire\n"
        "from ..schedule.plan import Plan\n"
        "from lightning_gsched import cli\n"
        "if TYPE_CHECKING:\n"
        "    from .step import StepRun\n"
        "else:\n"
        "    import json\n"
        "def later():\n"
        "    from torch import nn\n"
        "    importlib.import_module('lightning.pytorch')\n"
        "class Holder:\n"
        "    import math\n"
    )
    got = [
        (r.line, r.target, r.in_function, r.type_only, r.implicit)
        for r in _scan(source, f"{PACKAGE}.runtime.executor")
    ]
    assert got == [
        (1, "__future__", False, False, False),
        (2, "os.path", False, False, False),
        (3, "typing", False, False, False),
        # lightning_gsched.runtime is already running (it is executor's package): no edge
        (4, f"{PACKAGE}.runtime.wire", False, False, False),
        # importing schedule.plan runs schedule/__init__.py first
        (5, f"{PACKAGE}.schedule", False, False, True),
        (5, f"{PACKAGE}.schedule.plan", False, False, False),
        (6, f"{PACKAGE}.cli", False, False, False),
        (8, f"{PACKAGE}.runtime.step", False, True, False),
        (10, "json", False, False, False),
        (12, "torch", True, False, False),
        (13, "lightning.pytorch", True, False, False),
        (15, "math", False, False, False),
    ]


def test_a_name_from_the_own_package_init_is_an_edge_to_it():
    """``from lightning_gsched.runtime import ProgramExecutor`` inside runtime/ reads the
    package's ``__init__``, which may still be half-run: a real dependency, unlike a submodule."""
    records = _scan(
        "from lightning_gsched.runtime import ProgramExecutor, wire\n", f"{PACKAGE}.runtime.step"
    )
    assert [(r.target, r.implicit) for r in records] == [
        (f"{PACKAGE}.runtime", False),
        (f"{PACKAGE}.runtime.wire", False),
    ]


def test_relative_imports_in_a_package_init_resolve_from_the_package():
    records = _scan("from .wire import pack\nfrom .. import cli\n", f"{PACKAGE}.runtime", True)
    assert [r.target for r in records] == [f"{PACKAGE}.runtime.wire", f"{PACKAGE}.cli"]
    with pytest.raises(ValueError, match="beyond the top-level package"):
        _scan("from ... import cli\n", f"{PACKAGE}.runtime", True)


def test_rules_report_file_line_and_target():
    """A torch import hidden in a function of the schedule layer is caught, with its location;
    ``lightning_gsched.lightning`` is not mistaken for the ``lightning`` pip package; each layer
    rule names what crossed it (partition -> runtime, engine -> Lightning, fabric -> Trainer)."""
    imports = {
        f"{PACKAGE}.schedule.fake": _scan(
            "import math\nfrom lightning_gsched.errors import GschedError\n\n"
            "def f():\n    import torch.nn.functional as F\n",
            f"{PACKAGE}.schedule.fake",
        ),
        f"{PACKAGE}.runtime.step": _scan(
            "from lightning_gsched.lightning import config\n", f"{PACKAGE}.runtime.step"
        ),
        f"{PACKAGE}.partition.profile": _scan(
            "from lightning_gsched.runtime.split_backward import backward_input\n"
            "from lightning_gsched.measure import profile_stages\n",
            f"{PACKAGE}.partition.profile",
        ),
        f"{PACKAGE}.measure.profile": _scan(
            # measuring runs the runtime's own code: its internals are allowed here
            "from lightning_gsched.runtime.split_backward import backward_input\n"
            "from lightning_gsched.engine.auto import choose_schedule\n",
            f"{PACKAGE}.measure.profile",
        ),
        f"{PACKAGE}.engine.engine": _scan(
            "from lightning_gsched.engine import config\nfrom ..cli import describe\n"
            "import lightning.pytorch as pl\nfrom lightning_gsched.lightning import sharded\n",
            f"{PACKAGE}.engine.engine",
        ),
        f"{PACKAGE}.cli": _scan("from lightning_gsched.cli import main\n", f"{PACKAGE}.cli"),
        f"{PACKAGE}.fabric.strategy": _scan(
            "from lightning_gsched.runtime import ModelRuntime\n"
            "from lightning_gsched.runtime.flat import FlatStage\n"
            "from lightning_gsched.lightning.engine import PipelineEngine\n"
            "from lightning.pytorch.strategies import DDPStrategy\n"
            "from lightning.fabric.strategies import DDPStrategy as FabricDDP\n",
            f"{PACKAGE}.fabric.strategy",
        ),
        f"{PACKAGE}.lightning.strategy": _scan(
            "from lightning_gsched.fabric import GeneralParallelFabric\n"
            "from lightning_gsched.engine import PipelineEngine\n",
            f"{PACKAGE}.lightning.strategy",
        ),
    }
    rules = {rule.name: rule for rule in RULES}
    found = {name: rule.violations(imports) for name, rule in rules.items()}
    why = {name: rule.why for name, rule in rules.items()}

    def report(path: str, line: int, target: str, rule: str) -> str:
        return f"{PACKAGE}/{path}:{line} imports {target} ({why[rule]})"

    assert found == {
        "pure-python-schedule": [
            report("schedule/fake.py", 5, "torch.nn.functional", "pure-python-schedule")
        ],
        "schedule-is-the-bottom-layer": [],
        "partition-only-splits": [
            report("partition/profile.py", 1, f"{PACKAGE}.runtime.split_backward",
                   "partition-only-splits"),
            report("partition/profile.py", 2, f"{PACKAGE}.measure", "partition-only-splits"),
        ],
        "runtime-below-lightning-and-partition": [
            report("runtime/step.py", 1, f"{PACKAGE}.lightning",
                   "runtime-below-lightning-and-partition")
        ],
        "measure-below-the-engine": [
            report("measure/profile.py", 2, f"{PACKAGE}.engine.auto", "measure-below-the-engine")
        ],
        "engine-imports-no-lightning": [
            report("engine/engine.py", 3, "lightning.pytorch", "engine-imports-no-lightning"),
            report("engine/engine.py", 4, f"{PACKAGE}.lightning", "engine-imports-no-lightning"),
        ],
        "fabric-is-not-the-trainer": [
            report("fabric/strategy.py", 3, f"{PACKAGE}.lightning.engine",
                   "fabric-is-not-the-trainer"),
            report("fabric/strategy.py", 4, "lightning.pytorch.strategies",
                   "fabric-is-not-the-trainer"),
        ],
        "trainer-is-not-fabric": [
            report("lightning/strategy.py", 1, f"{PACKAGE}.fabric", "trainer-is-not-fabric")
        ],
        "front-ends-use-the-runtime-facade": [
            report("fabric/strategy.py", 2, f"{PACKAGE}.runtime.flat",
                   "front-ends-use-the-runtime-facade")
        ],
        "nothing-imports-the-cli": [
            report("engine/engine.py", 2, f"{PACKAGE}.cli", "nothing-imports-the-cli")
        ],
    }


def test_cycle_finder_reports_a_cycle_and_ignores_deferred_edges():
    imports = {
        "pkg.a": [ImportRecord("pkg/a.py", 3, "pkg.b")],
        "pkg.b": [
            ImportRecord("pkg/b.py", 5, "pkg.c"),
            ImportRecord("pkg/b.py", 9, "pkg.d", in_function=True),
        ],
        "pkg.c": [ImportRecord("pkg/c.py", 1, "pkg.a")],
        "pkg.d": [ImportRecord("pkg/d.py", 1, "pkg.b")],
    }
    found = cycles(import_graph(imports))
    assert found == [["pkg.a", "pkg.b", "pkg.c"]]
    assert list(_cycle_report(found[0], imports)) == [
        "  pkg/a.py:3 imports pkg.b",
        "  pkg/b.py:5 imports pkg.c",
        "  pkg/c.py:1 imports pkg.a",
    ]
    assert cycles(import_graph({k: v for k, v in imports.items() if k != "pkg.c"})) == []


def test_type_only_edges_count_only_when_asked():
    imports = {
        "pkg.api": [ImportRecord("pkg/api.py", 2, "pkg.report")],
        "pkg.report": [ImportRecord("pkg/report.py", 7, "pkg.api", type_only=True)],
    }
    assert cycles(import_graph(imports)) == []
    assert cycles(import_graph(imports, type_only=True)) == [["pkg.api", "pkg.report"]]
    assert "pkg/report.py:7 imports pkg.api" in _cycles_text(imports, type_only=True)
