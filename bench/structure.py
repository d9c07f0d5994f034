"""The package's structure as numbers (issue 33, item 6), each beside its goal.

    python bench/structure.py [--package DIR] [--list] [--json] [FILE ...]

- **lines**: every line of every ``.py`` file in the package (blank lines and comments too).
  Goal: <= 24,000.
- **modules over 700 lines**, the metric catalogue (``metrics/metric_table.py``) left out. Goal: none.
- **functions over 100 lines**, from the ``def`` (or its first decorator) to its last line; a nested
  function counts on its own and inside the one around it. Goal: <= 2.
- **functions of 12 parameters or more** (``self`` / ``cls`` left out; counted as
  ``tests/test_layout.py`` counts them). Goal: <= 4.
- **cycles between subpackages**: the loops of the import graph ``tests/test_layout.py`` reads, taken
  part by part (``engine``, ``records``, ...). Goal: none.
- **lines over 100 characters**, as a share of the lines. Goal: <= 3%.

``--list`` names what misses a goal (and the files with the most long lines); ``FILE ...`` (paths or
directories) also prints the line counts of just those files, to follow one's own part of the work.
``bench/rewrap.py`` rewraps the comments, docstrings and string literals over 100 characters.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.test_layout: the import graph

from tests.test_layout import PACKAGE, cycles, import_graph, parameter_counts, part_graph

CATALOGUE = "metrics/metric_table.py"
MODULE_LINES = 700
FUNCTION_LINES = 100
PARAMETERS = 12
LINE_CHARACTERS = 100
GOALS = {
    "lines": 24_000,
    "modules_over_700": 0,
    "functions_over_100": 2,
    "functions_of_12_parameters": 4,
    "cycles_between_subpackages": 0,
    "share_over_100_characters": 0.03,
}


@dataclass
class Lines:
    """How many lines some files have, and how many of them are over ``LINE_CHARACTERS``."""

    lines: int = 0
    long: int = 0
    long_by_file: dict[str, int] = field(default_factory=dict)

    @property
    def share(self) -> float:
        return self.long / self.lines if self.lines else 0.0

    def count(self, name: str, text: str) -> None:
        lines = text.splitlines()
        long = sum(len(line) > LINE_CHARACTERS for line in lines)
        self.lines += len(lines)
        self.long += long
        if long:
            self.long_by_file[name] = long


def count_lines(files: Iterable[Path], root: Path | None = None) -> Lines:
    counted = Lines()
    for path in files:
        name = path.relative_to(root) if root else path
        counted.count(name.as_posix(), path.read_text(encoding="utf-8"))
    return counted


def long_functions(path: Path, name: str) -> Iterator[tuple[str, int]]:
    """``file:function`` (``Class.method`` for a method) -> its lines, for those over ``FUNCTION_LINES``."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                length = (child.end_lineno or child.lineno) - start + 1
                if length > FUNCTION_LINES:
                    yield f"{name}:{prefix}{child.name}", length
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(path.read_text(encoding="utf-8")), "")


@dataclass
class Structure:
    lines: Lines
    long_modules: dict[str, int]
    long_functions: dict[str, int]
    many_parameters: dict[str, int]
    subpackage_cycles: list[list[str]]

    def numbers(self) -> dict[str, float]:
        return {
            "lines": self.lines.lines,
            "modules_over_700": len(self.long_modules),
            "functions_over_100": len(self.long_functions),
            "functions_of_12_parameters": len(self.many_parameters),
            "cycles_between_subpackages": len(self.subpackage_cycles),
            "share_over_100_characters": round(self.lines.share, 4),
        }


def measure(package: Path = PACKAGE) -> Structure:
    files = sorted(package.rglob("*.py"))
    lines = count_lines(files, package)
    long_modules = {}
    functions: dict[str, int] = {}
    for path in files:
        name = path.relative_to(package).as_posix()
        length = len(path.read_text(encoding="utf-8").splitlines())
        if length > MODULE_LINES and name != CATALOGUE:
            long_modules[name] = length
        functions.update(long_functions(path, name))
    many = {name: n for name, n in parameter_counts(package).items() if n >= PARAMETERS}
    parts = {part: set(targets) for part, targets in part_graph(import_graph(package)).items()}
    return Structure(lines, long_modules, functions, many, cycles(parts))


def python_files(paths: Iterable[str]) -> list[Path]:
    found: list[Path] = []
    for text in paths:
        path = Path(text)
        found.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return found


def _report(structure: Structure, listed: bool) -> None:
    for key, value in structure.numbers().items():
        goal = GOALS[key]
        met = "ok " if value <= goal else "MISS"
        shown = f"{value:.1%}" if isinstance(goal, float) else f"{value:,}"
        wanted = f"{goal:.0%}" if isinstance(goal, float) else f"{goal:,}"
        print(f"{met} {key.replace('_', ' '):32} {shown:>8}   (goal <= {wanted})")
    if not listed:
        return
    for title, found in (
        ("modules over 700 lines", structure.long_modules),
        ("functions over 100 lines", structure.long_functions),
        ("functions of 12 parameters or more", structure.many_parameters),
    ):
        if found:
            print(f"\n{title}:")
            for name, count in sorted(found.items(), key=lambda item: -item[1]):
                print(f"  {count:5}  {name}")
    for component in structure.subpackage_cycles:
        print("\ncycle: " + " <-> ".join(component))
    by_file = sorted(structure.lines.long_by_file.items(), key=lambda item: -item[1])
    print("\nfiles with the most lines over 100 characters:")
    for name, count in by_file[:25]:
        print(f"  {count:5}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", help="also count the lines of these files or directories")
    parser.add_argument("--package", type=Path, default=PACKAGE, help="the package directory to measure")
    parser.add_argument("--list", action="store_true", help="name what misses a goal")
    parser.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    args = parser.parse_args()
    structure = measure(args.package.resolve())
    files = count_lines(python_files(args.files)) if args.files else None
    if args.json:
        out: dict[str, object] = {"numbers": structure.numbers(), "goals": GOALS}
        if files is not None:
            out["files"] = asdict(files)
        print(json.dumps(out))
        return
    _report(structure, args.list)
    if files is not None:
        print(f"\nthe files given: {files.lines:,} lines, {files.long:,} over 100 characters ({files.share:.1%})")


if __name__ == "__main__":
    main()
