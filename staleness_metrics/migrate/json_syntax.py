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
    def __init__(self, text: str) -> None:
        self.text = text

    def skip(self, position: int) -> int:
        match = _WHITESPACE.match(self.text, position)
        assert match is not None
        return match.end()

    def value(self, position: int) -> tuple[Node, int]:
        position = self.skip(position)
        char = self.text[position : position + 1]
        if char == "{":
            return self.mapping(position)
        if char == "[":
            return self.sequence(position)
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
        if match is None:
            raise ValueError(f"unterminated string at offset {position}")
        return Scalar(position, match.end(), json.loads(match.group()), "json"), match.end()

    def mapping(self, start: int) -> tuple[Mapping, int]:
        node = Mapping(start, start)
        position = self.skip(start + 1)
        if self.text[position] == "}":
            node.end = position + 1
            return node, node.end
        while True:
            key, position = self.string(self.skip(position))
            position = self.skip(position)
            if self.text[position] != ":":
                raise ValueError(f"expected ':' at offset {position}")
            value, position = self.value(position + 1)
            node.items.append((key, value))
            position = self.skip(position)
            if self.text[position] == "}":
                node.end = position + 1
                return node, node.end
            if self.text[position] != ",":
                raise ValueError(f"expected ',' or '}}' at offset {position}")
            position += 1

    def sequence(self, start: int) -> tuple[Sequence, int]:
        node = Sequence(start, start)
        position = self.skip(start + 1)
        if self.text[position] == "]":
            node.end = position + 1
            return node, node.end
        while True:
            item, position = self.value(position)
            node.items.append(item)
            position = self.skip(position)
            if self.text[position] == "]":
                node.end = position + 1
                return node, node.end
            if self.text[position] != ",":
                raise ValueError(f"expected ',' or ']' at offset {position}")
            position += 1


def parse_json_nodes(text: str) -> Node:
    """The node tree of one JSON value (raises ``ValueError`` on invalid JSON)."""
    json.loads(text)  # readable errors for invalid input
    node, end = _Reader(text).value(0)
    if text[end:].strip():
        raise ValueError(f"extra data at offset {end}")
    return node


def spans_removal(
    text: str, items: list[tuple[int, int]], indices: list[int], open_end: int, close_start: int
) -> list[Edit]:
    """Edits deleting the items at ``indices`` of a comma-separated list,
    keeping the others' layout.

    ``items`` are the (start, end) spans of all entries; ``open_end``/``close_start`` bound the
    list's inside. Shared with YAML flow collections, which separate entries the same way.
    """
    doomed = set(indices)
    if doomed >= set(range(len(items))):
        return [Edit(open_end, close_start, "")]
    edits = []
    kept = [i for i in range(len(items)) if i not in doomed]
    for index in sorted(doomed):
        later_kept = [k for k in kept if k > index]
        if later_kept:
            # from this entry up to the next entry: its comma and the
            # whitespace before the next one go
            next_start = items[index + 1][0]
            edits.append(Edit(items[index][0], next_start, ""))
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
