"""What every exporter is, and how export failures are counted and logged."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..metrics.bound import ShipBound, mismatch_metrics
from ..metrics.metric_table import env_key
from ..metrics.mismatch import MismatchSums
from ..metrics.report import MetricValue, StepReport

logger = logging.getLogger("staleness_metrics.exporters")

DEFAULT_RUN = "default"


@runtime_checkable
class Exporter(Protocol):
    """Publishes each shipped step's report: ``export`` runs on the training thread once per ship,
    returns quickly (queues anything slow) and should not raise; ``close`` flushes."""

    name: str

    def export(self, report: StepReport) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class MismatchReport:
    """Trainer-side SPEC 11 sums recorded for a shipped step: ``sums``, the step's total so far
    (what rows show); ``delta``, what this call added (what counters add)."""

    step: int
    sums: MismatchSums
    delta: MismatchSums
    bound: ShipBound | None = None  # SPEC 14 of ``sums``
    # with the env breakdown: the unprefixed keys of the env's merged total, and that env
    env_metrics: Mapping[str, Mapping[str, MetricValue]] = field(default_factory=dict)
    env: str | None = None

    @property
    def metrics(self) -> dict[str, MetricValue]:
        """The row of ``sums``: SPEC 11 keys, then SPEC 14's, then the env's."""
        out = mismatch_metrics(self.sums, self.bound)
        for env, keys in self.env_metrics.items():
            out.update({env_key(env, key): v for key, v in keys.items()})
        return out


@runtime_checkable
class MismatchAware(Protocol):
    """An exporter that publishes trainer-side mismatch sums
    (:meth:`StalenessMonitor.record_mismatch`)."""

    def export_mismatch(self, report: MismatchReport) -> None: ...


@runtime_checkable
class MonitorAware(Protocol):
    """An exporter that takes the monitor's run name, error counts and env breakdown setting."""

    def attach(self, context: ExportContext) -> None: ...


@runtime_checkable
class Stateful(Protocol):
    """An exporter with cumulative state that a monitor checkpoint carries (SPEC 13); ``absorb*``
    fold in what was published before a restart without publishing it again."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def absorb(self, report: StepReport) -> None: ...

    def absorb_mismatch(self, report: MismatchReport) -> None: ...


class ExportErrors:
    """Thread-safe count of failed exports (dropped reports included) per exporter, logged at most
    once per ``log_interval``; a monitor shares one with its exporters."""

    def __init__(self, log_interval: float = 30.0) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._log_interval = log_interval
        self._last_logged: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def register(self, exporter: str) -> None:
        """Expose a zero count for ``exporter`` (so ``rate()`` works from the first scrape)."""
        with self._lock:
            self._counts.setdefault(exporter, 0)

    def record(self, exporter: str, message: str, exc: BaseException | None = None) -> None:
        """Count one failure of ``exporter``; log it unless it logged less than an interval ago."""
        now = time.monotonic()
        with self._lock:
            self._counts[exporter] += 1
            last = self._last_logged.get(exporter)
            if last is not None and now - last < self._log_interval:
                self._suppressed[exporter] += 1
                return
            self._last_logged[exporter] = now
            suppressed = self._suppressed.pop(exporter, 0)
        more = f" ({suppressed} similar failures not logged)" if suppressed else ""
        reason = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        logger.warning("exporter %s: %s%s%s", exporter, message, reason, more)

    def count(self, exporter: str) -> int:
        with self._lock:
            return self._counts[exporter]

    def snapshot(self) -> dict[str, int]:
        """All counts at once (exporter name -> failures)."""
        with self._lock:
            return dict(self._counts)

    def restore(self, counts: Mapping[str, int]) -> None:
        """Add counts saved by a checkpoint (the counter continues across a restart)."""
        with self._lock:
            self._counts.update({exporter: int(count) for exporter, count in counts.items()})


@dataclass(frozen=True)
class ExportContext:
    """What a monitor shares with its exporters: the ``run`` label, the failure count and
    ``env_breakdown`` (the per-env series)."""

    run: str = DEFAULT_RUN
    errors: ExportErrors = field(default_factory=ExportErrors)
    env_breakdown: bool = False

    def share_errors(self, exporter: str, own: ExportErrors) -> ExportErrors:
        """The shared counter, given what ``own`` counted for ``exporter`` before the attach."""
        if own is not self.errors:
            self.errors.restore({exporter: own.count(exporter)})
        return self.errors


class CountingExporter:
    """Base of the built-in exporters: their own failure count, until a monitor shares its own."""

    name: str

    def __init__(self) -> None:
        self._errors = ExportErrors()
        self._errors.register(self.name)

    def attach(self, context: ExportContext) -> None:
        """Share the monitor's export error counts."""
        self._errors = context.share_errors(self.name, self._errors)

    @property
    def errors(self) -> ExportErrors:
        return self._errors
