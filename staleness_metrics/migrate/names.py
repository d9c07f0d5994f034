"""Find legacy names (or, for ``migrate --from PEER``, a peer framework's keys) inside one string
and rewrite them, the string read as free text, PromQL or a key regex (the file kinds say which)."""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..config import RENAMED_SETTINGS
from ..metrics.metric_table import LEGACY_KEYS, LEGACY_NAMESPACE, REMOVED_KEY_FAMILIES, metric_by_key
from . import legacy
from .model import Action, Options
from .peers import TRACKER_SUFFIXES, PeerKey, peer_keys
from .tree import Edit, apply_edits


class Context(enum.Enum):
    TEXT = "text"  # names anywhere in free text: titles, legends, comments, config strings
    PROMQL = "promql"  # a PromQL expression: series names outside string literals
    REGEX = "regex"  # a W&B key regex (a panel's metric_regex)


@dataclass(frozen=True)
class Hit:
    start: int
    end: int
    old: str
    new: str | None
    action: Action
    reason: str


@dataclass(frozen=True)
class Scanned:
    """The string with every ``RENAME`` hit replaced, and all hits."""

    text: str
    hits: tuple[Hit, ...]
    live: bool = False  # PromQL: it also reads a series that is not legacy

    @property
    def changed(self) -> bool:
        return any(hit.action is Action.RENAME for hit in self.hits)


def _alternation(names: Sequence[str]) -> str:
    # longest first, so a key is never cut short by a shorter key it starts with
    return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))


_FAMILIES = "|".join(re.escape(prefix) + r"\w+(?:/\w+)*" for prefix in REMOVED_KEY_FAMILIES)
_WANDB_KEY = rf"(?<![\w/])(?:{_alternation(list(LEGACY_KEYS))}|{_FAMILIES})(?![\w/])"
UNMAPPED = "old off_policy/ namespace, no known mapping"  # _NAMESPACE's other names: reported only
# a brace list (``{mean,max}``) is part of the name: its commas do not end it
_NAME_TAIL = r"(?:\{[^\s{}\"'`]*\}|[^\s\"'`,;)\]}])*"
_NAMESPACE = rf"(?<![\w/])(?:{_alternation([LEGACY_NAMESPACE, *REMOVED_KEY_FAMILIES])}){_NAME_TAIL}"
_RENAMED_SETTINGS = {**RENAMED_SETTINGS, **legacy.RENAMED_SETTING_FLAGS}
_TABLES = {  # match group -> (old name -> new name, reason)
    "setting": (_RENAMED_SETTINGS, "renamed setting"),
    "console": (legacy.CONSOLE_LABELS, "console label"),
}
_SETTING = rf"(?<!\w)(?:{_alternation(list(_RENAMED_SETTINGS))})(?![\w-])"
_CONSOLE = rf"(?<!\w)(?:{_alternation(list(legacy.CONSOLE_LABELS))})(?!\w)"
_IDENT = r"(?<![\w:/.$-])[A-Za-z_:][\w:]*(?![\w/])"

_TEXT_PATTERN = re.compile(
    rf"(?P<key>{_WANDB_KEY})|(?P<ns>{_NAMESPACE})|(?P<setting>{_SETTING})|(?P<console>{_CONSOLE})|(?P<ident>{_IDENT})"
)
# PromQL: string literals and comments are skipped (except the value of a __name__ matcher).
_PROMQL_TOKEN = re.compile(
    r"(?P<str>\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|`[^`]*`)"
    r"|(?P<comment>#[^\n]*)"
    r"|(?P<ident>[A-Za-z_:][\w:]*)"
    r"|(?P<op>=~|!~|!=|=)"
    r"|(?P<other>.)",
    re.DOTALL,
)
# not series: grouping labels (and their aggregation), ranges, numbers, Grafana variables, keywords
_NOT_SERIES = re.compile(
    r"(?:\w+\s*)?\b(?:by|without|on|ignoring|group_\w+)\s*\([^)]*\)|\[[^]]*]|\d\w*|\$\{?\w+"
    r"|(?i:\b(?:and|or|unless|bool|offset|group_left|group_right|atan2|inf|nan)\b)"
)


class Scanner:
    """Scans strings for legacy names (``prometheus``: series names in free text too)."""

    def __init__(self, *, prometheus: bool, prefixes: Sequence[str] = legacy.DEFAULT_PROMETHEUS_PREFIXES):
        self.prometheus, self.prefixes = prometheus, tuple(prefixes)

    def scan(self, text: str, context: Context) -> Scanned:
        if context is Context.PROMQL:
            return self._scan_promql(text)
        if context is Context.REGEX:
            return self._scan_regex(text, "wandb")
        hits = self._text_hits(text)
        return Scanned(apply_renames(text, hits), tuple(hits))

    def _text_hits(self, text: str) -> list[Hit]:
        hits: list[Hit] = []
        for match in _TEXT_PATTERN.finditer(text):
            token = match.group()
            start, end = match.span()
            if match.lastgroup == "key":
                found = legacy.migrate_key(token)
                assert found is not None
                action = Action.REMOVED if found.new is None else Action.RENAME
                hits.append(Hit(start, end, token, found.new, action, found.reason or "renamed"))
            elif match.lastgroup == "ns":
                token = token.rstrip(".:")
                reason = next((f"{f}*: {r}" for f, r in REMOVED_KEY_FAMILIES.items() if token.startswith(f)), UNMAPPED)
                hits.append(Hit(start, start + len(token), token, None, Action.MANUAL, reason))
            elif match.lastgroup in _TABLES:
                table, reason = _TABLES[match.lastgroup]
                hits.append(Hit(start, end, token, table[token], Action.RENAME, reason))
            elif self.prometheus and (hit := self._prometheus_hit(token, start)) is not None:
                hits.append(hit)
        return hits

    def _prometheus_hit(self, token: str, start: int) -> Hit | None:
        end = start + len(token)
        if ":" in token:
            return self._recording_rule_hit(token, start)
        found = legacy.migrate_prometheus_name(token, self.prefixes)
        if found is None:
            return None
        if found.new is None:
            return Hit(start, end, token, None, Action.REMOVED, f"{found.legacy_key}: {found.reason}")
        return Hit(start, end, token, found.new, Action.RENAME, found.reason)

    def _recording_rule_hit(self, token: str, start: int) -> Hit | None:
        """A recording rule named ``level:metric:operations`` follows its series' rename."""
        segments = token.split(":")
        found = [legacy.migrate_prometheus_name(s, self.prefixes) if s else None for s in segments]
        if not any(found):
            return None
        end = start + len(token)
        removed = [f for f in found if f is not None and f.new is None]
        if removed:
            reason = f"recording rule over {removed[0].legacy_key}: {removed[0].reason}"
            return Hit(start, end, token, None, Action.REMOVED, reason)
        new = ":".join((f and f.new) or s for s, f in zip(segments, found, strict=True))
        reason = "recording rule name follows its series (level:metric:op)"
        return Hit(start, end, token, new, Action.RENAME, reason)

    def _scan_promql(self, text: str) -> Scanned:
        hits: list[Hit] = []
        live, hidden = False, [m.span() for m in _NOT_SERIES.finditer(text)]
        tokens = [(m.lastgroup, m.group(), m.start()) for m in _PROMQL_TOKEN.finditer(text)]
        significant = [t for t in tokens if t[0] != "other" or not t[1].isspace()]
        for index, (group, token, start) in enumerate(significant):
            following = significant[index + 1][1] if index + 1 < len(significant) else ""
            if group == "ident":
                if following in ("(", "=", "!=", "=~", "!~"):
                    continue  # a function or a label name
                hit = self._prometheus_hit(token, start)
                if hit is None and "off_policy" in token:
                    reason = "looks like a legacy series name this tool does not know: edit by hand"
                    hit = Hit(start, start + len(token), token, None, Action.MANUAL, reason)
                if hit is not None:
                    hits.append(hit)
                elif not any(a <= start < b for a, b in hidden):
                    live = True
            elif group == "str" and index >= 2:
                label, operator = significant[index - 2][1], significant[index - 1][1]
                if label == "__name__" and operator in ("=", "!=", "=~", "!~"):
                    hits.extend(self._name_matcher_hits(token, start, regex=operator.endswith("~")))
        return Scanned(apply_renames(text, hits), tuple(hits), live)

    def _name_matcher_hits(self, literal: str, start: int, *, regex: bool) -> list[Hit]:
        body = literal[1:-1]
        if "\\" in body:
            return []  # escaped literals are rare in selectors; the plain scan still reports them
        inner = start + 1
        if not regex:
            hit = self._prometheus_hit(body, inner)
            return [hit] if hit is not None else []
        scanned = self._scan_regex(body, "prometheus")
        return [replace(h, start=h.start + inner, end=h.end + inner) for h in scanned.hits]

    def _scan_regex(self, pattern: str, flavor: legacy.RegexFlavor) -> Scanned:
        try:
            rewrite = legacy.rewrite_key_regex(pattern, flavor, self.prefixes)
        except ValueError as exc:
            return Scanned(pattern, (Hit(0, len(pattern), pattern, None, Action.MANUAL, str(exc)),))
        if rewrite is None:
            return Scanned(pattern, ())
        if rewrite.pattern is None:
            reason = "matches only removed metrics: " + ", ".join(rewrite.removed)
            return Scanned(pattern, (Hit(0, len(pattern), pattern, None, Action.REMOVED, reason),))
        reason = "regex rewritten to match the new keys"
        if rewrite.removed:
            reason += "; no longer matches removed " + ", ".join(rewrite.removed)
        hit = Hit(0, len(pattern), pattern, rewrite.pattern, Action.RENAME, reason)
        return Scanned(rewrite.pattern, (hit,))


def apply_renames(text: str, hits: Sequence[Hit]) -> str:
    renames = (h for h in hits if h.action is Action.RENAME)
    return apply_edits(text, [Edit(h.start, h.end, h.new) for h in renames if h.new is not None])


# -- another framework's keys (--from PEER) --------------------------------------------------------

_SUFFIX = "(?:" + _alternation(TRACKER_SUFFIXES) + ")?"


def _bare(segment: str) -> str:
    found = (segment[: -len(suffix)] for suffix in TRACKER_SUFFIXES if segment.endswith(suffix))
    return next(found, segment)


def _hit(row: PeerKey, start: int, end: int, token: str, new: str | None) -> Hit:
    if new is None:
        return Hit(start, end, token, None, Action.MANUAL, f"{row.peer}: {row.reason} [{row.source}]")
    return Hit(start, end, token, new, Action.RENAME, f"{row.peer}: {row.reason}")


class PeerScanner(Scanner):
    def __init__(self, peer: str, *, prometheus: bool, prefixes: Sequence[str] = ()) -> None:
        super().__init__(prometheus=prometheus, prefixes=prefixes)
        self.peer = peer
        self.rows = {row.key: row for row in peer_keys(peer)}
        whole = [key for key, row in self.rows.items() if not row.segment]
        segments = [key for key, row in self.rows.items() if row.segment]
        # every peer logs whole keys; AReaL's tracker also logs segments inside longer keys
        parts = [rf"(?<![\w/.-])(?:{_alternation(whole)})(?![\w/.-])"]
        if segments:
            parts.append(rf"(?<![\w.-])(?:{_alternation(segments)}){_SUFFIX}(?![\w.-])")
        self._pattern = re.compile("|".join(parts))
        self._series = {key.replace("/", "_").replace("-", "_"): self.rows[key] for key in whole}

    def _text_hits(self, text: str) -> list[Hit]:
        hits = []
        for match in self._pattern.finditer(text):
            row = self.rows.get(match.group()) or self.rows[_bare(match.group())]
            hits.append(_hit(row, match.start(), match.end(), match.group(), row.new))
        return hits

    def _prometheus_hit(self, token: str, start: int) -> Hit | None:
        row = self._series.get(token)
        if row is None:
            return None
        series = metric_by_key(row.new).prometheus_name if row.new is not None else None
        if row.new is not None and series is None:
            reason = f"{row.peer}: same meaning as {row.new}, which Prometheus does not publish"
            return Hit(start, start + len(token), token, None, Action.MANUAL, reason)
        return _hit(row, start, start + len(token), token, series)

    def _scan_promql(self, text: str) -> Scanned:
        found = super()._scan_promql(text)
        own = f"{self.peer}:"
        hits = tuple(h for h in found.hits if h.action != Action.MANUAL or h.reason.startswith(own))
        return Scanned(apply_renames(text, hits), hits, found.live)

    def _scan_regex(self, pattern: str, flavor: object) -> Scanned:
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            hit = Hit(0, len(pattern), pattern, None, Action.MANUAL, f"not a regex: {exc}")
            return Scanned(pattern, (hit,))
        matched = [r for r in self.rows.values() if not r.segment and compiled.search(r.key)]
        if not matched:
            return Scanned(pattern, ())
        differing = [row.key for row in matched if row.new is None]
        if differing:
            reason = f"{self.peer}: matches keys with no equivalent: {', '.join(differing)}; edit by hand"
            return Scanned(pattern, (Hit(0, len(pattern), pattern, None, Action.MANUAL, reason),))
        new_keys = sorted({row.new for row in matched if row.new is not None})
        rewritten = "^(?:" + "|".join(re.escape(k) for k in new_keys) + ")$"
        reason = f"{self.peer}: regex rewritten to the same keys here"
        hit = Hit(0, len(pattern), pattern, rewritten, Action.RENAME, reason)
        return Scanned(rewritten, (hit,))


def scanner_for(options: Options, *, prometheus: bool) -> Scanner:
    if options.peer:
        return PeerScanner(options.peer, prometheus=prometheus, prefixes=options.prometheus_prefixes)
    return Scanner(prometheus=prometheus, prefixes=options.prometheus_prefixes)


def peer_lookup(peer: str, name: str) -> PeerKey | None:
    """The row of a logged key ``name`` of ``peer``: the whole key, or a segment row inside it."""
    # bounded by "/": a segment row matches whole segments (bare of the tracker's suffix) only
    segments = "/" + "/".join(_bare(part) for part in name.split("/")) + "/"
    for row in peer_keys(peer):
        if row.key == name or (row.segment and f"/{row.key}/" in segments):
            return row
    return None
