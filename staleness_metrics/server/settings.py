"""What a service instance is started with (the ``serve`` options, as one value)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .exporting import ExportSettings
from .limits import DEFAULT_BODY_BYTES_PER_SPAN_ROW, DEFAULT_MAX_BODY_BYTES


@dataclass(frozen=True)
class ServerSettings:
    """``token``: required (``Authorization: Bearer``) on every write when set, and on reads too
    with ``protect_reads``; ``/healthz`` and the OpenAPI document stay open (a blank token is
    refused). ``max_body_bytes`` caps request bodies (413 beyond); ``body_bytes_per_span_row`` caps
    the span rows a rollouts body may cut: one per that many bytes of it, at least 65,536 (413
    beyond; 0: no cap). ``exporters``: OTLP and W&B for every run, besides Prometheus. ``data_dir``:
    persist every acknowledged write there (SQLite) and restore the runs from it at start; None
    keeps runs in memory only."""

    token: str | None = field(default=None, repr=False)  # never printed
    protect_reads: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_bytes_per_span_row: int = DEFAULT_BODY_BYTES_PER_SPAN_ROW
    exporters: ExportSettings = field(default_factory=ExportSettings)
    # None: runs live in memory only (the ``serve`` command defaults to a directory)
    data_dir: Path | None = None

    def __post_init__(self) -> None:
        from .security import check_token

        check_token(self.token)
