"""The runs of one service by name, with their exporters: created, restored, found, deleted."""

from __future__ import annotations

import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Literal

from prometheus_client.metrics_core import Metric

from ..config import StalenessConfig
from .models import RestoreFailed, RunBroken, RunConflict, RunNotFound
from .runs import Run, RunExporters
from .store import Store, StoredRun

logger = logging.getLogger("staleness_metrics.server")

# How long closing a run may wait for its W&B run (left unfinished, it loses its last rows)
WANDB_CLOSE_TIMEOUT = 60.0


@dataclass(frozen=True)
class ExportSettings:
    """Which exporters each run gets besides Prometheus: OTLP, and one W&B run per service run."""

    otlp: bool = False
    otlp_endpoint: str | None = None
    otlp_protocol: str | None = None
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_mode: Literal["online", "offline"] | None = None
    wandb_dir: str | None = None


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

            extra = {key: getattr(settings, f"wandb_{key}") for key in ("entity", "mode", "dir")}
            init = {
                "project": settings.wandb_project,
                "name": run,
                "reinit": "create_new",  # one W&B run per service run, side by side in this process
                "settings": {"console": "off", "x_disable_stats": True},  # a dict: no wandb import
                **{key: value for key, value in extra.items() if value is not None},
            }
            exporters.others.append(WandbExporter(init_kwargs=init, own_run=True, close_timeout=WANDB_CLOSE_TIMEOUT))
        except Exception as exc:
            exporters.failures.append(("wandb", "the W&B run could not start", exc))
    return exporters


def not_persisted(what: str, exc: Exception) -> RunBroken:
    """503: ``what`` (a run created or deleted) did not happen, the store failing (a full disk)."""
    return RunBroken(f"{what}: the data directory could not be written ({exc}); nothing changed")


class RunRegistry:
    """The runs of one service by name; one whose stored rows fail to apply is unavailable (503)."""

    def __init__(self, export_settings: ExportSettings | None = None, store: Store | None = None) -> None:
        self.export_settings = export_settings or ExportSettings()
        if self.export_settings.wandb_project is not None:
            # before any request (seconds of CPU under the GIL); a failure is reported per run
            with contextlib.suppress(ImportError):
                import wandb  # noqa: F401
        self.store = store or Store()
        self._runs: dict[str, Run] = {}
        self._pending: dict[str, StoredRun] = {}  # checked, not loaded yet
        self._failed: dict[str, str] = {}  # runs whose stored rows could not be applied: why
        self._lock = threading.Lock()  # guards the dicts
        self._creating = threading.Lock()  # one creation or deletion at a time
        self._loading = threading.Lock()  # one run loaded at a time
        self._loader: threading.Thread | None = None
        self.closed = False

    def create(self, name: str, config: StalenessConfig) -> tuple[Run, bool]:
        """The run, and True when created; 409 when it exists with another configuration."""
        with self._creating:
            if (existing := self._find(name)) is not None:
                if existing.config != config:
                    raise RunConflict(
                        f"run {name!r} exists with another configuration "
                        f"({asdict(existing.config)}); delete it first or pick another name"
                    )
                return existing, False
            try:
                self.store.create_run(name, asdict(config))  # persisted before the 201
            except Exception as exc:
                raise not_persisted(f"run {name!r} was not created", exc) from exc
            run = Run(name, config, build_exporters(name, self.export_settings), self.store)
            with self._lock:
                self._runs[name] = run
            return run, True

    def restore(self, background: bool = True, defer: bool = False) -> int:
        """Check every stored run, load them (in the background, here, or later): how many."""
        stored_runs = self.store.load()
        with self._lock:
            self._pending.update((stored.name, stored) for stored in stored_runs)
        if not defer:
            (self.load_in_background if background else self._load_pending)()
        return len(stored_runs)

    def reopen(self) -> None:
        """After :meth:`close`, start again on the store as a restart does (the runs it stored)."""
        self.store, self._loader, self.closed = self.store.reopen(), None, False
        self._failed.clear()  # each stored run is tried again
        self.restore(defer=True)

    def load_in_background(self) -> None:
        """Load the stored runs not loaded yet on a daemon thread (once)."""
        with self._lock:
            if self._loader is not None or not self._pending:
                return
            self._loader = threading.Thread(target=self._load_pending, name="staleness-restore", daemon=True)
        self._loader.start()

    def _load_pending(self) -> None:
        while True:
            with self._lock:
                name = next(iter(self._pending), None)
            if name is None:
                return
            self._load(name)

    def _load(self, name: str) -> Run | None:
        with self._loading:
            with self._lock:
                loaded, stored = self._runs.get(name), self._pending.get(name)
            if loaded is not None or stored is None:
                return loaded
            config = StalenessConfig(**stored.config)  # (checked by the store)
            run = Run(name, config, build_exporters(name, self.export_settings), self.store)
            try:
                run.restore(stored)
            except RestoreFailed as exc:
                run.close()
                reason = (
                    f"{exc}. The run is unavailable: restore the data directory from a backup and "
                    f"restart, or DELETE /v1/runs/{name} to drop it"
                )
                logger.error("%s", reason)
                with self._lock:
                    del self._pending[name]
                    self._failed[name] = reason
                return None
            with self._lock:
                del self._pending[name]
                self._runs[name] = run
            return run

    def _find(self, name: str) -> Run | None:
        with self._lock:
            if (run := self._runs.get(name)) is not None:
                return run
            failed, pending = self._failed.get(name), name in self._pending
        if failed is not None:
            raise RunBroken(failed)
        return self._load(name) if pending else None

    def get(self, name: str) -> Run:
        if (run := self._find(name)) is None:
            raise RunNotFound(f"no run {name!r}: create it first with PUT /v1/runs/{name}")
        return run

    def unavailable(self) -> dict[str, str]:
        """The runs that take no requests, and why."""
        with self._lock:
            runs = list(self._runs.values())
            out = dict(self._failed)
        out.update((run.name, reason) for run in runs if (reason := run.unavailable) is not None)
        return out

    def loading(self) -> bool:
        """True while stored runs wait to be loaded (after a restart)."""
        with self._lock:
            return bool(self._pending)

    def unavailable_once_loaded(self, timeout: float) -> dict[str, str]:
        """:meth:`unavailable` once loaded (or after ``timeout``), naming runs still loading."""
        self.load_in_background()
        if self._loader is not None:
            self._loader.join(timeout)
        out = self.unavailable()
        with self._lock:
            for name in self._pending:
                out.setdefault(name, f"run {name!r} is still loading after the restart")
        return out

    def count(self) -> int:
        """How many runs the service holds (loaded or not yet)."""
        with self._lock:
            return len(self._runs) + len(self._pending)

    def delete(self, name: str) -> None:
        with self._creating:
            with self._lock:
                failed = name in self._failed
            run = None if failed else self.get(name)
            if run is not None:  # before its rows go: no write in flight journals a row after them
                run.refuse_writes()
            try:
                self.store.delete_run(name)
            except Exception as exc:
                if run is not None:
                    run.refuse_writes(False)  # not deleted: it serves on
                raise not_persisted(f"run {name!r} was not deleted", exc) from exc
            with self._lock:
                self._failed.pop(name, None)
                self._runs.pop(name, None)
        if run is not None:
            run.close()

    def runs(self) -> list[Run]:
        """Every available run (loading the ones not loaded yet)."""
        self._load_pending()
        with self._lock:
            return list(self._runs.values())

    def collect(self) -> list[Metric]:
        """Every run's metric families, each once with every run's samples (labelled ``run``)."""
        merged: dict[str, Metric] = {}
        for run in self.runs():
            for family in run.registry.collect():
                if family.name not in merged:
                    merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                merged[family.name].samples.extend(family.samples)
        return list(merged.values())

    def close(self) -> None:
        """Close every run: their exporters flush."""
        with self._creating, self._loading, self._lock:
            runs = list(self._runs.values())
            self._runs.clear()
            self._pending.clear()  # not loaded: nothing of theirs to flush
            self.closed = True
        for run in runs:
            run.checkpoint()
        # in parallel: each may wait its exporters' close timeout
        with ThreadPoolExecutor(max_workers=min(32, len(runs) or 1), thread_name_prefix="staleness-close") as pool:
            list(pool.map(Run.close, runs))
        self.store.close()
