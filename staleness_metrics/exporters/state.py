"""Cumulative per-run state behind the Prometheus and OTLP exporters: each ship folds into an
immutable :class:`Snapshot` whose series are computed when first read (docs/exporters.md)."""

from __future__ import annotations

import copy
import functools
import itertools
import operator
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..metrics import metric_table
from ..metrics.buckets import BUCKETS, HISTOGRAM_TOP
from ..metrics.keys import MISMATCH_FLOOR_SOURCE
from ..metrics.metric_table import MetricDef, MetricKind, Source
from ..metrics.mismatch import MismatchSums
from ..metrics.report import Counts, MetricValue, StepReport, Tally
from .base import DEFAULT_RUN, CountingExporter, ExportContext, MismatchReport

Number = int | float
KeysByEnv = Mapping[str, Mapping[str, MetricValue]]  # W&B keys and values by env


@dataclass(frozen=True)
class HistogramPoint:
    """A histogram over :data:`BUCKETS`; the last count is of the values above ``BUCKETS[-1]``."""

    bucket_counts: tuple[int, ...]
    sum: int
    count: int
    min: int | None  # None when empty
    max: int | None

    def cumulative(self) -> list[int]:
        """Counts of values ``<= BUCKETS[i]`` (and the total last), as Prometheus ``le`` buckets."""
        return list(itertools.accumulate(self.bucket_counts))


_INT_BOUNDS = np.asarray(BUCKETS, dtype=np.int64)  # integers: value <= b <=> value <= int(b)


def bucket_counts(histogram: Counts, beyond: int = 0, top_min: int = 0,
                  top_max: int = 0) -> HistogramPoint:  # fmt: skip
    """Map an integer histogram (index = staleness) onto :data:`BUCKETS` exactly; what its last
    index holds (from :data:`HISTOGRAM_TOP` up) by its staleness beyond it, lowest and highest."""
    n = len(histogram)
    nonzero = np.flatnonzero(histogram)
    if len(nonzero) == 0:
        return HistogramPoint((0,) * (len(BUCKETS) + 1), 0, 0, None, None)
    cumulative = np.cumsum(histogram, dtype=np.int64)
    at_bounds = cumulative[np.minimum(_INT_BOUNDS, n - 1)]  # values <= each bound
    counts = [*np.diff(at_bounds, prepend=0).tolist(), int(cumulative[-1] - at_bounds[-1])]
    low = int(nonzero[0]) if nonzero[0] < HISTOGRAM_TOP else max(HISTOGRAM_TOP, top_min)
    total = sum(map(operator.mul, range(n), histogram.tolist())) + beyond  # (exact beyond int64)
    high = max(int(nonzero[-1]), top_max)
    return HistogramPoint(tuple(counts), total, int(cumulative[-1]), low, high)


def partition_by_env(report: StepReport, by_env: bool = True) -> dict[str, Tally]:
    """The window's tallies by env; ``""``: rollouts without env, and whatever no env covers."""
    if not by_env or not report.env_tally:
        return {"": report.tally}
    parts = dict(report.env_tally)
    covered = sum(parts.values(), Tally())
    if not report.tally.within(covered):
        parts[""] = parts.get("", Tally()) + report.tally.excess_over(covered)
    return parts


# the length counters' env "" series is summed here; the mismatch family's is the batch's sums
_SUMMED_BATCH_WIDE = frozenset(name for name in metric_table.BATCH_WIDE_COUNTERS if name.startswith("length_"))


def _as_number(metric: MetricDef, value: object) -> Number:
    number = float(value)  # type: ignore[arg-type]
    return int(number) if metric.integer else number


# Gauges some exporter shows (the W&B-only ratio rows are derived from counters elsewhere).
_GAUGES = tuple(m for m in metric_table.METRICS if m.kind is MetricKind.GAUGE)
_PUBLISHED_GAUGES = tuple(m for m in _GAUGES if m.prometheus_name is not None)
_BOUND_KEYS = frozenset(key for m in _GAUGES if m.source is Source.BOUND for key in m.wandb_keys)


def split_env_key(key: str, batch_keys: frozenset[str] = _BOUND_KEYS) -> tuple[str, str] | None:
    """(env, batch-wide key) of a key of ``batch_keys`` (SPEC 14's), its env ``""`` when it is
    batch-wide; else None. An env's name may hold '/': the batch-wide key is told by its suffix."""
    if key in batch_keys:
        return "", key
    rest = key.removeprefix(metric_table.ENV_KEY_PREFIX)
    at = rest.find("/", 1) if rest != key else -1  # (an env's name is not empty)
    while at > 0 and (batch_key := metric_table.KEY_PREFIX + rest[at + 1 :]) not in batch_keys:
        at = rest.find("/", at + 1)
    return (rest[:at], batch_key) if at > 0 else None


def _bound_keys(metrics: Mapping[str, MetricValue]) -> dict[str, MetricValue]:
    return {key: value for key, value in metrics.items() if split_env_key(key) is not None}


def _bound_values(metric: MetricDef, by_env: KeysByEnv) -> dict[Any, Number]:
    key = metric.wandb_key or ""
    values: dict[Any, Number] = {}
    for env, found in sorted(by_env.items()):
        if metric.dimension is None:
            if key in found:
                values[env] = _as_number(metric, found[key])
        elif metric.dimension.placeholder in key:  # one key per bucket (the curve)
            for bucket_key, value in zip(metric.wandb_keys, metric.dimension.values, strict=True):
                if bucket_key in found:
                    values[(env, value)] = _as_number(metric, found[bucket_key])
        else:  # one key, its label from another key (the floor and its source)
            if key in found and isinstance(source := found.get(MISMATCH_FLOOR_SOURCE), str):
                values[(env, source)] = _as_number(metric, found[key])
    return values


def histogram_of(metric: MetricDef, tally: Tally) -> tuple[Counts, int, int, int]:
    """A histogram of ``tally``, and its last index's staleness beyond it, lowest and highest."""
    of = "token" if metric.source is Source.TOKEN_HISTOGRAM else "rollout"
    parts = ("_histogram", "_beyond", "_top_min", "_top_max")
    return tuple(getattr(tally, of + part) for part in parts)  # type: ignore[return-value]


def _counter(metric: MetricDef, holders: Mapping[str, Any]) -> dict[Any, Number]:
    """A counter's values by env, or by (env, bucket value) with every bucket present."""
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
    """Counters and histograms over the run or one ship: metric name, then env (or env, bucket)."""

    counters: dict[str, Mapping[Any, Number]]
    histograms: dict[str, Mapping[str, HistogramPoint]]


def _series(tallies: Mapping[str, Tally], mismatch: MismatchSums | None,
            env_mismatch: Mapping[str, MismatchSums]) -> Series:  # fmt: skip
    # the mismatch family: the batch's sums under env "", then each env's (live sums given per env)
    sums = {} if mismatch is None else {"": mismatch, **dict(sorted(env_mismatch.items()))}
    out = Series({}, {})
    for metric in metric_table.METRICS:
        if metric.kind is MetricKind.HISTOGRAM:
            points = {env: bucket_counts(*histogram_of(metric, t)) for env, t in tallies.items()}
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
        return _series(dict(sorted(self.totals.items())), self.mismatch, self.env_mismatch)

    @functools.cached_property
    def delta(self) -> Series:
        """What this ship (or these trainer-side sums) added (OTLP delta temporality)."""
        window = dict(sorted(self.window.items()))
        return _series(window, self.mismatch_delta, self.env_mismatch_delta)

    @functools.cached_property
    def gauges(self) -> dict[str, Mapping[Any, Number]]:
        """The last ship's gauges and SPEC 14's, by env (or (env, source) and (env, lag))."""
        bound: dict[str, dict[str, MetricValue]] = {}  # SPEC 14's keys by env (the batch's: "")
        for key, value in (self.bound_metrics or {}).items():
            if (split := split_env_key(key)) is not None:
                bound.setdefault(split[0], {})[split[1]] = value
        return {m.name: self._gauge(m, bound) for m in _PUBLISHED_GAUGES}

    def _gauge(self, metric: MetricDef, bound: KeysByEnv) -> dict[Any, Number]:
        if metric.source is Source.BOUND:
            return _bound_values(metric, bound)
        report = self.gauge_report
        if report is None:
            return {}
        if metric.source is Source.STEP:
            return {"": report.step}
        per_env = self.by_env and "env" in metric.labels
        if metric.source is Source.METRIC:
            key = metric.wandb_key or ""
            envs = {e: m for e, m in report.env_metrics.items() if e and per_env}
            rows = {"": report.metrics, **envs}
            return {env: _as_number(metric, row[key]) for env, row in rows.items() if key in row}
        if metric.source is Source.TALLY:
            field = metric.tally_field or ""
            tallies = {e: t for e, t in report.env_tally.items() if e and per_env}
            tallies = {"": report.tally, **tallies}
            return {env: _as_number(metric, getattr(t, field)) for env, t in tallies.items()}
        return {}

    def points(self, metric: MetricDef, series: Series) -> list[tuple[str, str | None, Number]]:
        """(env, bucket value or None, value) of a gauge's or a counter's series."""
        values = self.gauges if metric.kind is MetricKind.GAUGE else series.counters
        found = values.get(metric.name, {}).items()
        return [(*key, v) if isinstance(key, tuple) else (key, None, v) for key, v in found]


class CumulativeState:
    """Folds reports into run totals, returning a new immutable :class:`Snapshot` each time
    (callers serialize the folds; a snapshot may be read from any thread)."""

    def __init__(self, run: str, by_env: bool = False) -> None:
        self.run, self.by_env = run, by_env
        self._totals: dict[str, Tally] = {}
        self._mismatch: MismatchSums | None = None  # SPEC 11 sums over the run, once any arrived
        self._env_mismatch: dict[str, MismatchSums] = {}  # live sums given per env (env breakdown)
        self._start_ns = self._last_ns = time.time_ns()
        self._last_report: StepReport | None = None  # the last ship's: the gauges show it
        self._bound_metrics: dict[str, MetricValue] | None = None  # of the last report with SPEC 11
        self._bound_step: int | None = None  # its step

    def state_dict(self) -> dict[str, Any]:
        from ..engine.checkpoint import report_to_dict, tally_to_dict

        return {
            "totals": {env: tally_to_dict(tally) for env, tally in self._totals.items()},
            "mismatch": None if self._mismatch is None else self._mismatch.to_dict(),
            "start_time_ns": self._start_ns,
            "last_report": None if self._last_report is None else report_to_dict(self._last_report),
            "bound_metrics": self._bound_metrics,
            "bound_step": self._bound_step,
            "env_mismatch": {env: sums.to_dict() for env, sums in self._env_mismatch.items()},
        }

    def loaded(self, state: Any, path: str) -> CumulativeState:
        """A copy going on from :meth:`state_dict`'s, checked first (older ones lack SPEC 14's)."""
        from ..engine.checkpoint import check_metrics, check_mismatch, check_report, check_tally
        from ..state_checks import integer, join, keys, mapping, string

        required = ("totals", "mismatch", "start_time_ns", "last_report")
        found = keys(state, path, required, ("bound_metrics", "bound_step", "env_mismatch"))
        at = functools.partial(join, path)

        def by_env(items: Mapping[Any, Any], where: str, check: Any) -> dict[str, Any]:
            return {string(e, where): check(v, join(where, e)) for e, v in items.items()}

        totals = mapping(found["totals"], at("totals"))
        envs = mapping(found.get("env_mismatch", {}), at("env_mismatch"))
        out = copy.copy(self)
        out._totals = by_env(totals, at("totals"), check_tally)
        mismatch, last, bound = found["mismatch"], found["last_report"], found.get("bound_metrics")
        out._mismatch = None if mismatch is None else check_mismatch(mismatch, at("mismatch"))
        out._start_ns = integer(found["start_time_ns"], at("start_time_ns"), 0)  # never reset
        out._last_report = None if last is None else check_report(last, at("last_report"))
        out._bound_metrics = None if bound is None else check_metrics(bound, at("bound_metrics"))
        step = found.get("bound_step")
        out._bound_step = None if step is None else integer(step, at("bound_step"), 0)
        if step is None and bound is not None and out._last_report is not None:  # (saved before it)
            out._bound_step = out._last_report.step  # the gauges are the latest ship's
        out._env_mismatch = by_env(envs, at("env_mismatch"), check_mismatch)
        out._last_ns = max(self._last_ns, out._start_ns)
        return out

    def shown(self) -> Snapshot | None:
        return None if self._last_report is None else self._snapshot({}, None)

    def apply(self, report: StepReport) -> Snapshot:
        """Fold in a ship: its tallies, its gauges and its mismatch sums (when it had them)."""
        window = partition_by_env(report, self.by_env)
        for env, tally in window.items():
            self._totals[env] = self._totals.get(env, Tally()) + tally
        env_delta = dict(report.env_mismatch) if self.by_env else {}
        self._add_mismatch(report.mismatch, env_delta)
        if report.mismatch is not None:
            self._bound_metrics, self._bound_step = _bound_keys(report.metrics), report.step
        self._last_report = report
        return self._snapshot(window, report.mismatch, env_delta)

    def apply_mismatch(self, step: int, delta: MismatchSums,
                       metrics: Mapping[str, MetricValue] | None = None,
                       env: str | None = None) -> Snapshot:  # fmt: skip
        """Fold in trainer-side sums of ``step`` (the live path): the counters move (an ``env``'s
        too, with the env breakdown), the last ship's gauges stay, SPEC 14's take ``metrics``."""
        env_delta = {env: delta} if env and self.by_env else {}
        self._add_mismatch(delta, env_delta)
        # the batch's keys, and the env's for the sums of one env; other envs of the step stay;
        # a later step's too (a rank's late sums of an older step: the gauges are the latest's)
        if metrics is not None and step >= (self._bound_step or 0):
            new = _bound_keys(metrics)
            envs = {"", *(split[0] for split in map(split_env_key, new) if split is not None)}
            old = (self._bound_metrics or {}).items() if step == self._bound_step else ()
            kept = {k: v for k, v in old if (split_env_key(k) or ("",))[0] not in envs}
            self._bound_metrics, self._bound_step = {**kept, **new}, step
        return self._snapshot({env: Tally() for env in self._totals}, delta, env_delta)

    def _add_mismatch(self, sums: MismatchSums | None, by_env: Mapping[str, MismatchSums]) -> None:
        if sums is not None:
            self._mismatch = sums if self._mismatch is None else self._mismatch + sums
        for env, env_sums in by_env.items():
            self._env_mismatch[env] = self._env_mismatch.get(env, MismatchSums.zero()) + env_sums

    def _snapshot(self, window: Mapping[str, Tally], mismatch_delta: MismatchSums | None,
                  env_mismatch_delta: Mapping[str, MismatchSums] | None = None,
                  ) -> Snapshot:  # fmt: skip
        if mismatch_delta is None and self._mismatch is not None:
            mismatch_delta = MismatchSums.zero()
        now = max(time.time_ns(), self._last_ns + 1)  # strictly increasing timestamps
        step = 0 if self._last_report is None else self._last_report.step
        snapshot = Snapshot(
            run=self.run, by_env=self.by_env, step=step, start_time_ns=self._start_ns,
            previous_time_ns=self._last_ns, time_ns=now, totals=dict(self._totals), window=window,
            mismatch=self._mismatch, env_mismatch=dict(self._env_mismatch),
            mismatch_delta=mismatch_delta, env_mismatch_delta=env_mismatch_delta or {},
            gauge_report=self._last_report, bound_metrics=self._bound_metrics,
        )  # fmt: skip
        self._last_ns = now
        return snapshot


class CumulativeExporter(CountingExporter):
    """Base of the exporters whose series are cumulative (Prometheus, OTLP): the run state, kept
    across a restart by the monitor's checkpoint (SPEC 13)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._state = CumulativeState(DEFAULT_RUN)

    def _after_fork(self) -> None:
        super()._after_fork()
        self._lock = threading.Lock()

    def attach(self, context: ExportContext) -> None:
        with self._lock:
            if (context.run, context.env_breakdown) != (self._state.run, self._state.by_env):
                self._state = CumulativeState(context.run, context.env_breakdown)
        super().attach(context)

    def _apply(self, report: StepReport | MismatchReport) -> Snapshot:
        with self._lock:  # reports are folded in order, one at a time
            if isinstance(report, MismatchReport):
                # counters add this call's sums; SPEC 14's gauges show the step's merged sums
                step, delta, env = report.step, report.delta, report.env
                snapshot = self._state.apply_mismatch(step, delta, report.metrics, env)
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
        with self._lock:
            return self._state.state_dict()

    def check_state_dict(self, state: Any, path: str) -> None:
        """Raise the ``ConfigError`` :meth:`load_state_dict` would, loading nothing."""
        self._state.loaded(state, path)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the series (same start time) from ``state``, showing its last ship again."""
        with self._lock:
            self._state = self._state.loaded(state, "state")
            if (snapshot := self._state.shown()) is not None:
                self._show(snapshot)

    def absorb(self, report: StepReport | MismatchReport) -> None:
        """Fold a report (or trainer-side sums) exported before a restart in, sending nothing."""
        self._apply(report)
