"""JSON with positions: a small reader that keeps the offset of every value, for in-place edits.

The standard library parses first (its error messages are the ones users know); this reader then
walks the same, known-valid text to record where each value starts and ends.
"""

from __future__ import annotations

import json
import re

from .tree import Edit, Mapping, Node, Scalar, Sequence, substitute_names

__all__ = ["JSON", "JsonSyntax", "parse_json_nodes"]

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = {"true": True, "false": False, "null": None}


class _Reader:
    """Walks text ``json.loads`` accepted, so only NaN and Infinity (which it also accepts) fail."""

    def __init__(self, text: str) -> None:
        self.text = text

    def skip(self, position: int) -> int:
        match = _WHITESPACE.match(self.text, position)
        assert match is not None
        return match.end()

    def value(self, position: int) -> tuple[Node, int]:
        position = self.skip(position)
        char = self.text[position : position + 1]
        if char in ("{", "["):
            return self.collection(Mapping(position, position) if char == "{" else Sequence(position, position))
        if char == '"':
            return self.string(position)
        for literal, value in _LITERALS.items():
            if self.text.startswith(literal, position):
                end = position + len(literal)
                return Scalar(position, end, value, "json"), end
        match = _NUMBER.match(self.text, position)
        if match is None:
            raise ValueError(f"unexpected character at offset {position}")
        return Scalar(position, match.end(), json.loads(match.group()), "json"), match.end()

    def string(self, position: int) -> tuple[Scalar, int]:
        match = _STRING.match(self.text, position)
        assert match is not None
        return Scalar(position, match.end(), json.loads(match.group()), "json"), match.end()

    def collection(self, node: Mapping | Sequence) -> tuple[Node, int]:
        close = "}" if isinstance(node, Mapping) else "]"
        position = self.skip(node.start + 1)
        while self.text[position] != close:
            if isinstance(node, Mapping):
                key, position = self.string(self.skip(position))
                value, position = self.value(self.skip(position) + 1)  # past the ':'
                node.items.append((key, value))
            else:
                item, position = self.value(position)
                node.items.append(item)
            position = self.skip(position)
            if self.text[position] == ",":
                position = self.skip(position + 1)
        node.end = position + 1
        return node, node.end


def parse_json_nodes(text: str) -> Node:
    """The node tree of one JSON value (raises ``ValueError`` on invalid JSON)."""
    json.loads(text)  # readable errors for invalid input
    return _Reader(text).value(0)[0]


def spans_removal(
    text: str, items: list[tuple[int, int]], indices: list[int], open_end: int, close_start: int
) -> list[Edit]:
    """Edits deleting the entries at ``indices`` of a comma-separated list (JSON, YAML flow),
    keeping the others' layout; ``items`` are the entries' spans, ``open_end``/``close_start``
    bound the list's inside."""
    doomed = set(indices)
    if doomed >= set(range(len(items))):
        return [Edit(open_end, close_start, "")]
    edits = []
    kept = [i for i in range(len(items)) if i not in doomed]
    for index in sorted(doomed):
        if any(k > index for k in kept):
            # up to the next entry: its comma and the whitespace before the next one go
            edits.append(Edit(items[index][0], items[index + 1][0], ""))
        else:
            # a trailing entry: from the end of the previous entry, so its leading comma goes too
            edits.append(Edit(items[index - 1][1], items[index][1], ""))
    return _merge(edits)


def _merge(edits: list[Edit]) -> list[Edit]:
    merged: list[Edit] = []
    for edit in sorted(edits, key=lambda e: e.start):
        if merged and edit.start <= merged[-1].end:
            last = merged.pop()
            merged.append(Edit(last.start, max(last.end, edit.end), ""))
        else:
            merged.append(edit)
    return merged


class JsonSyntax:
    name = "JSON"

    def parse(self, text: str) -> list[Node]:
        return [parse_json_nodes(text)]

    def load(self, text: str) -> list[object]:
        return [json.loads(text)]

    def render(self, text: str, scalar: Scalar, new_value: str, renames: dict[str, str]) -> str | None:
        raw = text[scalar.start : scalar.end]
        candidate = substitute_names(raw, renames)
        try:
            if json.loads(candidate) == new_value:
                return candidate
        except ValueError:
            pass
        return json.dumps(new_value, ensure_ascii="\\u" in raw)

    def remove(self, text: str, parent: Sequence, indices: list[int]) -> list[Edit] | None:
        spans = [(item.start, item.end) for item in parent.items]
        return spans_removal(text, spans, indices, parent.start + 1, parent.end - 1)

    def remove_members(self, text: str, parent: Mapping, indices: list[int]) -> list[Edit]:
        spans = [(key.start, value.end) for key, value in parent.items]
        return spans_removal(text, spans, indices, parent.start + 1, parent.end - 1)

    def comments(self, text: str, roots: list[Node]) -> list[tuple[int, int]]:
        return []


JSON = JsonSyntax()
