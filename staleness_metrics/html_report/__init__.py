"""The HTML report of a run: staleness over steps, masking, drops, the
histogram and a what-if curve.

``RUN`` is an event stream, a prime-rl run directory, xtuner states (replayed with the given config)
or a logged metrics JSONL (plotted as logged; the histogram and what-if need rollouts).
:func:`collect` gathers what the page draws, :func:`render` writes it.
"""

from __future__ import annotations

from .data import ReportData, collect
from .html import render

__all__ = ["ReportData", "collect", "render"]
