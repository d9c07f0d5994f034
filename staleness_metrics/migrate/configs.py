"""Configuration files (TOML, YAML, JSON): the renamed setting and legacy W&B keys, comments
included.

Edited as text, each legacy name replaced where it stands as a whole name, so every other byte
stays; the result must parse to the old data with the same names replaced, else it is left alone.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from .model import Action, FileKind, FileResult, Finding, MissingParser
from .names import Context, Hit, Scanner
from .tree import YAML_SYNTAX, LineIndex

ConfigFormat = Literal["toml", "yaml", "json"]

CONFIG_KINDS: dict[ConfigFormat, FileKind] = {
    "toml": FileKind.TOML_CONFIG,
    "yaml": FileKind.YAML_CONFIG,
    "json": FileKind.JSON_CONFIG,
}


def load_config(text: str, fmt: ConfigFormat) -> Any:
    """Plain data of a config file (raises ``ValueError`` with the parser's message)."""
    try:
        if fmt == "toml":
            import tomlkit  # optional dependency (the cli extra)

            return tomlkit.parse(text).unwrap()
        return YAML_SYNTAX.load(text) if fmt == "yaml" else json.loads(text)
    except ImportError as exc:
        raise MissingParser("TOML", "tomlkit") from exc
    except ValueError:
        raise
    except Exception as exc:  # tomlkit and ruamel raise their own error classes
        raise ValueError(str(exc)) from exc


class _Collision(Exception):
    pass


def _renamed(data: Any, scanner: Scanner) -> Any:
    """``data`` with the names in every key and string replaced, as the edit should leave it."""
    if isinstance(data, dict):
        out: dict[Any, Any] = {}
        for key, value in data.items():
            new_key = scanner.scan(key, Context.TEXT).text if isinstance(key, str) else key
            if new_key in out or (new_key != key and new_key in data):
                raise _Collision(f"both {key!r} and {new_key!r} are set; keep one of them, then run again")
            out[new_key] = _renamed(value, scanner)
        return out
    if isinstance(data, list):
        return [_renamed(item, scanner) for item in data]
    if isinstance(data, str):
        return scanner.scan(data, Context.TEXT).text
    return data


def migrate_config(path: str, text: str, fmt: ConfigFormat, scanner: Scanner) -> FileResult:
    result = FileResult(path, CONFIG_KINDS[fmt], original=text)
    try:
        old_data = load_config(text, fmt)
    except MissingParser as exc:
        result.error = str(exc)
        return result
    except ValueError as exc:
        result.error = f"cannot parse as {fmt.upper()}: {exc}"
        return result
    scanned = scanner.scan(text, Context.TEXT)
    lines = LineIndex(text)
    result.findings = [_finding(path, lines, hit) for hit in scanned.hits]
    if not scanned.changed:
        return result
    try:
        expected = _renamed(old_data, scanner)
    except _Collision as exc:
        result.findings = [
            Finding(f.path, f.line, f.old, f.new, Action.MANUAL, str(exc)) if f.action is Action.RENAME else f
            for f in result.findings
        ]
        return result
    try:
        new_data = load_config(scanned.text, fmt)
    except ValueError as exc:
        result.error = f"refusing to edit: the renamed text does not parse ({exc})"
        return result
    if new_data != expected:
        result.error = "refusing to edit: renaming in place would change more than the names (escaped text?)"
        return result
    result.new_text = scanned.text
    return result


def _finding(path: str, lines: LineIndex, hit: Hit) -> Finding:
    reason = hit.reason
    if hit.action is Action.REMOVED:
        reason += "; delete it from the config by hand"
    return Finding(path, lines.line(hit.start), hit.old, hit.new, hit.action, reason)
