"""The package's layout stays one-way: no module imports itself back through others, and each part imports only
from the layers below it.

The import graph is read from the source with ``ast``, counting every import: at the top of a module,
under ``TYPE_CHECKING`` and inside functions (a lazy import still ties two modules together). Importing
``a.b.c`` also runs the ``__init__`` of ``a.b`` when the importer is not inside it, so those count too.

The layers, lowest first (a part may import its own layer's other parts and every part below; the parts of one
layer must not import each other around a loop)::

    errors, config, compiled, parallel, state_checks,   the base: no concept of the domain
    files
    records                                             SPEC 3 rollouts, checked, columnar
    metrics                                             what a decision means: sums, bound, catalogue
    engine                                              spans, policies, the queue and the sink (which reports)
    exporters                                           Prometheus, OTLP, W&B, JSONL, console
    monitor                                             the training loop's face
    replay, adapters, server, cli, demo, html_report,   the surfaces
    dashboards, migrate, client
    staleness_metrics (the public face), __main__

The issue that asked for this matrix listed the engine before the metrics; the sink computes a ship's report
(``metrics.compute``) and saves the bound tracker and the tallies in its checkpoint, while the metrics read a
shipped slice as named columns of their own (``compute.ShippedSlice``): so the metrics sit under the engine.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "staleness_metrics"

LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"errors", "config", "compiled", "parallel", "state_checks", "files"}),
    frozenset({"records"}),
    frozenset({"metrics"}),
    frozenset({"engine"}),
    frozenset({"exporters"}),
    frozenset({"monitor"}),
    frozenset(
        {"replay", "adapters", "server", "cli", "demo", "html_report", "dashboards", "migrate", "client", "distributed"}
    ),
    frozenset({"__init__", "__main__"}),
)


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {_module_name(path, package): path for path in sorted(package.rglob("*.py"))}


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


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules its imports load (itself left out)."""
    modules = _modules(package)
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


def part_of(module: str) -> str:
    """The part a module belongs to: its subpackage (``engine``), its own name for a module at the top
    (``errors``), ``__init__`` for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def part_graph(graph: Mapping[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """Part -> the other parts it imports -> the imports that do (``module -> module``)."""
    parts: dict[str, dict[str, list[str]]] = {}
    for module, targets in graph.items():
        parts.setdefault(part_of(module), {})
        for target in sorted(targets):
            if part_of(target) != part_of(module):
                parts[part_of(module)].setdefault(part_of(target), []).append(f"{module} -> {target}")
    return parts


def layer_violations(graph: Mapping[str, set[str]], layers: Sequence[frozenset[str]] = LAYERS) -> list[str]:
    """The imports that go up the ``layers`` (or name a part no layer holds)."""
    level = {part: i for i, layer in enumerate(layers) for part in layer}
    found = []
    for part, targets in sorted(part_graph(graph).items()):
        if part not in level:
            found.append(f"{part}: in no layer")
            continue
        for target, imports in sorted(targets.items()):
            if target not in level:
                found.extend(f"{part} imports {target} (in no layer): {line}" for line in imports)
            elif level[target] > level[part]:
                found.extend(f"{part} imports {target} (a higher layer): {line}" for line in imports)
    return found


def test_the_graph_sees_every_kind_of_import() -> None:
    """A lazy import, one under TYPE_CHECKING and a relative one all count (else the test below proves nothing)."""
    graph = import_graph()
    assert "staleness_metrics.engine.sink" in graph["staleness_metrics"]  # TYPE_CHECKING, relative
    assert "staleness_metrics.records.model" in graph["staleness_metrics.engine.sink"]
    assert "staleness_metrics.metrics" in graph["staleness_metrics.engine.judging"]  # the package on the way
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "modules that import each other (directly or around a loop):\n" + "\n".join(
        " <-> ".join(component) for component in found
    )


def test_each_part_imports_only_from_its_layer_and_below() -> None:
    found = layer_violations(import_graph())
    assert not found, "imports against the layers:\n" + "\n".join(found)


def test_no_cycle_between_parts() -> None:
    parts = {part: set(targets) for part, targets in part_graph(import_graph()).items()}
    found = cycles(parts)
    assert not found, "parts that import each other (directly or around a loop):\n" + "\n".join(
        " <-> ".join(component) for component in found
    )


def test_every_part_is_in_a_layer() -> None:
    assert set(part_graph(import_graph())) <= set().union(*LAYERS)


def _fake_package(root: Path, files: Mapping[str, str]) -> Path:
    package = root / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return package


def test_the_layer_check_finds_an_import_up_the_layers_and_a_loop(tmp_path: Path) -> None:
    """On a tiny package: a lazy import from the lower part to the higher one is an import against the layers and
    a loop between the two parts; the same tree without it passes."""
    files = {
        "low/__init__.py": "",
        "low/core.py": "def f():\n    from ..high.face import g\n    return g\n",
        "high/__init__.py": "",
        "high/face.py": "from ..low.core import f\ndef g():\n    return f\n",
        "base.py": "",
    }
    layers = (frozenset({"base"}), frozenset({"low"}), frozenset({"high", "__init__"}))
    graph = import_graph(_fake_package(tmp_path / "bad", files))
    assert layer_violations(graph, layers) == [
        "low imports high (a higher layer): pkg.low.core -> pkg.high",
        "low imports high (a higher layer): pkg.low.core -> pkg.high.face",
    ]
    assert cycles({part: set(targets) for part, targets in part_graph(graph).items()}) == [["high", "low"]]
    files["low/core.py"] = "from .. import base\ndef f():\n    return base\n"
    graph = import_graph(_fake_package(tmp_path / "good", files))
    assert layer_violations(graph, layers) == []
    assert layer_violations(graph, (frozenset({"low"}), frozenset({"high"}))) == [
        "__init__: in no layer",
        "base: in no layer",
        "low imports base (in no layer): pkg.low.core -> pkg.base",
    ]


def parameter_counts(package: Path = PACKAGE) -> dict[str, int]:
    """``module:function`` -> how many parameters it takes (``self`` / ``cls`` left out), for every function."""
    counts = {}
    for module, path in _modules(package).items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
                names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
                counts[f"{module}:{node.name}"] = len([n for n in names[:1] if n not in ("self", "cls")] + names[1:])
    return counts


def test_few_functions_take_twelve_parameters_or_more() -> None:
    """Issue 33: at most four functions of 12 parameters or more (16 before; a compiled loop takes small groups
    of arrays, a ``NamedTuple`` at its Python face and plain tuples to the loop)."""
    many = sorted(name for name, count in parameter_counts().items() if count >= 12)
    assert len(many) <= 4, many


def test_parameters_are_counted(tmp_path: Path) -> None:
    package = _fake_package(tmp_path, {"m.py": "class C:\n    def f(self, a, *b, c, **d): ...\ndef g(x, y=1): ...\n"})
    assert parameter_counts(package) == {"pkg.m:f": 4, "pkg.m:g": 2}


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
