"""Reading JSONL files line by line into plain dicts, with the line number in every error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...errors import EventError

EventDict = dict[str, Any]  # a SPEC 9 event: {"type": "rollout" | "sweep" | "ship", ...}


def iter_json_lines(path: str | Path, torn: list[str] | None = None) -> Iterator[tuple[int, Any]]:
    """``(line_number, value)`` for every non-blank line; bad JSON: ``EventError`` naming the file
    (``torn`` given: a torn last line ends the file, one still being written, said in ``torn``)."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as error:
                if torn is not None and not line.endswith("\n"):
                    return torn.append(f"{path}: a torn last line (line {number}), read as the end")
                raise EventError(number, f"{path}: bad JSON ({error.msg} at column {error.colno})") from None


def read_event_file(path: str | Path) -> Iterator[EventDict]:
    """The SPEC 9 event stream of a JSONL file, as dicts (the sink validates their content)."""
    for number, value in iter_json_lines(path):
        if not isinstance(value, dict):
            raise EventError(number, f"expected a JSON object, got {type(value).__name__}")
        yield value
