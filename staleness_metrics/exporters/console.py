"""Console exporter: one line per ship, led by ``Max Staleness`` (once ``Max Off-Policy``)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TextIO

from ..metrics import keys
from ..metrics.report import MetricValue, StepReport
from .base import MismatchReport


def format_line(report: StepReport) -> str:
    """``step 12 | Max Staleness 3 | token mean 1.42 | masked 3.1% | dropped 2 rollouts`` (``-``
    for a statistic whose population was empty)."""
    metrics = report.metrics
    parts = [
        f"step {report.step}",
        f"Max Staleness {_number(metrics, keys.ROLLOUT_MAX, 'd')}",
        f"token mean {_number(metrics, keys.TOKEN_MEAN, '.2f')}",
        f"masked {_number(metrics, keys.TOKEN_MASKED, '.1%')}",
        f"dropped {int(metrics.get(keys.ROLLOUTS_DROPPED, 0))} rollouts",
    ]
    if held := int(metrics.get(keys.ROLLOUTS_HELD, 0)):
        parts.append(f"held {held} rollouts")
    # SPEC 11: what staleness costs, when the records carried trainer log-probs
    if keys.MISMATCH_EXCESS_K3 in metrics:
        parts.append(f"excess k3 {float(metrics[keys.MISMATCH_EXCESS_K3]):.4g}")
    parts.extend(_bound_parts(metrics))
    return " | ".join(parts)


def _number(metrics: Mapping[str, MetricValue], key: str, fmt: str) -> str:
    return format(metrics[key], fmt) if key in metrics else "-"


def _bound_parts(metrics: Mapping[str, MetricValue]) -> list[str]:
    # SPEC 14: ``floor 0.0008 lag0 | at bound 0.0003 | suggested 6 (...)``
    if keys.MISMATCH_FLOOR not in metrics:
        return []
    source = metrics.get(keys.MISMATCH_FLOOR_SOURCE, "")
    age = int(metrics.get(keys.MISMATCH_FLOOR_AGE, 0))
    floor = f"floor {float(metrics[keys.MISMATCH_FLOOR]):.4g} {source}" + (f" {age} steps ago" if age else "")
    suggested = "-"
    if keys.BOUND_SUGGESTED in metrics:
        crossed = int(metrics.get(keys.BOUND_CROSSED, 0))
        advice = " (budget crossed)" if crossed else " (largest lag seen)"
        suggested = f"{int(metrics[keys.BOUND_SUGGESTED])}{advice}"
    at_bound = _number(metrics, keys.BOUND_EXCESS_AT_BOUND, ".4g")
    return [floor, f"at bound {at_bound}", f"suggested {suggested}"]


def format_mismatch_line(report: MismatchReport) -> str:
    """The line of the step's trainer-side sums merged so far (``-`` where a key is absent):
    ``step 12 | mismatch k3 0.0031 | excess k3 0.0012 | coverage 98.0% | floor ...``."""
    metrics = report.metrics
    parts = [
        f"step {report.step}",
        f"mismatch k3 {_number(metrics, keys.MISMATCH_K3, '.4g')}",
        f"excess k3 {_number(metrics, keys.MISMATCH_EXCESS_K3, '.4g')}",
        f"coverage {_number(metrics, keys.MISMATCH_COVERAGE, '.1%')}",
    ]
    return " | ".join([*parts, *_bound_parts(metrics)])


class ConsoleExporter:
    """Prints :func:`format_line` for each ship to ``stream`` (stdout by default), on the caller's
    thread; through rich (colour) when it is installed and the stream is a terminal."""

    name = "console"

    def __init__(self, stream: TextIO | None = None, *, use_rich: bool | None = None) -> None:
        self._stream = stream
        self._use_rich = use_rich

    def export(self, report: StepReport) -> None:
        self._print(format_line(report))

    def export_mismatch(self, report: MismatchReport) -> None:
        self._print(format_mismatch_line(report))

    def _print(self, line: str) -> None:
        stream = self._stream if self._stream is not None else sys.stdout
        isatty = getattr(stream, "isatty", None)
        if self._use_rich if self._use_rich is not None else bool(isatty and isatty()):
            try:
                from rich.console import Console
                from rich.text import Text
            except ImportError:
                pass
            else:
                text = Text(line)
                text.highlight_words(["Max Staleness"], style="bold")
                Console(file=stream, highlight=False, soft_wrap=True).print(text)
                return
        print(line, file=stream, flush=True)

    def close(self) -> None:
        (self._stream if self._stream is not None else sys.stdout).flush()
