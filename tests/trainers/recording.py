"""An exporter that keeps what the monitor publishes, for tests that compare a trainer's numbers with ours."""

from __future__ import annotations

from staleness_metrics.exporters.base import MismatchReport
from staleness_metrics.metrics.report import StepReport


class Recorder:
    """Keeps every report the monitor publishes (what an exporter receives)."""

    name = "recorder"

    def __init__(self) -> None:
        self.reports: list[StepReport] = []
        self.mismatch: list[MismatchReport] = []

    def export(self, report: StepReport) -> None:
        self.reports.append(report)

    def export_mismatch(self, report: MismatchReport) -> None:
        self.mismatch.append(report)

    def close(self) -> None:
        pass
