"""A parsed document that knows where each value sits in the text, so that edits replace only
the changed values (dumping a parsed file would reformat it)."""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

__all__ = [
    "Edit",
    "LineIndex",
    "Mapping",
    "Node",
    "Path",
    "Scalar",
    "Sequence",
    "Syntax",
    "apply_edits",
    "substitute_names",
    "walk",
]

# keys and list indices from the document root (the first item: document index)
Path = tuple[object, ...]


@dataclass
class Scalar:
    start: int
    end: int
    value: object
    style: str  # "json", or YAML's "plain", "'", '"', "|", ">"
    # inside a flow collection ({...} or [...]), where plain scalars are restricted
    in_flow: bool = False


@dataclass
class Mapping:
    start: int
    end: int
    items: list[tuple[Scalar, Node]] = field(default_factory=list)
    flow: bool = True


@dataclass
class Sequence:
    start: int
    end: int
    items: list[Node] = field(default_factory=list)
    flow: bool = True


Node: TypeAlias = Scalar | Mapping | Sequence


def walk(node: Node, path: Path, key: Scalar | None = None) -> Iterator[tuple[Path, Node, Scalar | None]]:
    """Every node under ``node`` with its path, and its key scalar when it is a mapping's value."""
    yield path, node, key
    if isinstance(node, Mapping):
        for item_key, value in node.items:
            yield from walk(value, (*path, item_key.value), item_key)
    elif isinstance(node, Sequence):
        for index, item in enumerate(node.items):
            yield from walk(item, (*path, index))


def substitute_names(raw: str, renames: dict[str, str]) -> str:
    """``raw`` with each old name replaced where it stands as a whole name."""
    if not renames:
        return raw
    names = sorted(renames, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w/:])(?:" + "|".join(re.escape(n) for n in names) + r")(?![\w/:])")
    return pattern.sub(lambda m: renames[m.group()], raw)


@dataclass(frozen=True)
class Edit:
    """Replace ``text[start:end]`` with ``replacement``."""

    start: int
    end: int
    replacement: str


def apply_edits(text: str, edits: Iterable[Edit]) -> str:
    ordered = sorted(edits, key=lambda e: (e.start, e.end))
    for before, after in itertools.pairwise(ordered):
        if after.start < before.end:
            raise ValueError(f"overlapping edits at offsets {before.start}-{before.end} and {after.start}")
    parts: list[str] = []
    position = 0
    for edit in ordered:
        parts.append(text[position : edit.start])
        parts.append(edit.replacement)
        position = edit.end
    parts.append(text[position:])
    return "".join(parts)


class LineIndex:
    """1-based line numbers of character offsets."""

    def __init__(self, text: str) -> None:
        self._starts = [0] + [i + 1 for i, ch in enumerate(text) if ch == "\n"]

    def line(self, offset: int) -> int:
        return bisect.bisect_right(self._starts, offset)

    def line_start(self, offset: int) -> int:
        return self._starts[self.line(offset) - 1]


class Syntax(Protocol):
    """A file format the structured migration can edit in place."""

    name: str

    def parse(self, text: str) -> list[Node]:
        """The documents as node trees (``ValueError`` with a readable message)."""

    def load(self, text: str) -> list[object]:
        """The documents as plain Python data."""

    def render(self, text: str, scalar: Scalar, new_value: str, renames: dict[str, str]) -> str | None:
        """Source text for ``scalar`` holding ``new_value``, keeping its quoting where ``renames``
        applied to it give that value (None when it cannot be written safely)."""

    def remove(self, text: str, parent: Sequence, indices: list[int]) -> list[Edit] | None:
        """Edits deleting ``parent.items[i]`` for each index (None when not safely possible)."""

    def comments(self, text: str, roots: list[Node]) -> list[tuple[int, int]]:
        """Spans of the comments in ``text``."""
