"""The exporters behind each run of the service, and one exposition of every run's families."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..exporters.base import Exporter

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

    from ..exporters.prometheus import PrometheusExporter

# How long closing a run may wait for its W&B run (left unfinished, it loses its last rows)
WANDB_CLOSE_TIMEOUT = 60.0


@dataclass(frozen=True)
class ExportSettings:
    """Which exporters each run gets besides Prometheus: OTLP (to ``otlp_endpoint`` or the
    ``OTEL_EXPORTER_OTLP_*`` variables), and with ``wandb_project`` one W&B run per service run."""

    otlp: bool = False
    otlp_endpoint: str | None = None
    otlp_protocol: str | None = None
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_mode: Literal["online", "offline"] | None = None
    wandb_dir: str | None = None


@dataclass
class RunExporters:
    """The exporters of one run; ``failures``: the ones that could not start."""

    prometheus: PrometheusExporter
    others: list[Exporter] = field(default_factory=list)
    failures: list[tuple[str, str, BaseException]] = field(default_factory=list)

    @property
    def all(self) -> list[Exporter]:
        return [self.prometheus, *self.others]


def build_exporters(run: str, settings: ExportSettings) -> RunExporters:
    """The exporters of a new run; one that cannot start is left out and reported, never raised."""
    from ..exporters.prometheus import PrometheusExporter

    exporters = RunExporters(prometheus=PrometheusExporter(port=None))
    if settings.otlp:
        try:
            from ..exporters.otlp import OtlpExporter

            exporters.others.append(OtlpExporter(endpoint=settings.otlp_endpoint, protocol=settings.otlp_protocol))
        except Exception as exc:
            exporters.failures.append(("otlp", "the OTLP exporter could not start", exc))
    if settings.wandb_project is not None:
        try:
            from ..exporters.wandb import WandbExporter

            given = settings.wandb_entity, settings.wandb_mode, settings.wandb_dir
            extra = dict(zip(("entity", "mode", "dir"), given, strict=True))
            init = {
                "project": settings.wandb_project,
                "name": run,
                "reinit": "create_new",  # one W&B run per service run, side by side in this process
                # a dict: no import of wandb here
                "settings": {"console": "off", "x_disable_stats": True},
                **{key: value for key, value in extra.items() if value is not None},
            }
            exporters.others.append(WandbExporter(init_kwargs=init, own_run=True, close_timeout=WANDB_CLOSE_TIMEOUT))
        except Exception as exc:
            exporters.failures.append(("wandb", "the W&B run could not start", exc))
    return exporters


def preload(settings: ExportSettings) -> None:
    """Import wandb before any request is served (seconds of CPU under the GIL)."""
    if settings.wandb_project is not None:
        # a failure is reported per run, as an exporter that could not start
        with contextlib.suppress(ImportError):
            import wandb  # noqa: F401


class ServiceCollector:
    """Every run's registry as one: each family once, with every run's samples."""

    def __init__(self, registries: Callable[[], Iterable[CollectorRegistry]]) -> None:
        self._registries = registries

    def collect(self) -> Iterable[Metric]:
        from prometheus_client.metrics_core import Metric

        merged: dict[str, Metric] = {}
        for registry in self._registries():
            for family in registry.collect():
                target = merged.get(family.name)
                if target is None:
                    target = Metric(family.name, family.documentation, family.type, family.unit)
                    merged[family.name] = target
                target.samples.extend(family.samples)
        return list(merged.values())
