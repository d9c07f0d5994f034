"""staleness-metrics: how stale is the data your asynchronous RL trainer trains on.

Records -> sink -> policy -> decision -> metrics -> metric table -> exporters. The public face of the
package is what ``__all__`` lists; everything else is an implementation module.

Each public name is imported on first use (PEP 562 ``__getattr__``): ``import staleness_metrics`` loads
no engine, reader, exporter or service module, so a trainer pays only for what it touches.
"""

from __future__ import annotations

import importlib
import typing  # a module, as importlib: the names it holds are not exported

__version__ = "0.1.0"

if typing.TYPE_CHECKING:
    from .columnar import RolloutBatch
    from .config import StalenessConfig
    from .decision import Decision, Judgement
    from .errors import ConfigError, EventError, StalenessError, TraceError
    from .metric_table import LEGACY_KEYS, METRICS, LegacyKey, MetricDef, MetricKind
    from .mismatch import LAG_BUCKETS, MismatchSums, mismatch_sums
    from .monitor import StalenessMonitor
    from .padded import PaddedShipment, padded_shipment
    from .policies import EpisodePolicy, GroupPolicy, Policy, TokenPolicy, XtunerPolicy
    from .records import Rollout, Sample
    from .replay import read_events, run_events
    from .report import StepReport, Tally
    from .sink import Shipment, ShippedRollout, Sink

# public name -> the module (relative to this package) that defines it
_HOME = {
    "RolloutBatch": ".columnar",
    "StalenessConfig": ".config",
    "Decision": ".decision",
    "Judgement": ".decision",
    "ConfigError": ".errors",
    "EventError": ".errors",
    "StalenessError": ".errors",
    "TraceError": ".errors",
    "LEGACY_KEYS": ".metric_table",
    "METRICS": ".metric_table",
    "LegacyKey": ".metric_table",
    "MetricDef": ".metric_table",
    "MetricKind": ".metric_table",
    "LAG_BUCKETS": ".mismatch",
    "MismatchSums": ".mismatch",
    "mismatch_sums": ".mismatch",
    "StalenessMonitor": ".monitor",
    "PaddedShipment": ".padded",
    "padded_shipment": ".padded",
    "EpisodePolicy": ".policies",
    "GroupPolicy": ".policies",
    "Policy": ".policies",
    "TokenPolicy": ".policies",
    "XtunerPolicy": ".policies",
    "Rollout": ".records",
    "Sample": ".records",
    "read_events": ".replay",
    "run_events": ".replay",
    "StepReport": ".report",
    "Tally": ".report",
    "Shipment": ".sink",
    "ShippedRollout": ".sink",
    "Sink": ".sink",
}

__all__ = [
    "LAG_BUCKETS",
    "LEGACY_KEYS",
    "METRICS",
    "ConfigError",
    "Decision",
    "EpisodePolicy",
    "EventError",
    "GroupPolicy",
    "Judgement",
    "LegacyKey",
    "MetricDef",
    "MetricKind",
    "MismatchSums",
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


def __getattr__(name: str) -> typing.Any:
    """Import the module defining a public name on first use, and keep the name here from then on."""
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
