"""JSON and YAML parsed into trees that know where each value sits in the text, so that edits
replace only the changed values (dumping a parsed file would reformat it)."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias

from .model import MissingParser

Path = tuple[object, ...]  # keys and list indices from the root (the first item: document index)
_Span = tuple[int, int]


@dataclass
class Scalar:
    start: int
    end: int
    value: object
    style: str  # "json", or YAML's "plain", "'", '"', "|", ">"
    in_flow: bool = False  # inside a flow collection ({...} or [...]): plain scalars are restricted
    alias: _Span | None = None  # a YAML alias's own ``*name`` (start and end: its anchor's text)


@dataclass
class Mapping:
    start: int
    end: int
    items: list[tuple[Scalar, Node]] = field(default_factory=list)
    flow: bool = True
    alias: _Span | None = None


@dataclass
class Sequence:
    start: int
    end: int
    items: list[Node] = field(default_factory=list)
    flow: bool = True
    alias: _Span | None = None


Node: TypeAlias = Scalar | Mapping | Sequence


def written_at(node: Node) -> _Span:
    """Where a node is written: an alias at its ``*name`` (edits go to its anchor's text)."""
    return node.alias or (node.start, node.end)


def walk(node: Node, path: Path, key: Scalar | None = None) -> Iterator[tuple[Path, Node, Scalar | None]]:
    yield path, node, key
    if isinstance(node, Mapping):
        for item_key, value in node.items:
            yield from walk(value, (*path, item_key.value), item_key)
    elif isinstance(node, Sequence):
        for index, item in enumerate(node.items):
            yield from walk(item, (*path, index))


def substitute_names(raw: str, renames: dict[str, str]) -> str:
    if not renames:
        return raw
    names = sorted(renames, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w/:])(?:" + "|".join(re.escape(n) for n in names) + r")(?![\w/:])")
    return pattern.sub(lambda m: renames[m.group()], raw)


@dataclass(frozen=True)
class Edit:
    start: int
    end: int
    replacement: str


def apply_edits(text: str, edits: Iterable[Edit]) -> str:
    parts: list[str] = []
    before = Edit(0, 0, "")
    for edit in sorted(edits, key=lambda e: (e.start, e.end)):
        if edit.start < before.end:
            raise ValueError(f"overlapping edits at offsets {before.start}-{before.end} and {edit.start}")
        parts += [text[before.end : edit.start], edit.replacement]
        before = edit
    parts.append(text[before.end :])
    return "".join(parts)


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


# -- JSON ------------------------------------------------------------------------------------------

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_NUMBER = r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?"
# a string, a literal or a number: json.loads reads the value
_SCALAR = re.compile(rf'"(?:[^"\\]|\\.)*"|true|false|null|NaN|-?Infinity|{_NUMBER}', re.DOTALL)
# NaN and Infinity (json.dumps writes them) as names: NaN != NaN, but data read twice must be equal
json_loads = functools.partial(json.loads, parse_constant=str)


class _Reader:
    """Walks text ``json.loads`` accepted."""

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
            return self.collection((Mapping if char == "{" else Sequence)(position, position))
        return self.scalar(position)

    def scalar(self, position: int) -> tuple[Scalar, int]:
        match = _SCALAR.match(self.text, position)
        if match is None:
            raise ValueError(f"unexpected character at offset {position}")
        return Scalar(position, match.end(), json_loads(match.group()), "json"), match.end()

    def collection(self, node: Mapping | Sequence) -> tuple[Node, int]:
        close = "}" if isinstance(node, Mapping) else "]"
        position = self.skip(node.start + 1)
        while self.text[position] != close:
            if isinstance(node, Mapping):
                key, position = self.scalar(self.skip(position))
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


def _spans_removal(items: list[_Span], indices: list[int], inside: _Span) -> list[Edit]:
    """Edits deleting the entries at ``indices`` of a comma-separated list (JSON, YAML flow)."""
    doomed = set(indices)
    if doomed >= set(range(len(items))):
        return [Edit(*inside, "")]
    edits = []
    kept = [i for i in range(len(items)) if i not in doomed]
    for index in sorted(doomed):
        if any(k > index for k in kept):
            # up to the next entry: its comma and the whitespace before the next one go
            edits.append(Edit(items[index][0], items[index + 1][0], ""))
        else:  # a trailing entry: from the end of the previous entry, so its leading comma goes too
            edits.append(Edit(items[index - 1][1], items[index][1], ""))
    return edits  # they touch at most: apply_edits takes them as they are


class JsonSyntax:
    name = "JSON"

    def read(self, text: str) -> tuple[list[Node], list[object]]:
        data = json_loads(text)  # first: its error messages are the ones users know
        return [_Reader(text).value(0)[0]], [data]

    def render(self, text: str, scalar: Scalar, new_value: str, renames: dict[str, str]) -> str:
        raw = text[scalar.start : scalar.end]
        candidate = substitute_names(raw, renames)
        with contextlib.suppress(ValueError):
            if json.loads(candidate) == new_value:
                return candidate
        return json.dumps(new_value, ensure_ascii="\\u" in raw)

    def remove(self, text: str, parent: Mapping | Sequence, indices: list[int]) -> list[Edit]:
        pairs = parent.items if isinstance(parent, Mapping) else [(i, i) for i in parent.items]
        spans = [(first.start, last.end) for first, last in pairs]
        return _spans_removal(spans, indices, (parent.start + 1, parent.end - 1))

    def comments(self, text: str, roots: list[Node]) -> list[tuple[int, int]]:
        return []


JSON = JsonSyntax()


# -- YAML ------------------------------------------------------------------------------------------

_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_COMMENT_START = re.compile(r"(?:^|(?<=[ \t]))#", re.MULTILINE)


def _yaml() -> Any:
    try:
        from ruamel.yaml import YAML  # optional dependency (the cli extra)
    except ImportError as exc:
        raise MissingParser("YAML", "ruamel.yaml") from exc
    return YAML(typ="safe", pure=True)


def _content_end(node: Node) -> int:
    """Where a node's own content ends (trailing comments and blank lines excluded)."""
    if node.alias or isinstance(node, Scalar) or node.flow:
        return written_at(node)[1]
    children = [value for _, value in node.items] if isinstance(node, Mapping) else node.items
    return max((_content_end(child) for child in children), default=node.start)


class YamlSyntax:
    name = "YAML"

    def read(self, text: str) -> tuple[list[Node], list[object]]:
        yaml = _yaml()
        aliases: dict[int, _Span] = {}  # id of an alias's copy of its anchor -> its ``*name``

        def alias(anchor: Any) -> Any:  # ruamel gives an alias its anchor's node, marks included
            event, node = yaml.composer.parser.last_event, copy.copy(anchor)
            aliases[id(node)] = (event.start_mark.index, event.end_mark.index)
            return node

        yaml.composer.return_alias = alias
        try:
            docs = list(yaml.compose_all(text))
        except Exception as exc:  # ruamel raises its own error classes; all mean "not YAML"
            raise ValueError(str(exc)) from exc
        data = self.load(text)  # first: it refuses what the tree assumes (a merge of a non-mapping)
        return [self._convert(yaml, doc, False, aliases) for doc in docs if doc is not None], data

    def _convert(self, yaml: Any, node: Any, in_flow: bool, aliases: dict[int, _Span]) -> Node:
        from ruamel.yaml.nodes import MappingNode, ScalarNode, SequenceNode

        start, end, alias = node.start_mark.index, node.end_mark.index, aliases.get(id(node))
        if isinstance(node, ScalarNode):
            value = node.value if node.tag == _STR_TAG else yaml.constructor.construct_object(node)
            return Scalar(start, end, value, node.style or "plain", in_flow, alias)
        flow = bool(node.flow_style)
        inner = in_flow or flow
        if isinstance(node, MappingNode):
            mapping = Mapping(start, end, flow=flow, alias=alias)
            merged: list[Any] = []  # ``<<: *anchor`` (or a list of them): entries the mapping lacks
            for key, value in node.value:
                if key.tag == _MERGE_TAG:
                    merged += value.value if isinstance(value, SequenceNode) else [value]
                    continue
                key_node = self._convert(yaml, key, inner, aliases)
                if not isinstance(key_node, Scalar):
                    raise ValueError(f"line {key.start_mark.line + 1}: complex mapping keys are not supported")
                mapping.items.append((key_node, self._convert(yaml, value, inner, aliases)))
            for source in merged:  # the first source of a key wins, as the loader reads them
                entries = self._convert(yaml, source, inner, aliases)
                assert isinstance(entries, Mapping)  # the loader refuses anything else
                own = {key.value for key, _ in mapping.items}
                # what ``<<: *anchor`` brings in is written here, at the ``*anchor``
                fresh = [(k, replace(v, alias=entries.alias or v.alias)) for k, v in entries.items]
                mapping.items += [item for item in fresh if item[0].value not in own]
            return mapping
        assert isinstance(node, SequenceNode)
        items = [self._convert(yaml, item, inner, aliases) for item in node.value]
        return Sequence(start, end, items, flow, alias)

    def load(self, text: str) -> list[object]:
        yaml = _yaml()  # outside the try: a missing parser is not a parse error
        try:
            return [doc for doc in yaml.load_all(text) if doc is not None]
        except Exception as exc:  # ruamel's own error classes
            raise ValueError(str(exc)) from exc

    def render(self, text: str, scalar: Scalar, new_value: str, renames: dict[str, str]) -> str | None:
        candidates = [substitute_names(text[scalar.start : scalar.end], renames)]
        if scalar.style not in ("|", ">"):
            if "\n" in new_value or scalar.style == '"':
                candidates.append(json.dumps(new_value, ensure_ascii=False))
            if scalar.style == "plain":
                candidates.append(new_value)
            candidates.append("'" + new_value.replace("'", "''") + "'")
        wrap = "k: [{}]" if scalar.in_flow else "k: {}"
        for candidate in candidates:
            # read the way the scalar's surroundings read it; a parse failure: not this text
            with contextlib.suppress(Exception):
                value = _yaml().load(wrap.format(candidate))["k"]
                if (value[0] if scalar.in_flow else value) == new_value:
                    return candidate
        return None

    def remove(self, text: str, parent: Sequence, indices: list[int]) -> list[Edit] | None:
        if parent.flow:
            opening = text.find("[", parent.start)
            spans = [written_at(item) for item in parent.items]
            return _spans_removal(spans, indices, (opening + 1, parent.end - 1))
        found = [self._item_begin(text, item) for item in parent.items]
        begins = [begin for begin in found if begin is not None]
        if len(begins) < len(found):
            return None
        if set(indices) >= set(range(len(parent.items))):
            end = _content_end(parent.items[-1])
            end -= text[end - 1 : end] == "\n"  # a block scalar's span includes its line break
            return [Edit(text.index("-", begins[0]), end, "[]")]
        edits = []
        for index in indices:
            end = _content_end(parent.items[index])
            if text[end - 1 : end] != "\n":
                newline = text.find("\n", end)
                end = len(text) if newline < 0 else newline + 1
            edits.append(Edit(begins[index], end, ""))
        return edits

    @staticmethod
    def _item_begin(text: str, item: Node) -> int | None:
        """The start of the line holding a block sequence entry's ``-`` (None: not alone there)."""
        position = written_at(item)[0] - 1
        while position >= 0 and text[position] in " \t\r\n":
            position -= 1
        if position < 0 or text[position] != "-":
            return None
        begin = text.rfind("\n", 0, position) + 1
        if text[begin:position].strip():
            return None  # "key: - x" or a nested "- - x": not a line of its own
        return begin

    def comments(self, text: str, roots: list[Node]) -> list[tuple[int, int]]:
        spans = sorted(
            (scalar.start, scalar.end)
            for root in roots
            for _, node, key in walk(root, ())
            for scalar in (node, key)
            if isinstance(scalar, Scalar)
        )
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


YAML_SYNTAX = YamlSyntax()


Syntax: TypeAlias = JsonSyntax | YamlSyntax  # a format the structured migration edits in place
