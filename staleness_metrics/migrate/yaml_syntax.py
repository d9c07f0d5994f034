"""YAML with positions, from ruamel.yaml's composer: every node keeps its start and end offsets."""

from __future__ import annotations

import json
import re
from typing import Any

from .json_syntax import spans_removal
from .model import MissingParser
from .tree import Edit, LineIndex, Mapping, Node, Scalar, Sequence, substitute_names

__all__ = ["YAML_SYNTAX", "YamlSyntax"]

_STR_TAG = "tag:yaml.org,2002:str"
_COMMENT_START = re.compile(r"(?:^|(?<=[ \t]))#", re.MULTILINE)


def _yaml() -> Any:
    try:
        from ruamel.yaml import YAML  # optional dependency (the cli extra)
    except ImportError as exc:
        raise MissingParser("YAML", "ruamel.yaml") from exc
    return YAML(typ="safe", pure=True)


def _decode(raw: str, in_flow: bool) -> object:
    """The value of a scalar's source text, read the way its surroundings would read it."""
    try:
        if in_flow:
            return _yaml().load("k: [" + raw + "]")["k"][0]
        return _yaml().load("k: " + raw)["k"]
    except Exception:  # any parse failure means "not this text"
        return _Unreadable


class _Unreadable:
    pass


def _content_end(node: Node) -> int:
    """Where a node's own content ends (trailing comments and blank lines excluded)."""
    if isinstance(node, Scalar) or node.flow:
        return node.end
    if isinstance(node, Mapping):
        return max((_content_end(value) for _, value in node.items), default=node.start)
    return max((_content_end(item) for item in node.items), default=node.start)


class YamlSyntax:
    name = "YAML"

    def parse(self, text: str) -> list[Node]:
        yaml = _yaml()
        try:
            documents = list(yaml.compose_all(text))
        except Exception as exc:  # ruamel raises its own error classes; all mean "not YAML"
            raise ValueError(str(exc)) from exc
        return [self._convert(yaml, doc, in_flow=False) for doc in documents if doc is not None]

    def _convert(self, yaml: Any, node: Any, in_flow: bool) -> Node:
        from ruamel.yaml.nodes import MappingNode, ScalarNode, SequenceNode

        start, end = node.start_mark.index, node.end_mark.index
        if isinstance(node, ScalarNode):
            value = node.value if node.tag == _STR_TAG else yaml.constructor.construct_object(node)
            return Scalar(start, end, value, node.style or "plain", in_flow)
        if isinstance(node, MappingNode):
            flow = bool(node.flow_style)
            mapping = Mapping(start, end, flow=flow)
            for key, value in node.value:
                key_node = self._convert(yaml, key, in_flow or flow)
                if not isinstance(key_node, Scalar):
                    raise ValueError(f"line {key.start_mark.line + 1}: complex mapping keys are not supported")
                mapping.items.append((key_node, self._convert(yaml, value, in_flow or flow)))
            return mapping
        assert isinstance(node, SequenceNode)
        flow = bool(node.flow_style)
        sequence = Sequence(start, end, flow=flow)
        sequence.items = [self._convert(yaml, item, in_flow or flow) for item in node.value]
        return sequence

    def load(self, text: str) -> list[object]:
        try:
            return [doc for doc in _yaml().load_all(text) if doc is not None]
        except Exception as exc:  # ruamel's own error classes
            raise ValueError(str(exc)) from exc

    def render(self, text: str, scalar: Scalar, new_value: str, renames: dict[str, str]) -> str | None:
        raw = text[scalar.start : scalar.end]
        candidates = [substitute_names(raw, renames)]
        if scalar.style not in ("|", ">"):
            if "\n" in new_value or scalar.style == '"':
                candidates.append(json.dumps(new_value, ensure_ascii=False))
            if scalar.style == "plain":
                candidates.append(new_value)
            candidates.append("'" + new_value.replace("'", "''") + "'")
        for candidate in candidates:
            if _decode(candidate, scalar.in_flow) == new_value:
                return candidate
        return None

    def remove(self, text: str, parent: Sequence, indices: list[int]) -> list[Edit] | None:
        if parent.flow:
            opening = text.find("[", parent.start)
            spans = [(item.start, item.end) for item in parent.items]
            return spans_removal(text, spans, indices, opening + 1, parent.end - 1)
        lines = LineIndex(text)
        begins = [self._item_begin(text, lines, item) for item in parent.items]
        if any(begin is None for begin in begins):
            return None
        if set(indices) >= set(range(len(parent.items))):
            first = begins[0]
            assert first is not None
            end = _content_end(parent.items[-1])
            end -= text[end - 1 : end] == "\n"  # a block scalar's span includes its line break
            return [Edit(text.index("-", first), end, "[]")]
        edits = []
        for index in indices:
            begin = begins[index]
            assert begin is not None
            end = _content_end(parent.items[index])
            if text[end - 1 : end] != "\n":
                newline = text.find("\n", end)
                end = len(text) if newline < 0 else newline + 1
            edits.append(Edit(begin, end, ""))
        return edits

    @staticmethod
    def _item_begin(text: str, lines: LineIndex, item: Node) -> int | None:
        """The start of the line holding a block sequence entry's ``-`` (None: not alone there)."""
        position = item.start - 1
        while position >= 0 and text[position] in " \t\r\n":
            position -= 1
        if position < 0 or text[position] != "-":
            return None
        begin = lines.line_start(position)
        if text[begin:position].strip():
            return None  # "key: - x" or a nested "- - x": not a line of its own
        return begin

    def comments(self, text: str, roots: list[Node]) -> list[tuple[int, int]]:
        spans: list[tuple[int, int]] = []
        for root in roots:
            _scalar_spans(root, spans)
        spans.sort()
        found = []
        span_index = 0
        for match in _COMMENT_START.finditer(text):
            position = match.start()
            while span_index < len(spans) and spans[span_index][1] <= position:
                span_index += 1
            if span_index < len(spans) and spans[span_index][0] <= position:
                continue  # a '#' inside a scalar
            newline = text.find("\n", position)
            found.append((position, len(text) if newline < 0 else newline))
        return found


def _scalar_spans(node: Node, spans: list[tuple[int, int]]) -> None:
    if isinstance(node, Scalar):
        spans.append((node.start, node.end))
    elif isinstance(node, Mapping):
        for key, value in node.items:
            spans.append((key.start, key.end))
            _scalar_spans(value, spans)
    else:
        for item in node.items:
            _scalar_spans(item, spans)


YAML_SYNTAX = YamlSyntax()
