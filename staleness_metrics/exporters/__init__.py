"""Exporters: render each ship's report under the metric table's names (an optional dependency
is imported when its exporter class is first used)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .base import (
    BackgroundExporter,
    ExportContext,
    Exporter,
    ExportErrors,
    ExportQueue,
    MismatchAware,
    MismatchReport,
    MonitorAware,
)
from .console import ConsoleExporter
from .jsonl import JsonlExporter

if TYPE_CHECKING:
    from .otlp import OtlpExporter
    from .prometheus import PrometheusExporter, PrometheusPushExporter
    from .wandb import WandbExporter

__all__ = [
    "BackgroundExporter",
    "ConsoleExporter",
    "ExportContext",
    "ExportErrors",
    "ExportQueue",
    "Exporter",
    "JsonlExporter",
    "MismatchAware",
    "MismatchReport",
    "MonitorAware",
    "OtlpExporter",
    "PrometheusExporter",
    "PrometheusPushExporter",
    "WandbExporter",
]

_LAZY = {
    "OtlpExporter": ".otlp",
    "PrometheusExporter": ".prometheus",
    "PrometheusPushExporter": ".prometheus",
    "WandbExporter": ".wandb",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
