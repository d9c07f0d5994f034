"""staleness-metrics: how stale is the data your asynchronous RL trainer trains on.

The public face is ``__all__``; each name is imported on first use (PEP 562), so that
``import staleness_metrics`` loads no engine, reader, exporter or service module."""

from __future__ import annotations

import importlib
import typing  # a module, as importlib: the names it holds are not exported

__version__ = "0.1.0"

if typing.TYPE_CHECKING:
    from .config import StalenessConfig
    from .engine.decision import Decision, Judgement
    from .engine.policies import EpisodePolicy, GroupPolicy, Policy, TokenPolicy, XtunerPolicy
    from .engine.shipment import PaddedShipment, Shipment, ShippedRollout, padded_shipment
    from .engine.sink import Sink
    from .errors import (
        ConfigError,
        EventError,
        FieldError,
        FieldTypeError,
        MissingFieldError,
        StalenessError,
        TraceError,
    )
    from .metrics.buckets import LAG_BUCKETS
    from .metrics.metric_table import LEGACY_KEYS, METRICS, LegacyKey, MetricDef, MetricKind
    from .metrics.mismatch import MismatchSums, mismatch_sums
    from .metrics.report import StepReport, Tally
    from .monitor import StalenessMonitor
    from .records.columnar import RolloutBatch
    from .records.model import Rollout, Sample
    from .replay.stream import read_events, run_events

# the module (relative to this package) that defines each public name
_HOMES = {
    ".config": ("StalenessConfig",),
    ".engine.decision": ("Decision", "Judgement"),
    ".engine.policies": ("EpisodePolicy", "GroupPolicy", "Policy", "TokenPolicy", "XtunerPolicy"),
    ".engine.shipment": ("PaddedShipment", "Shipment", "ShippedRollout", "padded_shipment"),
    ".engine.sink": ("Sink",),
    ".errors": (
        "ConfigError",
        "EventError",
        "FieldError",
        "FieldTypeError",
        "MissingFieldError",
        "StalenessError",
        "TraceError",
    ),
    ".metrics.metric_table": ("LEGACY_KEYS", "METRICS", "LegacyKey", "MetricDef", "MetricKind"),
    ".metrics.buckets": ("LAG_BUCKETS",),
    ".metrics.mismatch": ("MismatchSums", "mismatch_sums"),
    ".metrics.report": ("StepReport", "Tally"),
    ".monitor": ("StalenessMonitor",),
    ".records.columnar": ("RolloutBatch",),
    ".records.model": ("Rollout", "Sample"),
    ".replay.stream": ("read_events", "run_events"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "LAG_BUCKETS",
    "LEGACY_KEYS",
    "METRICS",
    "ConfigError",
    "Decision",
    "EpisodePolicy",
    "EventError",
    "FieldError",
    "FieldTypeError",
    "GroupPolicy",
    "Judgement",
    "LegacyKey",
    "MetricDef",
    "MetricKind",
    "MismatchSums",
    "MissingFieldError",
    "PaddedShipment",
    "Policy",
    "Rollout",
    "RolloutBatch",
    "Sample",
    "Shipment",
    "ShippedRollout",
    "Sink",
    "StalenessConfig",
    "StalenessError",
    "StalenessMonitor",
    "StepReport",
    "Tally",
    "TokenPolicy",
    "TraceError",
    "XtunerPolicy",
    "__version__",
    "mismatch_sums",
    "padded_shipment",
    "read_events",
    "run_events",
]


def __getattr__(name: str) -> typing.Any:  # import a public name's module on first use
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
