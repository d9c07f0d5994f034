"""An example OpenTelemetry Collector config: OTLP from the OTLP exporter in, Prometheus out.

The collector's Prometheus exporter renames OTLP metrics by its own rules (dots to underscores,
``_total`` on counters, ``_ratio`` on unit-``1`` gauges, units in braces dropped). Where that does
not give the table's Prometheus name (the staleness gauges lose their ``_steps``), a
``metricstransform`` rename sets the table's name, so the dashboards and rules work unchanged on
either path. Generated from the metric table; ``otelcol-contrib`` has both components.
"""

from __future__ import annotations

import io
import re
from typing import Any

from .. import metric_table
from ..metric_table import MetricKind

__all__ = ["collector_config", "collector_prometheus_name", "renames", "render_collector_config", "unit_cleared"]

OTLP_HTTP = "127.0.0.1:4318"
OTLP_GRPC = "127.0.0.1:4317"
PROMETHEUS = "127.0.0.1:8889"

# The collector's OTLP unit -> Prometheus unit word (UCUM subset it knows; others are used as is).
_UNIT_WORDS = dict(
    d="days", h="hours", min="minutes", s="seconds", ms="milliseconds", us="microseconds", ns="nanoseconds",
    By="bytes", KiBy="kibibytes", MiBy="mebibytes", GiBy="gibibytes", TiBy="tibibytes",
    KBy="kilobytes", MBy="megabytes", GBy="gigabytes", TBy="terabytes",
    m="meters", V="volts", A="amperes", J="joules", W="watts", g="grams", Cel="celsius", Hz="hertz",
)  # fmt: skip
_UNIT_WORDS.update({"1": "", "%": "percent"})
_PER_UNIT_WORDS = {
    "s": "second",
    "m": "minute",
    "h": "hour",
    "d": "day",
    "w": "week",
    "mo": "month",
    "y": "year",
}


def _words(text: str) -> list[str]:
    return [w for w in re.split(r"[^0-9A-Za-z]+", text) if w]


def collector_prometheus_name(otel_name: str, unit: str, kind: MetricKind) -> str:
    """The name the collector's Prometheus exporter gives a metric (default translation, with suffixes)."""
    words = _words(otel_name)
    main_unit, _, per_unit = (part.strip() for part in unit.partition("/"))
    if main_unit and not re.search(r"[{}]", main_unit):
        unit_word = "_".join(_words(_UNIT_WORDS.get(main_unit, main_unit)))
        if unit_word and unit_word not in words:
            words.append(unit_word)
    if per_unit and not re.search(r"[{}]", per_unit):
        per_word = "_".join(_words(_PER_UNIT_WORDS.get(per_unit, per_unit)))
        if per_word and per_word not in words:
            words += ["per", per_word]
    if kind is MetricKind.COUNTER:
        words = [w for w in words if w != "total"] + ["total"]
    if unit == "1" and kind is MetricKind.GAUGE:
        words = [w for w in words if w != "ratio"] + ["ratio"]
    return "_".join(words)


def renames() -> list[tuple[str, str]]:
    """(OTLP name, table Prometheus name) for every row the collector would otherwise name differently."""
    pairs = []
    for row in metric_table.METRICS:
        if row.otel_name is None or row.prometheus_name is None:
            continue
        if collector_prometheus_name(row.otel_name, row.otel_unit, row.kind) != row.prometheus_name:
            pairs.append((row.otel_name, row.prometheus_name))
    return pairs


def unit_cleared() -> list[str]:
    """Table Prometheus names of gauges with unit ``1`` that are not ratios (SPEC 14's 0/1 ``crossed`` flag):
    the collector's exporter would add ``_ratio`` to them whatever their name, so after the rename their
    unit is cleared (a ``transform`` processor), and the name stays the table's."""
    return [
        row.prometheus_name
        for row in metric_table.METRICS
        if row.otel_name is not None
        and row.prometheus_name is not None
        and row.kind is MetricKind.GAUGE
        and row.otel_unit == "1"
        and not row.prometheus_name.endswith("_ratio")
    ]


def collector_config() -> dict[str, Any]:
    """The collector config as data."""
    rename = "metricstransform/staleness-names"
    units = "transform/staleness-units"
    cleared = unit_cleared()
    return {
        "receivers": {"otlp": {"protocols": {"http": {"endpoint": OTLP_HTTP}, "grpc": {"endpoint": OTLP_GRPC}}}},
        "processors": {
            "memory_limiter": {"check_interval": "1s", "limit_mib": 256},
            rename: {
                "transforms": [
                    {"include": otel, "match_type": "strict", "action": "update", "new_name": prom}
                    for otel, prom in renames()
                ]
            },
            **(
                {
                    units: {
                        "metric_statements": [
                            {
                                "context": "metric",
                                "statements": [f'set(unit, "") where name == "{name}"' for name in cleared],
                            }
                        ]
                    }
                }
                if cleared
                else {}
            ),
            "batch": {},
        },
        "exporters": {
            "prometheus": {
                "endpoint": PROMETHEUS,
                # service.name becomes `job` and service.instance.id `instance` (scrape with honor_labels)
                "resource_to_telemetry_conversion": {"enabled": False},
                "enable_open_metrics": False,
            }
        },
        "service": {
            "pipelines": {
                "metrics": {
                    "receivers": ["otlp"],
                    "processors": ["memory_limiter", rename, *([units] if cleared else []), "batch"],
                    "exporters": ["prometheus"],
                }
            }
        },
    }


HEADER = """\
# Example OpenTelemetry Collector (otelcol-contrib) config for staleness-metrics; see README.md.
# Generated by `staleness-metrics dashboards` from staleness_metrics/metric_table.py: do not edit.
#
# OTLP exporter -> this collector (OTLP/HTTP 127.0.0.1:4318, gRPC 127.0.0.1:4317)
#   -> Prometheus exporter on 127.0.0.1:8889 -> Prometheus scrapes it with honor_labels: true.
# The rename processor gives every metric the table's Prometheus name, so the generated Grafana
# dashboards and rules work on this path too.
"""


def render_collector_config() -> str:
    """The collector config as YAML text."""
    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.width = 4096
    yaml.indent(mapping=2, sequence=4, offset=2)
    out = io.StringIO()
    yaml.dump(collector_config(), out)
    return HEADER + out.getvalue()
