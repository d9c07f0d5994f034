"""What a report shows, gathered from a run input: per-step rows, histograms, what-if, the
SPEC 14 curve and the prime-rl comparison."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..config import StalenessConfig
from ..engine.sink import Sink
from ..errors import EventError
from ..exporters.state import split_env_key
from ..metrics import keys, metric_table
from ..metrics.buckets import FLOOR_SOURCES, LAG_BUCKETS
from ..metrics.metric_table import KEY_PREFIX, LEGACY_KEYS
from ..metrics.mismatch import MismatchSums
from ..metrics.report import StepReport, Tally
from ..replay import sources
from ..replay.run_dir import RunDirectory, find_run
from ..replay.sources.events import iter_json_lines
from ..replay.sources.prime_rl import ComparisonRow, has_rollouts, read_prime_rl_metrics
from ..replay.stream import Event, run_events
from ..replay.what_if import RunCurve, WhatIfRow, run_curve, run_tally, what_if_with_curve

_STEP_KEYS = ("step", "trainer/step")
_SHIP_KEYS = frozenset((keys.MAX_STALENESS, keys.ROLLOUTS_DROPPED))  # every ship's row has them


@dataclass
class ReportData:
    """Everything one report draws; ``histograms`` and ``totals`` when rollouts were replayed."""

    source: str
    kind: str  # a SourceKind, or "run" for a run directory
    policy: str | None
    bound: int | None
    rows: list[dict[str, Any]]
    histograms: list[npt.NDArray[np.int64]] | None = None  # one per row
    totals: Tally | None = None
    what_if: list[WhatIfRow] = field(default_factory=list)
    comparison: list[ComparisonRow] = field(default_factory=list)
    curve: RunCurve | None = None  # SPEC 14 over the whole run
    curve_source: str = ""  # where the curve's sums came from, said under the figure
    # what the reader of a prime-rl run or a metrics file left out or set aside
    read_notes: list[str] = field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        return [int(row["step"]) for row in self.rows]

    @property
    def steps_shipped(self) -> int:
        """The steps with a ship: a row of the trainer's sums alone is a logged step without one."""
        return len({r["step"] for r in self.rows if not all(map(_from_sums, r.keys() - {"step"}))})

    def series(self, key: str) -> list[float | None]:
        return [row.get(key) for row in self.rows]


# The floor's source and its per-env twins (``staleness/env/<env>/mismatch/floor_source``) end so.
_FLOOR_SOURCE_SUFFIX = "/" + keys.MISMATCH_FLOOR_SOURCE.removeprefix(KEY_PREFIX)


def _current_keys(row: dict[str, Any], path: str | Path, line: int) -> dict[str, Any]:
    """A logged row's scalar staleness values, legacy keys renamed (a current key wins); nulls and
    media objects are skipped, any other value that is not a number is an error."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        legacy = LEGACY_KEYS.get(key)
        name = key if key.startswith(KEY_PREFIX) else legacy.new if legacy is not None else None
        if name is None or value is None or isinstance(value, dict):
            continue
        if key.endswith(_FLOOR_SOURCE_SUFFIX):  # SPEC 14's one string value
            if value not in FLOOR_SOURCES:
                choices = ", ".join(FLOOR_SOURCES)
                raise EventError(line, f"{path}: {key}: expected one of {choices}, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise EventError(line, f"{path}: {key}: expected a number, got {value!r}")
        if key == name or name not in row:
            out[name] = value
    return out


def metrics_rows(path: str | Path, notes: list[str]) -> list[dict[str, Any]]:
    """Logged rows by step, current keys: a ship's own (SPEC 4: several a step), one without its
    keys (the trainer's sums) joined to its step's last. Numbers not finite or past 2**63 (no
    count or mean reaches it) are left out, as is a torn last line; ``notes`` say so."""
    rows: list[dict[str, Any]] = []
    last: dict[int, dict[str, Any]] = {}  # each step's last row
    skipped: list[str] = []
    for line, value in iter_json_lines(path, notes):
        if not isinstance(value, dict):
            continue
        step = next((value[k] for k in _STEP_KEYS if type(value.get(k)) is int), None)  # not a bool
        if step is None:
            continue
        row = _current_keys(value, path, line)
        for key in [k for k, v in row.items() if not isinstance(v, str) and not abs(v) < 2**63]:
            skipped.append(f"line {line} {key} ({row.pop(key)})")
        into = last.get(step)  # a ship's row after one starts a row of its own
        if into is None or not (_SHIP_KEYS.isdisjoint(row) or _SHIP_KEYS.isdisjoint(into)):
            rows.append(into := {"step": step})
            last[step] = into
        into.update(row)
    if skipped:
        more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        notes.append(f"{path}: left out, not finite or past 2^63: {', '.join(skipped[:3])}{more}")
    return sorted((row for row in rows if len(row) > 1), key=lambda row: int(row["step"]))


def sums_from_rows(rows: list[dict[str, Any]]) -> MismatchSums | None:
    """The per-lag token counts and k3 sums behind logged rows, over all steps (floor and curve)."""
    sums, found = MismatchSums.zero(), False
    for row in rows:
        for index, bucket in enumerate(LAG_BUCKETS):
            tokens = row.get(keys.MISMATCH_TOKENS_BY_LAG[bucket])
            k3 = row.get(keys.MISMATCH_K3_BY_LAG[bucket])
            if isinstance(tokens, (int, float)) and isinstance(k3, (int, float)) and tokens > 0:
                sums.tokens[index] += int(tokens)
                sums.sum_k3[index] += float(k3) * int(tokens)
                found = True
    return sums if found else None


_SUMS_PREFIXES = (metric_table.MISMATCH_KEY_PREFIX, metric_table.BOUND_KEY_PREFIX)
_SUMS_KEYS = frozenset(key for key in metric_table.WANDB_KEYS if key.startswith(_SUMS_PREFIXES))


def _from_sums(key: str) -> bool:
    """Whether ``key`` is of the trainer's sums (SPEC 11 and 14), batch-wide or per env."""
    return split_env_key(key, _SUMS_KEYS) is not None


def _fill_from(data: ReportData, logged: list[dict[str, Any]]) -> None:
    """Adds what the replay cannot compute, the trainer's sums as the run logged them, to the
    last ship of their step (or a step of their own, no tokens); all else is the replay's."""
    ships = list(zip(data.rows, data.histograms or [], strict=True))
    last = {int(row["step"]): row for row in data.rows}
    for row in logged:
        sums = {key: value for key, value in row.items() if _from_sums(key)}
        if row["step"] in last:
            last[row["step"]].update(sums)
        elif sums:
            ships.append(({"step": row["step"], **sums}, np.zeros(1, dtype=np.int64)))
    ships.sort(key=lambda ship: int(ship[0]["step"]))  # (stable: ships of one step in their order)
    data.rows, data.histograms = [row for row, _ in ships], [histogram for _, histogram in ships]


def _reports(events: Iterable[Event], config: StalenessConfig) -> list[StepReport]:
    """Each ship's report, its shipment let go (it holds the queue's arrays: ~30 KB a ship)."""
    return [shipment.report for shipment in run_events(events, Sink(config), read_ahead=True)]


def _replayed(source: str, kind: str, config: StalenessConfig, reports: list[StepReport]) -> ReportData:
    rows, histograms = [dict(r.row()) for r in reports], [r.tally.token_histogram for r in reports]
    return ReportData(source, kind, config.policy, config.max_staleness, rows, histograms, run_tally(reports))


def _collect_run(run: RunDirectory, config: StalenessConfig, what_if: Sequence[int]) -> ReportData:
    data = _replayed(str(run.root), "run", config, _reports(run.events_with_costs(), config))
    # the trainer's sums as logged, unless the replay had its log-probabilities to compute them
    if run.metrics is not None and not any(_from_sums(key) for row in data.rows for key in row):
        _fill_from(data, metrics_rows(run.metrics, data.read_notes))
    bounds = sorted({*what_if, config.max_staleness}) if what_if else [config.max_staleness]
    result = what_if_with_curve(run.root, bounds, config)
    data.what_if = result.rows if what_if else []
    if result.curve is not None:
        data.curve, data.curve_source = result.curve, "the records' trainer log-probabilities"
    else:
        posted = run.posted_sums()
        pooled = sum((sums for _, sums in posted), MismatchSums.zero()) if posted else None
        data.curve, data.curve_source = run_curve(pooled, config), "the sums the trainer posted"
    return data


def collect(run: str | Path, config: StalenessConfig, what_if_bounds: Sequence[int] = ()) -> ReportData:
    """What the report draws: ``run`` replayed with ``config``, or its logged metrics read."""
    directory = find_run(run)  # a run directory, or the event stream of one: the whole directory
    if directory is not None:
        return _collect_run(directory, config, what_if_bounds)
    kind = "events" if sources.is_event_file(run) else sources.detect_source(run)
    if kind == "metrics" or (kind == "prime-rl" and not has_rollouts(run)):
        path = Path(run) / "metrics.jsonl" if kind == "prime-rl" else Path(run)
        data = ReportData(str(run), kind, None, None, [])
        data.rows = rows = metrics_rows(path, data.read_notes)
        bounds = [r[keys.MAX_STALENESS] for r in rows if keys.MAX_STALENESS in r]
        data.bound = int(bounds[-1]) if bounds else None
        data.curve = run_curve(sums_from_rows(rows), config)
        data.curve_source = "the logged k3 and tokens by lag"
        return data
    limits: dict[str, Any] = {"max_staleness": config.max_staleness, "strict": config.strict}
    current = kind == "prime-rl" and sources.is_current_layout(run)
    read = sources.read_run_events(run, **limits) if current else None
    reports = _reports(read if read is not None else sources.read_run(run, **limits), config)
    data = _replayed(str(run), kind, config, reports)
    if what_if_bounds:
        result = what_if_with_curve(run, sorted(set(what_if_bounds)), config)
        data.what_if = result.rows
        data.curve, data.curve_source = result.curve, "the records' trainer log-probabilities"
    if read is not None:
        said = (read.notes.left_out(), read.notes.damage.summary())
        data.read_notes = [f"prime-rl run: {line}" for line in said if line]
    if kind == "prime-rl" and (logged := read_prime_rl_metrics(run, data.read_notes)):  # torn: said
        notes = read.notes if read else None
        data.comparison = sources.compare_prime_rl(run, reports, historical=logged, notes=notes)
    return data
