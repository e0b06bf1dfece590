#!/usr/bin/env python3
"""The import-layer check of `make lint`: no import cycle and no upward or cross-service import in proto/ and services/.

It reads every module under proto/ and services/ with `ast` (nothing is imported or run) and builds the graph of
imports between our own modules. Every form counts: `import a.b`, `from a import b` (an edge to the module `a.b`
when that is a module, else to `a`), relative imports, imports inside functions, methods and `if TYPE_CHECKING:`
blocks. A function-local import is still a dependency (it only moves the circle from import time to call time), and
a TYPE_CHECKING import still couples the two modules' types, so both count; the report marks them. Imports built at
run time (`importlib.import_module("...")`) and imports of anything outside proto/ and services/ are not seen.

Two findings, one line each, `file:line importer -> imported, why`:
  * cycle: the modules of every strongly connected component of the graph (each edge inside it is reported, with
    one circle through the component), and a module importing itself;
  * layer: an import against LAYERS below. Each module belongs to the entry with the longest matching prefix (a
    prefix matches itself and its submodules). An importer may import its own entry, or an entry of a lower rank in
    its own column or in the shared column. `top` (the composition root) may import anything. Two entries of one
    rank may not import each other. A module of ours that no entry matches is reported when it imports or is
    imported.

Exit status 0 when clean, 1 with the findings on stdout (and a count on stderr).
Usage: scripts/check_layers.py [ROOT]   (ROOT defaults to the repository this script lies in)
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

# The layer table: package prefix -> (rank, column). Lower ranks are lower layers. `shared` modules may be imported
# from every column; a service column may import only itself and `shared`; `top` may import everything. This is the
# TARGET layout of the redesign (issue #23, shared/redesign-layout.md): update it here when a package moves.
LAYERS: dict[str, tuple[int, str]] = {
    "proto": (0, "shared"),  # the bus contract: imports no service
    "services.common": (1, "shared"),  # the small common runtime every service may use
    # the engine, bottom to top
    "services.engine.errors": (1, "engine"),  # the engine's exception tree: a leaf every engine layer raises from
    "services.engine.kernels": (2, "engine"),  # tensor kernels (triton, CPU)
    "services.engine.core": (2, "engine"),  # scheduling, block pool, requests: no tensors
    "services.engine.model": (3, "engine"),  # model, attention, KV cache, sampler, runner
    "services.engine.spec": (4, "engine"),  # speculative decoding
    "services.engine": (5, "engine"),  # engine_core, config, outputs, errors
    "services.engine.serve": (6, "engine"),  # async engine, worker, HTTP, energy, views
    "services.engine.__main__": (7, "engine"),  # the engine's composition root
    # the other services: one column each, above common, never importing each other
    "services.gateway": (2, "gateway"),
    "services.accounting": (2, "accounting"),
    "services.telemetry": (2, "telemetry"),
    # the `llmgw` command: starts the stack, may import everything
    "services.cli": (9, "top"),
}

ROOTS = ("proto", "services")
SHARED = "shared"
TOP = "top"


@dataclass(frozen=True)
class Import:
    """One import statement's edge between two of our modules."""

    importer: str
    imported: str
    path: str  # the importer's file, relative to the root
    line: int
    where: str  # "" (module level), "function" or "TYPE_CHECKING"


@dataclass(frozen=True)
class Finding:
    """One violation, printed as one line."""

    edge: Import
    why: str

    def __str__(self) -> str:
        e = self.edge
        where = f" [{e.where}]" if e.where else ""
        return f"{e.path}:{e.line} {e.importer} -> {e.imported}{where}: {self.why}"


def find_modules(root: Path, roots: Iterable[str] = ROOTS) -> dict[str, Path]:
    """Every module under the roots: dotted name -> file (a package is its __init__.py)."""
    modules: dict[str, Path] = {}
    for top in roots:
        base = root / top
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if "__pycache__" in parts or not all(p.isidentifier() for p in parts):
                continue
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, where: str = "") -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement under node, with where it sits (the innermost of function / TYPE_CHECKING wins)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, where
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk(child, "function")
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), "TYPE_CHECKING")
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), where)
        else:
            yield from _walk(child, where)


def _resolve_base(module: str, is_package: bool, level: int, name: str | None) -> str | None:
    """The absolute module a `from` statement names; None when the relative import climbs above the root."""
    if level == 0:
        return name
    package = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 >= len(package):
        return None
    package = package[: len(package) - (level - 1)]
    return ".".join([*package, name]) if name else ".".join(package)


def _owner(name: str, modules: Mapping[str, Path]) -> str | None:
    """The module of ours that `name` is or lies in (`a.b.C` -> `a.b`), or None when it is not ours."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def find_imports(root: Path, modules: Mapping[str, Path]) -> list[Import]:
    """Every import edge between our modules, in file and line order."""
    edges: list[Import] = []
    for module, path in modules.items():
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        is_package = path.name == "__init__.py"
        for node, where in _walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve_base(module, is_package, node.level, node.module)
                if base is None:
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            seen: set[str] = set()
            for target in targets:
                imported = _owner(target, modules)
                if imported is None or imported in seen:
                    continue
                seen.add(imported)
                edges.append(Import(module, imported, rel, node.lineno, where))
    return edges


def layer_of(module: str, layers: Mapping[str, tuple[int, str]] = LAYERS) -> str | None:
    """The LAYERS entry a module belongs to: the longest prefix that is the module or one of its packages."""
    best: str | None = None
    for prefix in layers:
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best)):
            best = prefix
    return best


def check_layers(edges: Iterable[Import], layers: Mapping[str, tuple[int, str]] = LAYERS) -> list[Finding]:
    """The imports that go up, sideways between services, or touch a module the table does not place."""
    findings: list[Finding] = []
    for e in edges:
        a, b = layer_of(e.importer, layers), layer_of(e.imported, layers)
        if a is None or b is None:
            missing = e.importer if a is None else e.imported
            findings.append(Finding(e, f"layer: {missing} is in no entry of the layer table"))
            continue
        if a == b:
            continue
        (rank_a, col_a), (rank_b, col_b) = layers[a], layers[b]
        if col_a == TOP:
            continue
        if col_b == TOP:
            findings.append(Finding(e, f"layer: {b} is the composition root; nothing imports it"))
        elif col_b not in (SHARED, col_a):
            findings.append(
                Finding(e, f"layer: services never import each other ({a} [{col_a}] -> {b} [{col_b}])")
            )
        elif rank_b > rank_a:
            findings.append(Finding(e, f"layer: upward import ({a} rank {rank_a} -> {b} rank {rank_b})"))
        elif rank_b == rank_a:
            findings.append(Finding(e, f"layer: sibling layers of one rank ({a} -> {b}, rank {rank_a})"))
    return findings


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted, in order of their first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return sorted(components, key=lambda c: c[0])


def _circle(start: str, members: set[str], graph: Mapping[str, Iterable[str]]) -> list[str]:
    """A shortest path start -> ... -> start inside one component (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return [start]


def check_cycles(edges: Iterable[Import]) -> list[Finding]:
    """Every edge that lies on an import circle, with one circle through its component."""
    edges = list(edges)
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.imported)
        graph.setdefault(e.imported, set())
    findings: list[Finding] = []
    for component in strongly_connected(graph):
        members = set(component)
        if len(component) == 1 and component[0] not in graph[component[0]]:
            continue
        circle = " -> ".join(_circle(component[0], members, graph))
        size = f"{len(component)} modules" if len(component) > 1 else "a module importing itself"
        for e in edges:
            if e.importer in members and e.imported in members:
                findings.append(Finding(e, f"cycle: {circle} (a circle of {size}: {', '.join(component)})"))
    return findings


def check(root: Path, layers: Mapping[str, tuple[int, str]] = LAYERS) -> list[Finding]:
    """All findings for the tree at root: cycles first, then layer violations, each in file order."""
    edges = find_imports(root, find_modules(root))
    return check_cycles(edges) + check_layers(edges, layers)


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent
    findings = check(root)
    for finding in findings:
        print(finding)
    if findings:
        print(f"check_layers: {len(findings)} finding(s) under {root}", file=sys.stderr)
        return 1
    print(f"check_layers: no import circle and no upward import under {root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
