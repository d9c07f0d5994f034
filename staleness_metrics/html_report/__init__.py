"""The HTML report of a run: staleness over steps, masking, drops, the histogram, a what-if curve
and what staleness costs. A run is replayed with the given config; logged metrics are plotted."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..config import StalenessConfig
from ..files import write_whole
from .data import ReportData, collect
from .html import render

__all__ = ["ReportData", "build_report", "collect", "render", "write_report"]


def build_report(run: str | Path, config: StalenessConfig | None = None,
                 what_if_bounds: Sequence[int] = (), title: str = "Staleness report",
                 ) -> str:  # fmt: skip
    """The report page of ``run`` as an HTML string."""
    return render(collect(run, config or StalenessConfig(), what_if_bounds), title)


def write_report(run: str | Path, out: str | Path, config: StalenessConfig | None = None,
                 what_if_bounds: Sequence[int] = (), title: str = "Staleness report",
                 ) -> Path:  # fmt: skip
    """Write the report page of ``run`` to ``out`` (replaced once whole); returns the path."""
    write_whole(path := Path(out), build_report(run, config, what_if_bounds, title))
    return path
