"""Cumulative per-run state behind the Prometheus and OTLP exporters, as immutable snapshots.

A ship folds in what it brought and keeps its inputs in a :class:`Snapshot`; the series are
computed when a reader (a scrape, an OTLP send) first asks, so a ship costs what it changed, not
the number of series, and a reader never mixes two ships. Which rows exist, their kinds and their
sources come from the metric table only; the ``env`` label conventions are in docs/exporters.md.
"""

from __future__ import annotations

import functools
import itertools
import operator
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..metrics.buckets import BUCKETS
from ..metrics.keys import MISMATCH_FLOOR_SOURCE
from ..metrics.metric_table import (
    BATCH_WIDE_COUNTERS,
    ENV_KEY_PREFIX,
    KEY_PREFIX,
    METRICS,
    MetricDef,
    MetricKind,
    Source,
)
from ..metrics.mismatch import MismatchSums
from ..metrics.report import Counts, MetricValue, StepReport, Tally
from .base import DEFAULT_RUN, CountingExporter, ExportContext, MismatchReport

__all__ = [
    "BucketKey",
    "CumulativeExporter",
    "CumulativeState",
    "HistogramPoint",
    "Series",
    "Snapshot",
    "bucket_counts",
    "histogram_of",
    "partition_by_env",
]

Number = int | float
BucketKey = tuple[str, str]  # (env, the dimension's exported label value)


@dataclass(frozen=True)
class HistogramPoint:
    """Histogram over :data:`BUCKETS`: ``bucket_counts[i]`` counts values in
    ``(BUCKETS[i-1], BUCKETS[i]]``, the last one those above ``BUCKETS[-1]`` (``+Inf``)."""

    bucket_counts: tuple[int, ...]
    sum: int
    count: int
    min: int | None  # None when empty
    max: int | None

    def cumulative(self) -> list[int]:
        """Counts of values ``<= BUCKETS[i]`` (and the total last), as Prometheus ``le`` buckets."""
        return list(itertools.accumulate(self.bucket_counts))


# the bounds are integers: value <= b <=> value <= int(b)
_INT_BOUNDS = np.asarray(BUCKETS, dtype=np.int64)


def bucket_counts(histogram: Counts) -> HistogramPoint:
    """Map an integer histogram (index = staleness) onto :data:`BUCKETS` exactly."""
    n = len(histogram)
    nonzero = np.flatnonzero(histogram)
    if len(nonzero) == 0:
        return HistogramPoint((0,) * (len(BUCKETS) + 1), 0, 0, None, None)
    cumulative = np.cumsum(histogram, dtype=np.int64)
    at_bounds = cumulative[np.minimum(_INT_BOUNDS, n - 1)]  # values <= each bound
    counts = [*np.diff(at_bounds, prepend=0).tolist(), int(cumulative[-1] - at_bounds[-1])]
    return HistogramPoint(
        bucket_counts=tuple(counts),
        sum=int(np.dot(np.arange(n), histogram)),
        count=int(cumulative[-1]),
        min=int(nonzero[0]),
        max=int(nonzero[-1]),
    )


def partition_by_env(report: StepReport, by_env: bool = True) -> dict[str, Tally]:
    """The window's tallies split by env; ``""`` = rollouts without env plus
    whatever no env covers."""
    if not by_env or not report.env_tally:
        return {"": report.tally}
    parts = dict(report.env_tally)
    covered = functools.reduce(operator.add, parts.values())  # not from Tally(): one addition less
    # (usually every rollout of the window is in its env's tally)
    if not report.tally.within(covered):
        parts[""] = parts.get("", Tally()) + report.tally.excess_over(covered)
    return parts


# SPEC 12's length counters: a batch-wide series (env "") beside the per-env ones, as the gauges
# have; the mismatch family's env "" already is the batch's sums.
_SUMMED_BATCH_WIDE = frozenset(name for name in BATCH_WIDE_COUNTERS if name.startswith("length_"))


def _as_number(metric: MetricDef, value: object) -> Number:
    number = float(value)  # type: ignore[arg-type]
    return int(number) if metric.integer else number


def _gauge_values(metric: MetricDef, report: StepReport, by_env: bool) -> dict[str, Number]:
    if metric.source is Source.STEP:
        return {"": report.step}
    per_env = by_env and "env" in metric.labels
    if metric.source is Source.METRIC:
        key = metric.wandb_key or ""
        envs = {e: m for e, m in report.env_metrics.items() if e and per_env}
        rows = {"": report.metrics, **envs}
        return {env: _as_number(metric, row[key]) for env, row in rows.items() if key in row}
    if metric.source is Source.TALLY:
        field = metric.tally_field or ""
        tallies = {"": report.tally, **{e: t for e, t in report.env_tally.items() if e and per_env}}
        return {env: _as_number(metric, getattr(tally, field)) for env, tally in tallies.items()}
    return {}


_BOUND_GAUGES = tuple(m for m in METRICS if m.source is Source.BOUND and m.kind is MetricKind.GAUGE)
_BOUND_KEYS = frozenset(key for m in _BOUND_GAUGES for key in m.wandb_keys)


def _split_env(key: str) -> tuple[str, str] | None:
    """(env, batch-wide key) of a SPEC 14 key, its env ``""`` when it is
    batch-wide; None for other keys."""
    if key in _BOUND_KEYS:
        return "", key
    if key.startswith(ENV_KEY_PREFIX):
        for bound_key in _BOUND_KEYS:
            suffix = "/" + bound_key.removeprefix(KEY_PREFIX)
            if key.endswith(suffix) and len(key) > len(ENV_KEY_PREFIX) + len(suffix):
                return key[len(ENV_KEY_PREFIX) : -len(suffix)], bound_key
    return None


def _bound_keys(metrics: Mapping[str, MetricValue]) -> dict[str, MetricValue]:
    """The SPEC 14 keys of a row, batch-wide and per env (``staleness/env/<env>/...``)."""
    return {key: value for key, value in metrics.items() if _split_env(key) is not None}


def _bound_gauges(metrics: Mapping[str, MetricValue] | None) -> dict[str, Mapping[Any, Number]]:
    """SPEC 14's gauges from the keys of the latest report with the SPEC 11 family; the batch's
    under env ``""`` and each env's (the env breakdown) under its name."""
    by_env: dict[str, dict[str, MetricValue]] = {}
    for key, value in (metrics or {}).items():
        split = _split_env(key)
        if split is not None:
            by_env.setdefault(split[0], {})[split[1]] = value
    gauges: dict[str, Mapping[Any, Number]] = {}
    for metric in _BOUND_GAUGES:
        if metric.prometheus_name is None and metric.otel_name is None:
            continue
        assert metric.wandb_key is not None
        values: dict[Any, Number] = {}
        for env in sorted(by_env):
            found = by_env[env]
            if metric.dimension is None:
                if metric.wandb_key in found:
                    values[env] = _as_number(metric, found[metric.wandb_key])
            elif metric.dimension.placeholder in metric.wandb_key:  # one key per bucket (the curve)
                for key, value in zip(metric.wandb_keys, metric.dimension.values, strict=True):
                    if key in found:
                        values[(env, value)] = _as_number(metric, found[key])
            else:  # one key, its label from another key (the floor and its source)
                source = found.get(MISMATCH_FLOOR_SOURCE)
                if metric.wandb_key in found and isinstance(source, str):
                    values[(env, source)] = _as_number(metric, found[metric.wandb_key])
        gauges[metric.name] = values
    return gauges


def histogram_of(metric: MetricDef, tally: Tally) -> Counts:
    """The tally's histogram a histogram row shows."""
    if metric.source is Source.TOKEN_HISTOGRAM:
        return tally.token_histogram
    return tally.rollout_histogram


# Gauges some exporter shows (the W&B-only ratio rows are derived from counters elsewhere).
_PUBLISHED_GAUGES = tuple(
    m for m in METRICS if m.kind is MetricKind.GAUGE and (m.prometheus_name is not None or m.otel_name is not None)
)


def _counter(metric: MetricDef, holders: Mapping[str, Any]) -> dict[Any, Number]:
    """A counter's values by env (the tally or the sums holding it), or by (env, bucket value),
    every bucket of its dimension present."""
    field = metric.mismatch_field if metric.source is Source.MISMATCH else metric.tally_field
    rows = {env: _row(metric, getattr(holder, field or "")) for env, holder in holders.items()}
    if metric.name in _SUMMED_BATCH_WIDE and set(rows) - {""}:  # the batch-wide series first
        named = {env: row for env, row in rows.items() if env}
        rows = {"": [sum(column) for column in zip(*rows.values())], **named}
    if metric.dimension is None:
        return {env: row[0] for env, row in rows.items()}
    buckets = metric.dimension.values
    return {(env, b): n for env, row in rows.items() for b, n in zip(buckets, row, strict=True)}


def _row(metric: MetricDef, value: Any) -> list[Number]:
    if metric.dimension is None:
        return [int(value)]
    width = len(metric.dimension.values)
    return [_as_number(metric, value[i] if i < len(value) else 0) for i in range(width)]


class Series(NamedTuple):
    """Counters and histograms over the run or over one ship: metric name, then env (a counter
    with a dimension: (env, bucket value))."""

    counters: dict[str, Mapping[Any, Number]]
    histograms: dict[str, Mapping[str, HistogramPoint]]


def _series(
    tallies: Mapping[str, Tally],
    mismatch: MismatchSums | None,
    env_mismatch: Mapping[str, MismatchSums],
) -> Series:
    # the mismatch family: the batch's sums under env "", then each env's (live sums given per env)
    sums = {} if mismatch is None else {"": mismatch, **dict(sorted(env_mismatch.items()))}
    out = Series({}, {})
    for metric in METRICS:
        if metric.kind is MetricKind.HISTOGRAM:
            points = {env: bucket_counts(histogram_of(metric, t)) for env, t in tallies.items()}
            out.histograms[metric.name] = points
        elif metric.kind is MetricKind.COUNTER and metric.source is not Source.EXPORTER:
            holders = sums if metric.source is Source.MISMATCH else tallies
            out.counters[metric.name] = _counter(metric, holders)
    return out


@dataclass(frozen=True)
class Snapshot:
    """Everything an exporter shows after one ship: the inputs captured at the ship, its series
    computed on first read and kept (metric name, then env, or (env, bucket) for a labelled one)."""

    run: str
    by_env: bool
    step: int
    start_time_ns: int  # start of the cumulative series (first report of this state)
    previous_time_ns: int  # time of the previous snapshot (start of the delta window)
    time_ns: int
    totals: Mapping[str, Tally]
    window: Mapping[str, Tally]
    mismatch: MismatchSums | None
    env_mismatch: Mapping[str, MismatchSums]
    mismatch_delta: MismatchSums | None  # None before the first sums, zero for a ship without any
    env_mismatch_delta: Mapping[str, MismatchSums]
    gauge_report: StepReport | None  # the last ship's report: the gauges show it
    bound_metrics: Mapping[str, MetricValue] | None  # SPEC 14 keys of the last report with SPEC 11

    @functools.cached_property
    def cumulative(self) -> Series:
        """The run's counters and histograms."""
        return _series(dict(sorted(self.totals.items())), self.mismatch, self.env_mismatch)

    @functools.cached_property
    def delta(self) -> Series:
        """What this ship (or these trainer-side sums) added (OTLP delta temporality)."""
        window = dict(sorted(self.window.items()))
        return _series(window, self.mismatch_delta, self.env_mismatch_delta)

    @functools.cached_property
    def gauges(self) -> dict[str, Mapping[Any, Number]]:
        """The last ship's gauges and SPEC 14's, by env (by (env, value) with a label besides env:
        the floor by source, the curve by lag)."""
        by_env, report = self.by_env, self.gauge_report
        gauges: dict[str, Mapping[Any, Number]] = {
            m.name: {} if report is None else _gauge_values(m, report, by_env) for m in _PUBLISHED_GAUGES
        }
        return {**gauges, **_bound_gauges(self.bound_metrics)}

    def points(self, metric: MetricDef, series: Series) -> list[tuple[str, str | None, Number]]:
        """(env, bucket value or None, value) of a gauge's or a counter's series."""
        values = self.gauges if metric.kind is MetricKind.GAUGE else series.counters
        found = values.get(metric.name, {}).items()
        return [(*key, v) if isinstance(key, tuple) else (key, None, v) for key, v in found]


class CumulativeState:
    """Folds reports into run totals, returning a new immutable :class:`Snapshot` each time
    (callers serialize the folds; a snapshot may be read from any thread)."""

    def __init__(self, run: str, by_env: bool = False) -> None:
        self.run = run
        self.by_env = by_env
        self._totals: dict[str, Tally] = {}
        self._mismatch: MismatchSums | None = None  # SPEC 11 sums over the run, once any arrived
        self._env_mismatch: dict[str, MismatchSums] = {}  # live sums given per env (env breakdown)
        self._step = 0
        self._start_ns = time.time_ns()
        self._last_ns = self._start_ns
        self._last_report: StepReport | None = None  # the last ship's: the gauges show it
        self._bound_metrics: dict[str, MetricValue] | None = None  # of the last report with SPEC 11

    def state_dict(self) -> dict[str, Any]:
        """The run totals, the mismatch sums and the last report, as JSON-serialisable data."""
        from ..engine.checkpoint import report_to_dict, tally_to_dict

        return {
            "totals": {env: tally_to_dict(tally) for env, tally in self._totals.items()},
            "mismatch": None if self._mismatch is None else self._mismatch.to_dict(),
            "start_time_ns": self._start_ns,
            "last_report": None if self._last_report is None else report_to_dict(self._last_report),
            "bound_metrics": self._bound_metrics,
            "env_mismatch": {env: sums.to_dict() for env, sums in self._env_mismatch.items()},
        }

    @staticmethod
    def check_state_dict(
        state: Any, path: str
    ) -> tuple[
        dict[str, Tally],
        MismatchSums | None,
        int,
        StepReport | None,
        dict[str, MetricValue] | None,
        dict[str, MismatchSums],
    ]:
        """What :meth:`state_dict` saved, checked (``ConfigError`` naming the key path); the SPEC 14
        keys and the per-env sums may be absent (states saved before they existed)."""
        from ..engine.checkpoint import check_metrics, check_mismatch, check_report, check_tally
        from ..state_checks import integer, join, keys, mapping, string

        found = keys(
            state,
            path,
            ("totals", "mismatch", "start_time_ns", "last_report"),
            ("bound_metrics", "env_mismatch"),
        )
        totals = mapping(found["totals"], join(path, "totals"))
        bound = found.get("bound_metrics")
        env_path = join(path, "env_mismatch")
        env_sums = mapping(found.get("env_mismatch", {}), env_path)
        return (
            {string(env, join(path, "totals")): check_tally(tally, join(join(path, "totals"), env))
             for env, tally in totals.items()},
            None if found["mismatch"] is None else check_mismatch(found["mismatch"], join(path, "mismatch")),
            integer(found["start_time_ns"], join(path, "start_time_ns"), 0),
            None if found["last_report"] is None else check_report(found["last_report"], join(path, "last_report")),
            None if bound is None else check_metrics(bound, join(path, "bound_metrics")),
            {string(env, env_path): check_mismatch(sums, join(env_path, env)) for env, sums in env_sums.items()},
        )  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> Snapshot | None:
        """Continue the cumulative series from ``state``; returns what the last report showed (None
        if none). A bad state raises ``ConfigError`` and changes nothing."""
        totals, mismatch, start_ns, last, bound, env_mismatch = self.check_state_dict(state, "state")
        self._bound_metrics = bound
        self._env_mismatch = env_mismatch
        self._totals = totals
        self._mismatch = mismatch
        self._start_ns = start_ns  # the same series: it was never reset
        self._last_ns = max(self._last_ns, self._start_ns)
        self._last_report = last
        if last is None:
            return None
        self._step = last.step
        return self._snapshot({}, None)

    def apply(self, report: StepReport) -> Snapshot:
        """Fold in a ship: its tallies, its gauges and its mismatch sums (when it had them)."""
        window = partition_by_env(report, self.by_env)
        for env, tally in window.items():
            self._totals[env] = self._totals.get(env, Tally()) + tally
        if report.mismatch is not None:
            self._add_mismatch(report.mismatch)
            self._bound_metrics = _bound_keys(report.metrics)
        env_delta = dict(report.env_mismatch) if self.by_env else {}
        for env, sums in env_delta.items():
            self._env_mismatch[env] = self._env_mismatch.get(env, MismatchSums.zero()) + sums
        self._step = report.step
        self._last_report = report
        return self._snapshot(window, report.mismatch, env_delta)

    def apply_mismatch(
        self,
        delta: MismatchSums,
        metrics: Mapping[str, MetricValue] | None = None,
        env: str | None = None,
    ) -> Snapshot:
        """Fold in trainer-side sums (the live path): the counters move (an ``env``'s too, with the
        env breakdown), the last ship's gauges stay, SPEC 14's take ``metrics`` (the step's keys)."""
        self._add_mismatch(delta)
        env_delta = {}
        if env and self.by_env:
            self._env_mismatch[env] = self._env_mismatch.get(env, MismatchSums.zero()) + delta
            env_delta = {env: delta}
        # the batch's keys, and the env's when the sums were of one env; other envs stay
        if metrics is not None:
            new = _bound_keys(metrics)
            envs = {"", *(split[0] for split in map(_split_env, new) if split is not None)}
            kept = {k: v for k, v in (self._bound_metrics or {}).items() if (_split_env(k) or ("",))[0] not in envs}
            self._bound_metrics = {**kept, **new}
        return self._snapshot({env: Tally() for env in self._totals}, delta, env_delta)

    def _add_mismatch(self, sums: MismatchSums) -> None:
        self._mismatch = sums if self._mismatch is None else self._mismatch + sums

    def _snapshot(
        self,
        window: Mapping[str, Tally],
        mismatch_delta: MismatchSums | None,
        env_mismatch_delta: Mapping[str, MismatchSums] | None = None,
    ) -> Snapshot:
        """What the state holds now (every piece is immutable or a copy)."""
        if mismatch_delta is None and self._mismatch is not None:
            mismatch_delta = MismatchSums.zero()
        now = max(time.time_ns(), self._last_ns + 1)  # strictly increasing timestamps
        snapshot = Snapshot(
            run=self.run,
            by_env=self.by_env,
            step=self._step,
            start_time_ns=self._start_ns,
            previous_time_ns=self._last_ns,
            time_ns=now,
            totals=dict(self._totals),
            window=window,
            mismatch=self._mismatch,
            env_mismatch=dict(self._env_mismatch),
            mismatch_delta=mismatch_delta,
            env_mismatch_delta=env_mismatch_delta or {},
            gauge_report=self._last_report,
            bound_metrics=self._bound_metrics,
        )
        self._last_ns = now
        return snapshot


class CumulativeExporter(CountingExporter):
    """Base of the exporters whose series are cumulative (Prometheus, OTLP): the run state, kept
    across a restart by the monitor's checkpoint (SPEC 13)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._state = CumulativeState(DEFAULT_RUN)

    def attach(self, context: ExportContext) -> None:
        """Take the monitor's run label, shared export error counts and env breakdown setting."""
        with self._lock:
            if (context.run, context.env_breakdown) != (self._state.run, self._state.by_env):
                self._state = CumulativeState(context.run, context.env_breakdown)
        super().attach(context)

    def _apply(self, report: StepReport | MismatchReport) -> Snapshot:
        with self._lock:  # reports are folded in order, one at a time
            if isinstance(report, MismatchReport):
                # Counters add what this call brought (the env's keys too); SPEC 14's gauges show
                # the step's merged sums.
                snapshot = self._state.apply_mismatch(report.delta, report.metrics, report.env)
            else:
                snapshot = self._state.apply(report)
            self._show(snapshot)
        return snapshot

    def _show(self, snapshot: Snapshot) -> None:
        """Make ``snapshot`` what readers see (called in order, under the lock)."""

    def _publish(self, snapshot: Snapshot) -> None:
        """Send ``snapshot`` on (an exporter that pushes)."""

    def export(self, report: StepReport) -> None:
        self._publish(self._apply(report))

    def export_mismatch(self, report: MismatchReport) -> None:
        """Add trainer-side SPEC 11 sums (the live path) to the mismatch counters, and publish."""
        try:
            snapshot = self._apply(report)
        except Exception as exc:  # never into the trainer
            self._errors.record(self.name, "mismatch sums not exported", exc)
            return
        self._publish(snapshot)

    def state_dict(self) -> dict[str, Any]:
        """The cumulative series of the run (a monitor checkpoint holds them)."""
        with self._lock:
            return self._state.state_dict()

    def check_state_dict(self, state: Any, path: str) -> None:
        """Refuse a state :meth:`load_state_dict` would not take (``ConfigError``
        naming the key path)."""
        CumulativeState.check_state_dict(state, path)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the series (same start time) from ``state``, showing its last ship again."""
        with self._lock:
            snapshot = self._state.load_state_dict(state)
            if snapshot is not None:
                self._show(snapshot)

    def absorb(self, report: StepReport) -> None:
        """Fold a report exported before a restart into the run totals, without sending it again."""
        self._apply(report)

    def absorb_mismatch(self, report: MismatchReport) -> None:
        """Fold trainer-side sums exported before a restart into the run totals,
        without sending them again."""
        self._apply(report)
