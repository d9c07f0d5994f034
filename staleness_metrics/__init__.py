"""staleness-metrics: how stale is the data your asynchronous RL trainer trains on.

Records -> sink -> policy -> decision -> metrics -> metric table -> exporters. The public face of the
package is what ``__all__`` lists; everything else is an implementation module.
"""

from __future__ import annotations

__version__ = "0.1.0"

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
