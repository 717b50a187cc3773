"""The worker's units import each other as a DAG: no import cycle between them.

A unit is a subpackage of services/worker (attention, loader, lora, model, parallel, speculative,
weights) or one of its top-level modules (model_runner, cuda_graphs, config, ...), each on its
own. The graph is read statically with `ast` from every module under services/worker, and every
import counts:

- module-level imports and the lazy ones inside functions: both run, in some order;
- imports under `if TYPE_CHECKING:` too. They never run, so they cannot break an import, but an
  annotation names the other unit's concept all the same, and a reader follows it like any import
  (the issue's cuda_graphs ⇄ model_runner cycle was one). A lower unit that needs a higher one's
  object says what it needs as a Protocol of its own (cuda_graphs.GraphRunner);
- a registry's "services.worker.x.y:attr" strings, which `importlib` imports by name: an import
  kept in a string is still an import.

Relative imports resolve against the importing module. On a cycle, the failure names it unit by
unit with the file:line of each import that closes it.
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "services" / "worker"
PREFIX = ("services", "worker")
# A registry's importlib target: "services.worker.attention.cpu_backend:CpuBackend".
REGISTRY_STRING = re.compile(r"services\.worker(\.\w+)+(:[\w.]+)?")

# Imports that close a cycle and stay for now: (importing file, imported unit) -> why. None today.
PENDING: dict[tuple[str, str], str] = {}

Graph = dict[str, dict[str, list[str]]]  # unit -> imported unit -> ["file:line", ...]


def unit_of(module: str, root: Path) -> str | None:
    """The unit a dotted module name under services.worker belongs to; None outside it (or for
    services.worker itself)."""
    parts = module.split(".")
    if tuple(parts[:2]) != PREFIX or len(parts) < 3:
        return None
    name = parts[2]
    return name if (root / name).is_dir() or (root / f"{name}.py").is_file() else None


def module_name(path: Path, root: Path) -> list[str]:
    """services/worker/a/b.py -> [services, worker, a, b]; a package's __init__.py -> the package."""
    rel = list(path.relative_to(root).with_suffix("").parts)
    return list(PREFIX) + (rel[:-1] if rel[-1] == "__init__" else rel)


def type_checking_nodes(tree: ast.Module) -> set[int]:
    """The ids of every node inside an `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`) block."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                inside.update(id(n) for n in ast.walk(stmt))
    return inside


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_modules(path: Path, root: Path) -> list[tuple[str, int, bool]]:
    """Every module `path` imports, anywhere in the file → (dotted name, line, under TYPE_CHECKING).
    `from pkg import name` yields pkg.name, which is a module when name is a submodule (and
    belongs to pkg's unit either way)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only = type_checking_nodes(tree)
    package = module_name(path, root)
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else []))
            names = [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and REGISTRY_STRING.fullmatch(node.value):
            names = [node.value.split(":")[0]]
        found += [(name, node.lineno, id(node) in typing_only) for name in names]
    return found


def unit_graph(root: Path = WORKER) -> Graph:
    """The imports between units under `root` (a services/worker tree), without PENDING's."""
    graph: Graph = defaultdict(lambda: defaultdict(list))
    for path in sorted(root.rglob("*.py")):
        source = unit_of(".".join(module_name(path, root)), root)
        site = path.relative_to(root.parents[1]).as_posix()
        for module, line, typing_only in imported_modules(path, root):
            target = unit_of(module, root)
            if source is None or target is None or target == source or (site, target) in PENDING:
                continue
            where = f"{site}:{line}" + (" (TYPE_CHECKING)" if typing_only else "")
            if where not in graph[source][target]:  # `from m import a, b`: one import
                graph[source][target].append(where)
    return graph


def find_cycle(graph: Graph) -> list[str] | None:
    """A cycle of `graph` as [a, b, ..., a], or None when it is a DAG (depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once every successor is explored
    path: list[str] = []

    def visit(unit: str) -> list[str] | None:
        state[unit] = "open"
        path.append(unit)
        for target in sorted(graph.get(unit, {})):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[unit] = "done"
        return None

    for unit in sorted(graph):
        if unit not in state and (cycle := visit(unit)):
            return cycle
    return None


def describe(cycle: list[str], graph: Graph) -> str:
    """The cycle unit by unit, each hop with the imports that make it."""
    hops = [f"  {a} -> {b}: {', '.join(graph[a][b])}" for a, b in zip(cycle, cycle[1:])]
    return "import cycle " + " -> ".join(cycle) + "\n" + "\n".join(hops)


def test_the_worker_units_form_a_dag() -> None:
    graph = unit_graph()
    cycle = find_cycle(graph)
    assert cycle is None, describe(cycle, graph)


def test_every_pending_import_still_exists() -> None:
    """An exemption goes once its import does."""
    present = set()
    for site, unit in PENDING:
        path = REPO / site
        if path.exists() and any(unit_of(m, WORKER) == unit for m, _, _ in imported_modules(path, WORKER)):
            present.add((site, unit))
    assert present == set(PENDING), f"no longer imported, drop from PENDING: {set(PENDING) - present}"


def test_a_cycle_through_lazy_type_checking_relative_and_registry_imports_is_found(tmp_path: Path) -> None:
    """The reading bites: a cycle a -> b -> c -> d -> a made of one import of each kind."""
    root = tmp_path / "services" / "worker"
    for package in ("a", "b"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "a" / "x.py").write_text("def f():\n    from services.worker.b import y\n")  # lazy
    (root / "b" / "y.py").write_text("from typing import TYPE_CHECKING\n"
                                     "if TYPE_CHECKING:\n    from services.worker import c\n")
    (root / "c.py").write_text("from . import d\n")  # relative: services.worker.d
    (root / "d.py").write_text('FACTORIES = {"x": "services.worker.a.x:f"}\n')  # a registry
    graph = unit_graph(root)
    assert find_cycle(graph) == ["a", "b", "c", "d", "a"]
    assert graph["b"]["c"] == ["services/worker/b/y.py:3 (TYPE_CHECKING)"]
    (root / "d.py").write_text("")
    assert find_cycle(unit_graph(root)) is None
