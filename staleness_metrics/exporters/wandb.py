"""Weights & Biases exporter: one history row per ship under the metric table's W&B keys, logged
on a background queue (docs/exporters.md: own runs, ``commit=False``, ``close``)."""

from __future__ import annotations

import importlib.util
import sys
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..metrics import metric_table
from ..metrics.metric_table import KEY_PREFIX, LEGACY_KEYS, METRICS, WANDB_KEYS, Source, env_key
from ..metrics.report import StepReport
from .base import DEFAULT_CLOSE_TIMEOUT, DEFAULT_QUEUE_SIZE, MismatchReport, MissingExtra, QueuedExporter

DEFAULT_STEP_KEY = "trainer/step"
_MAX_BINS = 512  # wandb.Histogram's limit

_HISTOGRAM_ROW = next(m for m in METRICS if m.source is Source.TOKEN_HISTOGRAM)
_SCALAR_KEYS = {key for key, m in WANDB_KEYS.items() if m.source is not Source.TOKEN_HISTOGRAM}

# wandb.init is not safe to call from two threads at once (several exporters starting their runs).
_init_lock = threading.Lock()


def _legacy_selection(legacy_keys: bool | Iterable[str]) -> dict[str, str]:
    if legacy_keys is False:
        return {}
    if legacy_keys is True:
        return {old: entry.new for old, entry in LEGACY_KEYS.items() if entry.new is not None}
    chosen: dict[str, str] = {}
    for old in legacy_keys:
        entry = LEGACY_KEYS.get(old)
        if entry is None:
            raise ConfigError(f"legacy_keys: {old!r} is not a legacy key")
        if entry.new is None:
            raise ConfigError(f"legacy_keys: {old!r} was removed ({entry.reason}); nothing to write")
        chosen[old] = entry.new
    return chosen


def histogram_bins(counts: np.ndarray[Any, Any], highest: int = 0) -> tuple[list[int], list[float]]:
    """Counts and bin edges of an integer histogram: bin ``s`` spans ``[s - 0.5, s + 0.5)``; one
    longer than W&B's 512 bins is folded into 512 equal-width bins; the last reaches ``highest``."""
    trimmed = np.trim_zeros(np.asarray(counts, dtype=np.int64), "b")
    if len(trimmed) == 0:
        trimmed = np.zeros(1, dtype=np.int64)
    n = len(trimmed)
    edges = np.arange(n + 1, dtype=np.float64) - 0.5
    if n > _MAX_BINS:
        starts = np.arange(0, n, -(-n // _MAX_BINS))  # bins of equal width
        trimmed = np.add.reduceat(trimmed, starts)
        edges = np.append(starts - 0.5, n - 0.5)
    edges[-1] = max(edges[-1], highest + 0.5)
    return [int(c) for c in trimmed], [float(e) for e in edges]


class WandbExporter(QueuedExporter["StepReport | MismatchReport"]):
    """Logs each ship's metrics to a W&B run (``run``, else the active one, else its own started
    with ``init_kwargs``) against ``step_key`` (every ``staleness/*`` key's x-axis): the per-env
    keys, trainer-side mismatch rows, the token staleness histogram and, on request, legacy keys."""

    name = "wandb"

    def __init__(self, run: Any | None = None, *, step_key: str = DEFAULT_STEP_KEY,
                 legacy_keys: bool | Iterable[str] = False, histogram: bool = True,
                 commit: bool = True, init_kwargs: Mapping[str, Any] | None = None,
                 max_queue: int = DEFAULT_QUEUE_SIZE, retry_initial: float = 0.5,
                 retry_max: float = 10.0, close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
                 own_run: bool = False) -> None:  # fmt: skip
        if importlib.util.find_spec("wandb") is None:  # fail here, not on the worker for ever
            raise MissingExtra("WandbExporter", "wandb", "wandb")
        super().__init__()
        self._owns_run = self._finish_asked = False
        self._init_kwargs = dict(init_kwargs or {})
        # No import of wandb here (seconds): without it imported, no W&B run can be active either.
        if run is None and not own_run and "wandb" in sys.modules:
            run = sys.modules["wandb"].run
        self._run: Any | None = run
        self._run_lock = threading.Lock()
        self._step_key, self._commit = step_key, commit
        self._legacy = _legacy_selection(legacy_keys)
        self._histogram_key = _HISTOGRAM_ROW.wandb_key if histogram else None
        self._defined: set[str] = set()
        self._warned_unknown: set[str] = set()
        self._env_rows: dict[str, metric_table.MetricDef] = {}  # per-env key -> its table row
        needs_worker_start = run is None or self._histogram_key is not None  # import wandb there
        prepare = self._prepare_worker if needs_worker_start else None
        self._start_queue(self._log, max_queue, retry_initial, retry_max, close_timeout, prepare)

    @property
    def run(self) -> Any | None:
        """The W&B run logged into (None while the exporter's own run is still starting)."""
        return self._run

    def _prepare_worker(self) -> None:
        """On the worker, before any row: import wandb (seconds), start a run if none was given."""
        import wandb  # a run passed in already imported it: instant

        if self._run is not None:
            return
        with _init_lock:
            run = wandb.init(**self._init_kwargs)
        with self._run_lock:
            self._run, self._owns_run = run, True
            # close() gave up waiting for the start: don't leave the run open
            finish_now = self._finish_asked
        if finish_now:
            self._close_resources()

    def _close_resources(self) -> None:
        """Finish the exporter's own run, once (a run still starting: when it has started)."""
        with self._run_lock:
            self._finish_asked = True
            run = self._run if self._owns_run else None
            self._owns_run = False  # finished once
        if run is not None:
            try:
                run.finish()
            except Exception as exc:
                self._errors.record(self.name, "finishing the W&B run failed", exc)

    def row(self, report: StepReport | MismatchReport) -> dict[str, Any]:
        """The history row for a report (without the histogram object)."""
        metrics = report.metrics  # (a mismatch report's builds its dict anew each time)
        # every per-env key of the report: its table row
        named = ((env, key) for env, keys in report.env_metrics.items() if env for key in keys)
        env_rows = {env_key(env, key): WANDB_KEYS[key] for env, key in named if key in WANDB_KEYS}
        row: dict[str, Any] = {self._step_key: report.step}
        for key, value in metrics.items():
            if key in _SCALAR_KEYS:
                row[key] = value
            elif (env_row := env_rows.get(key)) is not None:
                row[key] = value
                self._env_rows.setdefault(key, env_row)
            elif key not in self._warned_unknown:
                self._warned_unknown.add(key)
                self._errors.record(self.name, f"key {key!r} is not in the metric table; not logged")
        for old, new in self._legacy.items():
            if new in metrics:
                row[old] = metrics[new]
        return row

    def export(self, report: StepReport) -> None:
        self._queue.put(report)  # its row is built on the worker

    def export_mismatch(self, report: MismatchReport) -> None:
        """A row of the step's trainer-side SPEC 11 and 14 keys (merged over its calls so far)."""
        self._queue.put(report)

    def _define(self, run: Any, keys: Iterable[str]) -> None:  # on the worker only
        if not self._defined:
            run.define_metric(self._step_key)
            run.define_metric(metric_table.KEY_GLOB, step_metric=self._step_key)
            self._defined.add(self._step_key)
        for key in keys:
            if key in self._defined or key == self._step_key:
                continue
            hidden = True if key in self._legacy else None
            # a legacy key takes its new key's summary
            row = WANDB_KEYS.get(self._legacy.get(key, key)) or self._env_rows.get(key)
            summary = None if row is None else row.wandb_summary
            # define_metric reads "." as nesting unless escaped, "*" as a glob, and has no escape of
            # "\\.": an env's key with either of these keeps the glob's axis only
            definable = "*" not in key and "\\." not in key
            if (hidden or summary or not key.startswith(KEY_PREFIX)) and definable:
                name = key.replace(".", "\\.")
                run.define_metric(name, step_metric=self._step_key, summary=summary, hidden=hidden)
            self._defined.add(key)

    def _log(self, report: StepReport | MismatchReport) -> None:
        run = self._run
        assert run is not None  # the worker started it before the first row
        row = self.row(report)
        self._define(run, row)
        tally = report.tally if isinstance(report, StepReport) else None
        if self._histogram_key is not None and tally is not None and tally.token_histogram.any():
            import wandb

            bins = histogram_bins(tally.token_histogram, tally.token_top_max)
            counts, edges = map(np.asarray, bins)
            row[self._histogram_key] = wandb.Histogram(np_histogram=(counts, edges))
        run.log(row, commit=self._commit)
