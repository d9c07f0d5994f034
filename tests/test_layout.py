"""The package's layout stays one-way: no module imports itself back through others.

The import graph is read from the source with ``ast``, counting every import: at the top of a module,
under ``TYPE_CHECKING`` and inside functions (a lazy import still ties two modules together). Importing
``a.b.c`` also runs the ``__init__`` of ``a.b`` when the importer is not inside it, so those count too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "staleness_metrics"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imported(module: str, path: Path, modules: Mapping[str, Path]) -> Iterator[str]:
    """The package's modules that ``module`` names in an import statement, wherever the statement is."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in modules:
                    yield submodule
                elif base in modules:
                    yield base


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules its imports load (itself left out)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module, path in modules.items():
        for target in _imported(module, path, modules):
            # the packages on the way to the target run first, unless the importer is inside them already
            parts = target.split(".")
            for depth in range(1, len(parts) + 1):
                step = ".".join(parts[:depth])
                if step in modules and step != module and not module.startswith(step + "."):
                    graph[module].add(step)
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_the_graph_sees_every_kind_of_import() -> None:
    """A lazy import, one under TYPE_CHECKING and a relative one all count (else the test below proves nothing)."""
    graph = import_graph()
    assert "staleness_metrics.engine.sink" in graph["staleness_metrics"]  # TYPE_CHECKING, relative
    assert "staleness_metrics.records.model" in graph["staleness_metrics.engine.sink"]
    assert "staleness_metrics.engine" in graph["staleness_metrics.metrics.compute"]  # the package on the way
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "modules that import each other (directly or around a loop):\n" + "\n".join(
        " <-> ".join(component) for component in found
    )


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_definitions(tree: ast.AST) -> set[str]:
    """The private names a module defines: functions, classes, attributes it assigns (``self._x = ...``), and
    names it binds at module or class level."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _is_private(node.name):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_private(node.attr):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _is_private(node.id):
            names.add(node.id)
    return names


def private_reads(trees: Mapping[str, ast.AST]) -> list[str]:
    """Where a module of ``trees`` (module name -> parsed source) reads a private name another of them
    defines: ``x._name`` with ``x`` other than ``self`` / ``cls``, or ``from .module import _name``.

    The rule, pragmatically: a module may touch the private names it defines itself (on any instance of its
    own classes too); another module's private names are off limits, so state a module owns is read and
    written through that module's methods. Private attributes of other libraries are not this test's
    business (their names are not defined in the package), nor are the tests'.
    """
    defined = {name: _private_definitions(tree) for name, tree in trees.items()}
    anywhere = set().union(*defined.values())
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                if node.attr in anywhere and node.attr not in defined[module]:
                    found.append(f"{module}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("staleness_")):
                found.extend(
                    f"{module}:{node.lineno}: import {alias.name}" for alias in node.names if _is_private(alias.name)
                )
    return found


def test_no_module_reads_another_modules_private_names() -> None:
    found = private_reads({name: ast.parse(path.read_text(encoding="utf-8")) for name, path in _modules().items()})
    assert not found, "private names read outside the module that defines them:\n" + "\n".join(found)


def test_private_reads_are_seen() -> None:
    """The check above finds what it looks for, and lets a module's own private names be."""
    trees = {
        "pkg.sink": ast.parse("class Sink:\n    def __init__(self):\n        self._window = 0\n"),
        "pkg.checkpoint": ast.parse("from .sink import _helper\ndef save(sink):\n    return sink._window\n"),
        "pkg.table": ast.parse(
            "class T:\n    def __init__(self):\n        self._rows = 1\n    def merge(self, other):\n"
            "        return other._rows + self._rows\n"
        ),
        "pkg.other": ast.parse("def f(row):\n    return row._asdict()\n"),  # a name no module defines
    }
    assert private_reads(trees) == ["pkg.checkpoint:1: import _helper", "pkg.checkpoint:3: ._window"]
