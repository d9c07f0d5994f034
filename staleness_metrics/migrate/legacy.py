"""What a legacy name is called now (SPEC 7): the look-ups over the catalogue's legacy W&B keys and
Prometheus names, plus the setting's flag spelling and the console label (docs/migrate.md)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

from ..metrics import metric_table

# the settings as command lines spell them (--orchestrator.max-off-policy-steps 8)
RENAMED_SETTING_FLAGS: Mapping[str, str] = {"max-off-policy-steps": "max-staleness"}
CONSOLE_LABELS: Mapping[str, str] = {"Max Off-Policy": "Max Staleness"}
CURRENT_KEYS: frozenset[str] = frozenset(metric_table.WANDB_KEYS)
DEFAULT_PROMETHEUS_PREFIXES: tuple[str, ...] = ("orchestrator_",)  # prime-rl's orchestrator

_HISTOGRAM_SERIES = ("", "_bucket", "_sum", "_count")
CURRENT_PROMETHEUS_NAMES: frozenset[str] = frozenset(
    metric.prometheus_name + suffix
    for metric in metric_table.METRICS
    if metric.prometheus_name is not None
    for suffix in (_HISTOGRAM_SERIES if metric.kind is metric_table.MetricKind.HISTOGRAM else ("",))
)
_COUNTER_NOTE = "was a per-step gauge, is now a cumulative counter: wrap it in increase() or rate()"
# wandb: a W&B panel regex over keys (matches anywhere, like JavaScript's ``test``); prometheus: a
# ``__name__=~`` regex over series names (anchored at both ends, like RE2 in Prometheus)
RegexFlavor = Literal["wandb", "prometheus"]
_Trie: TypeAlias = dict[str | None, "_Trie"]  # segment -> subtree; the key None marks a name's end


def migrate_key(key: str) -> metric_table.LegacyKey | None:
    """A legacy or removed-family W&B key's :class:`LegacyKey` (``new`` None: removed), or None."""
    families = metric_table.REMOVED_KEY_FAMILIES.items()
    reasons = [reason for prefix, reason in families if key.startswith(prefix) and key != prefix]
    found = metric_table.LEGACY_KEYS.get(key)
    return found or (metric_table.LegacyKey(key, None, reasons[0]) if reasons else None)


def current_key(key: str) -> str | None:
    legacy = migrate_key(key)
    return key if legacy is None else legacy.new


def in_legacy_namespace(key: str) -> bool:
    return key.startswith(metric_table.LEGACY_NAMESPACE)


@dataclass(frozen=True)
class LegacyPrometheusName:
    """An old series name's W&B key and the family publishing its replacement (None: removed)."""

    legacy_key: str
    new: str | None
    reason: str


def migrate_prometheus_name(
    name: str, prefixes: Iterable[str] = DEFAULT_PROMETHEUS_PREFIXES
) -> LegacyPrometheusName | None:
    """What the series ``name`` (maybe behind one of ``prefixes``) is now; None if not legacy."""
    if name in CURRENT_PROMETHEUS_NAMES:
        return None
    longest_first = sorted(set(prefixes), key=len, reverse=True)
    candidates = [name, *(name[len(p) :] for p in longest_first if p and name.startswith(p))]
    for bare in candidates:
        old_key = metric_table.LEGACY_PROMETHEUS_NAMES.get(bare)
        if old_key is None:
            continue
        legacy = migrate_key(old_key)
        assert legacy is not None, f"{bare} names {old_key}, which is not a legacy key"
        if legacy.new is None:
            return LegacyPrometheusName(old_key, None, legacy.reason)
        metric = metric_table.metric_by_key(legacy.new)
        assert metric.prometheus_name is not None, f"{legacy.new} has no Prometheus name"
        reason = legacy.reason or "renamed"
        if metric.kind is metric_table.MetricKind.COUNTER and not bare.endswith("_total"):
            reason = _COUNTER_NOTE
        return LegacyPrometheusName(old_key, metric.prometheus_name, reason)
    return None


@dataclass(frozen=True)
class RegexRewrite:
    """A regex matching exactly the new names of the legacy ones matched (None: all ``removed``)."""

    pattern: str | None
    removed: tuple[str, ...]


def _matches(compiled: re.Pattern[str], name: str, flavor: RegexFlavor) -> bool:
    return (compiled.search if flavor == "wandb" else compiled.fullmatch)(name) is not None


def _trie_pattern(names: Iterable[str], sep: str) -> str:
    root: _Trie = {}
    for name in names:
        node = root
        for segment in name.split(sep):
            node = node.setdefault(segment, {})
        node[None] = {}

    def render(children: _Trie) -> str:
        alternatives = []
        for segment in sorted(s for s in children if s is not None):
            child = children[segment]
            tail = ""
            if child.keys() - {None}:
                tail = re.escape(sep) + render(child)
                if None in child:
                    tail = f"(?:{tail})?"
            alternatives.append(re.escape(segment) + tail)
        return alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")"

    return render(root)


def rewrite_key_regex(
    pattern: str,
    flavor: RegexFlavor = "wandb",
    prefixes: Sequence[str] = DEFAULT_PROMETHEUS_PREFIXES,
) -> RegexRewrite | None:
    """The regex matching the new names of the legacy names ``pattern`` matched (None when it
    matches none or a current one; ``ValueError`` if not a regex). Rules in docs/migrate.md."""
    if "off_policy" not in pattern and "staleness" not in pattern:
        return None
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"not a regular expression this tool can read: {exc}") from exc
    current = CURRENT_KEYS if flavor == "wandb" else CURRENT_PROMETHEUS_NAMES
    if any(_matches(compiled, name, flavor) for name in current):
        return None
    if flavor == "wandb":  # every legacy name the regex may match -> its new name (None: removed)
        legacy = {old: row.new for old, row in metric_table.LEGACY_KEYS.items()}
    else:
        names = [p + bare for bare in metric_table.LEGACY_PROMETHEUS_NAMES for p in ("", *prefixes)]
        found = {name: migrate_prometheus_name(name, prefixes) for name in names}
        legacy = {name: migrated.new for name, migrated in found.items() if migrated is not None}
    matched = sorted(name for name in legacy if _matches(compiled, name, flavor))
    if not matched:
        return None
    removed = tuple(name for name in matched if legacy[name] is None)
    targets = sorted({new for name in matched if (new := legacy[name]) is not None})
    if not targets:
        return RegexRewrite(None, removed)
    new_pattern = "^" + _trie_pattern(targets, "/") + "$" if flavor == "wandb" else _trie_pattern(targets, "_")
    # The rewrite must match exactly the targets among all known names, and no legacy name.
    check = re.compile(new_pattern)
    hits = {name for name in (*current, *legacy) if _matches(check, name, flavor)}
    assert hits == set(targets), f"rewrite of {pattern!r} matches {sorted(hits)}, not {targets}"
    return RegexRewrite(new_pattern, removed)
