"""Find a peer framework's keys in strings (``migrate --from PEER``), in the contexts of
:mod:`.names`: a key with the same meaning is renamed, others reported with the table's reason."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..metrics.metric_table import metric_by_key
from .model import Action, Options
from .names import Hit, Scanned, Scanner, apply_renames
from .peers import TRACKER_SUFFIXES, PeerKey, peer_keys

__all__ = ["PeerScanner", "peer_lookup", "scanner_for"]


def _alternation(names: Sequence[str]) -> str:
    return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))


_SUFFIX = "(?:" + _alternation(TRACKER_SUFFIXES) + ")?"


def _bare(segment: str) -> str:
    """A path segment without the tracker's ``__count`` suffix."""
    for suffix in TRACKER_SUFFIXES:
        if segment.endswith(suffix):
            return segment[: -len(suffix)]
    return segment


def _hit(row: PeerKey, start: int, end: int, token: str, new: str | None) -> Hit:
    if new is None:
        return Hit(start, end, token, None, Action.MANUAL, f"{row.peer}: {row.reason} [{row.source}]")
    return Hit(start, end, token, new, Action.RENAME, f"{row.peer}: {row.reason}")


class PeerScanner(Scanner):
    """Scans strings for one peer's keys instead of this project's legacy names."""

    def __init__(self, peer: str, *, prometheus: bool, prefixes: Sequence[str] = ()) -> None:
        super().__init__(prometheus=prometheus, prefixes=prefixes)
        self.rows = {row.key: row for row in peer_keys(peer)}
        whole = [key for key, row in self.rows.items() if not row.segment]
        segments = [key for key, row in self.rows.items() if row.segment]
        parts = []
        if whole:
            parts.append(rf"(?<![\w/.-])(?:{_alternation(whole)})(?![\w/.-])")
        if segments:
            parts.append(rf"(?<![\w.-])(?:{_alternation(segments)}){_SUFFIX}(?![\w.-])")
        self._pattern = re.compile("|".join(parts)) if parts else None
        self._series = {
            key.replace("/", "_").replace("-", "_"): row for key, row in self.rows.items() if not row.segment
        }

    def _text_hits(self, text: str) -> list[Hit]:
        if self._pattern is None:
            return []
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
        scanned = super()._scan_promql(text)
        hits = tuple(
            h for h in scanned.hits if h.action is not Action.MANUAL or h.reason.startswith(f"{self._peer()}:")
        )
        return Scanned(apply_renames(text, hits), hits)

    def _peer(self) -> str:
        return next(iter(self.rows.values())).peer if self.rows else ""

    def _scan_regex(self, pattern: str, flavor: object) -> Scanned:
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            hit = Hit(0, len(pattern), pattern, None, Action.MANUAL, f"not a regex: {exc}")
            return Scanned(pattern, (hit,))
        matched = [row for key, row in self.rows.items() if not row.segment and compiled.search(key)]
        if not matched:
            return Scanned(pattern, ())
        differing = [row.key for row in matched if row.new is None]
        if differing:
            reason = f"{self._peer()}: matches keys with no equivalent: {', '.join(differing)}; edit by hand"
            return Scanned(pattern, (Hit(0, len(pattern), pattern, None, Action.MANUAL, reason),))
        new_keys = sorted({row.new for row in matched if row.new is not None})
        rewritten = "^(?:" + "|".join(re.escape(k) for k in new_keys) + ")$"
        reason = f"{self._peer()}: regex rewritten to the same keys here"
        return Scanned(rewritten, (Hit(0, len(pattern), pattern, rewritten, Action.RENAME, reason),))


def scanner_for(options: Options, *, prometheus: bool) -> Scanner:
    """The legacy scanner, or the peer's when ``options.peer`` is set."""
    if options.peer:
        return PeerScanner(options.peer, prometheus=prometheus, prefixes=options.prometheus_prefixes)
    return Scanner(prometheus=prometheus, prefixes=options.prometheus_prefixes)


def peer_lookup(peer: str, name: str) -> PeerKey | None:
    """The row of a logged key ``name`` of ``peer``: the whole key, or a segment row inside it."""
    parts = [_bare(part) for part in name.split("/")]
    for row in peer_keys(peer):
        if row.key == name or (row.segment and _has_segments(parts, row.key.split("/"))):
            return row
    return None


def _has_segments(parts: Sequence[str], wanted: Sequence[str]) -> bool:
    """Whether ``wanted`` occurs as consecutive path segments of ``parts``."""
    size = len(wanted)
    return any(list(parts[start : start + size]) == list(wanted) for start in range(len(parts) - size + 1))
