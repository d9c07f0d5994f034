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


# The sink and its checkpoint still read each other until the queue saves its own state.
KNOWN_CYCLES = [["staleness_metrics.engine.checkpoint", "staleness_metrics.engine.sink"]]


def test_no_import_cycles() -> None:
    found = [component for component in cycles(import_graph()) if component not in KNOWN_CYCLES]
    assert not found, "modules that import each other (directly or around a loop):\n" + "\n".join(
        " <-> ".join(component) for component in found
    )
