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
    MissingExtra,
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

_LAZY = {  # name: its module, and the extra that installs what the module imports
    "OtlpExporter": (".otlp", "otlp"),
    "PrometheusExporter": (".prometheus", "prometheus"),
    "PrometheusPushExporter": (".prometheus", "prometheus"),
    "WandbExporter": (".wandb", "wandb"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, extra = _LAZY[name]
    try:
        return getattr(importlib.import_module(module, __name__), name)
    except ModuleNotFoundError as exc:
        raise MissingExtra(name, exc.name, extra) from exc
