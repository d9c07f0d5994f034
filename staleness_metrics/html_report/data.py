"""What a report shows, gathered from a run input: per-step rows, histograms, what-if and comparison."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..adapters import SourceKind, compare_prime_rl, detect_source, read_run
from ..adapters.events import iter_json_lines
from ..adapters.prime_rl import ComparisonRow, has_rollouts
from ..bound import FLOOR_SOURCES
from ..config import StalenessConfig
from ..errors import EventError
from ..metric_table import LEGACY_KEYS
from ..replay import replay
from ..report import Tally
from ..what_if import WhatIfRow, run_tally, what_if

__all__ = ["ReportData", "collect", "metrics_rows"]

_STEP_KEYS = ("step", "trainer/step")


@dataclass
class ReportData:
    """Everything one report draws. ``histograms`` and ``totals`` exist when rollouts were replayed."""

    source: str
    kind: SourceKind
    policy: str | None
    bound: int | None
    rows: list[dict[str, Any]]
    histograms: list[npt.NDArray[np.int64]] | None = None
    totals: Tally | None = None
    what_if: list[WhatIfRow] = field(default_factory=list)
    comparison: list[ComparisonRow] = field(default_factory=list)

    @property
    def steps(self) -> list[int]:
        return [int(row["step"]) for row in self.rows]

    def series(self, key: str) -> list[float | None]:
        return [row.get(key) for row in self.rows]


def _current_keys(row: dict[str, Any], path: str | Path, line: int) -> dict[str, Any]:
    """A logged row's scalar staleness values, legacy keys renamed (a current key wins over its legacy twin).

    ``null`` is a step without that value and media objects (a logged W&B histogram) are not plotted;
    anything else that is not a number is an error naming the line and the key.
    """
    out: dict[str, Any] = {}
    for key, value in row.items():
        legacy = LEGACY_KEYS.get(key)
        name = key if key.startswith("staleness/") else legacy.new if legacy is not None else None
        if name is None or value is None or isinstance(value, dict):
            continue
        if key.endswith("/floor_source"):  # SPEC 14's one string value
            if value not in FLOOR_SOURCES:
                raise EventError(line, f"{path}: {key}: expected one of {', '.join(FLOOR_SOURCES)}, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise EventError(line, f"{path}: {key}: expected a number, got {value!r}")
        if key == name or name not in row:
            out[name] = value
    return out


def metrics_rows(path: str | Path) -> list[dict[str, Any]]:
    """Logged rows by step (rows of one step merged), keys renamed to the current ones."""
    merged: dict[int, dict[str, Any]] = {}
    for line, value in iter_json_lines(path):
        if not isinstance(value, dict):
            continue
        step = next((value[k] for k in _STEP_KEYS if _is_step(value.get(k))), None)
        if step is None:
            continue
        merged.setdefault(step, {}).update(_current_keys(value, path, line))
    return [{"step": step, **merged[step]} for step in sorted(merged) if merged[step]]


def _is_step(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def collect(run: str | Path, config: StalenessConfig, what_if_bounds: Sequence[int] = ()) -> ReportData:
    """Replay ``run`` with ``config`` (or read its logged metrics) and gather what the report draws."""
    kind = detect_source(run)
    source = str(run)
    if kind == "metrics" or (kind == "prime-rl" and not has_rollouts(run)):
        path = Path(run) / "metrics.jsonl" if kind == "prime-rl" else Path(run)
        rows = metrics_rows(path)
        bounds = [r["staleness/max_staleness"] for r in rows if "staleness/max_staleness" in r]
        return ReportData(source, kind, None, int(bounds[-1]) if bounds else None, rows)
    shipments = replay(read_run(run, max_staleness=config.max_staleness), config)
    data = ReportData(
        source,
        kind,
        config.policy,
        config.max_staleness,
        [dict(s.report.row()) for s in shipments],
        [s.report.tally.token_histogram for s in shipments],
        run_tally(shipments),
    )
    if what_if_bounds:
        bounds = sorted(set(what_if_bounds))
        data.what_if = what_if(run, bounds, config)
    if kind == "prime-rl" and (Path(run) / "metrics.jsonl").is_file():
        data.comparison = compare_prime_rl(run, [s.report for s in shipments])
    return data
