"""The metric catalogue is the one place a name is written (issue 20): no string anywhere else in the package
starts like a W&B key (``"staleness/...``), a Prometheus family (``rl_staleness_``), an OpenTelemetry
instrument (``rl.staleness.``) or a legacy key (``off_policy/``, ``dispatcher/``), and the catalogue's own rows
are unambiguous.

The package is read as syntax trees, so f-strings, concatenations and strings inside expressions are all
seen; comments are not code and prose that merely mentions a key in the middle of a sentence is allowed.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path

import staleness_metrics
from staleness_metrics.metrics import keys, metric_table
from staleness_metrics.metrics.buckets import FLOOR_SOURCES, LAG_BUCKETS, LENGTH_BUCKETS
from staleness_metrics.metrics.metric_table import (
    ENV_KEY_PREFIX,
    KEY_PREFIX,
    LEGACY_KEYS,
    LEGACY_PROMETHEUS_NAMES,
    METRICS,
    REMOVED_KEY_FAMILIES,
    REMOVED_KEYS,
    WANDB_KEYS,
    env_key,
    metric_by_key,
    metric_by_prometheus_name,
    metric_named,
)

PACKAGE = Path(staleness_metrics.__file__).parent
CATALOGUE = Path(metric_table.__file__)
# W&B keys, Prometheus families, OpenTelemetry instruments, legacy W&B keys
NAMESPACES = ("staleness/", "rl_staleness_", "rl.staleness.", "off_policy/", "dispatcher/")
_LONGEST = max(len(n) for n in NAMESPACES)


def _leading_text(node: ast.expr) -> str | None:
    """The text a string expression starts with, as far as it is known before any interpolation."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        first = node.values[0] if node.values else None
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value
        return ""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):  # "stale" + "ness/..." and the like
        left, right = _leading_text(node.left), _leading_text(node.right)
        if left is not None and right is not None and len(left) < _LONGEST:
            return left + right
        return left
    return None


def names_outside_catalogue(source: str, filename: str) -> list[str]:
    """``file:line: text`` of every string expression of ``source`` that starts like a catalogue name."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.expr):
            continue
        text = _leading_text(node)
        if text is not None and text.startswith(NAMESPACES):
            found.append(f"{filename}:{node.lineno}: {text[:60]!r}")
    return sorted(set(found))


def test_the_lint_sees_literals_f_strings_and_concatenations() -> None:
    source = """
a = "staleness/token/mean"
b = f"staleness/env/{env}/x"
c = "stale" + "ness/rollout/max"
d = {"k": f"{prefix}"}
e = "the key staleness/token/mean in prose"
f = ("staleness/" "token/p50")
g = metrics.get('staleness/rollout/held', 0)
h = "rl_staleness_" + name
i = f"rl.staleness.{name}"
j = {"off_policy/mean": 1, "dispatcher/staleness/max": 2}
k = "the rl_staleness_token_steps family and the off_policy/* keys"
"""
    found = names_outside_catalogue(source, "example.py")
    assert sorted({int(line.split(":")[1]) for line in found}) == [2, 3, 4, 7, 8, 9, 10, 11]  # not 5, 6 nor 12


def test_no_key_is_spelled_outside_the_catalogue() -> None:
    offenders: list[str] = []
    files = sorted(PACKAGE.rglob("*.py"))
    assert CATALOGUE in files and len(files) > 50  # the walk sees the whole package
    for path in files:
        if path == CATALOGUE:
            continue
        offenders += names_outside_catalogue(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE)))
    assert offenders == [], "names belong in metrics/metric_table.py (W&B keys read through metrics/keys.py)"


def test_rows_have_unique_names_keys_families_and_instruments() -> None:
    for field in ("name", "prometheus_name", "otel_name"):
        values = [getattr(m, field) for m in METRICS if getattr(m, field) is not None]
        assert [v for v, n in Counter(values).items() if n > 1] == [], field
    spelled = [key for m in METRICS for key in m.wandb_keys]
    assert [k for k, n in Counter(spelled).items() if n > 1] == []
    assert len(WANDB_KEYS) == len(spelled)
    for metric in METRICS:
        assert metric_named(metric.name) is metric
        if metric.prometheus_name is not None:
            assert metric_by_prometheus_name(metric.prometheus_name) is metric
            assert metric.prometheus_name.startswith("rl_staleness_")
        if metric.otel_name is not None:
            assert metric.otel_name.startswith("rl.staleness.")
        for key in metric.wandb_keys:
            assert key.startswith(KEY_PREFIX) and not key.startswith(ENV_KEY_PREFIX)
            assert metric_by_key(key) is metric
            assert "{" not in key  # every template expanded


def test_templated_rows_spell_one_key_per_bucket() -> None:
    expected = {"lag": (LAG_BUCKETS, LAG_BUCKETS[1:17]), "length": (LENGTH_BUCKETS,), "source": (FLOOR_SOURCES,)}
    for metric in METRICS:
        if metric.dimension is None:
            continue
        assert metric.dimension.label in metric.labels
        assert metric.dimension.buckets in expected[metric.dimension.label]
        if metric.wandb_key is not None and metric.dimension.placeholder in metric.wandb_key:
            assert list(metric.keys_by_bucket) == list(metric.dimension.buckets)


def test_every_legacy_key_maps_to_one_row_or_a_reason() -> None:
    renamed = [old for m in METRICS for old in m.legacy_keys]
    assert [k for k, n in Counter(renamed).items() if n > 1] == []  # one row per legacy key
    removed = [r.old for r in REMOVED_KEYS]
    assert set(renamed).isdisjoint(removed) and len(set(removed)) == len(removed)
    assert set(LEGACY_KEYS) == set(renamed) | set(removed)
    for old, legacy in LEGACY_KEYS.items():
        assert old not in WANDB_KEYS  # a legacy key is never a current one
        if legacy.new is None:
            assert legacy.reason
        else:
            assert sum(legacy.new in m.wandb_keys and old in m.legacy_keys for m in METRICS) == 1
    for old_key in LEGACY_PROMETHEUS_NAMES.values():  # an old Prometheus name published a known legacy key
        assert old_key in LEGACY_KEYS or any(old_key.startswith(prefix) for prefix in REMOVED_KEY_FAMILIES)


def test_the_key_constants_cover_the_table() -> None:
    named: set[str] = set()
    for constant in (name for name in dir(keys) if name.isupper()):
        value = getattr(keys, constant)
        named |= set(value.values()) if isinstance(value, dict) else {value}
    assert named == set(WANDB_KEYS)


def test_env_keys_repeat_the_batch_key_under_the_env() -> None:
    assert env_key("math", keys.TOKEN_MEAN) == ENV_KEY_PREFIX + "math/" + keys.TOKEN_MEAN.removeprefix(KEY_PREFIX)


def test_reading_the_catalogue_imports_no_computation() -> None:
    """Dashboards, the migration tool and the exporters' names read the table without numpy or the engine."""
    code = (
        "import sys; import staleness_metrics.metrics.keys; "
        "print(sorted(m for m in sys.modules if m.startswith(('numpy', 'staleness_metrics'))))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert ast.literal_eval(loaded) == [
        "staleness_metrics",
        "staleness_metrics.metrics",
        "staleness_metrics.metrics.buckets",
        "staleness_metrics.metrics.keys",
        "staleness_metrics.metrics.metric_table",
    ]
