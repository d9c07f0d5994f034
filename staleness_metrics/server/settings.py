"""What a service instance is started with (the ``serve`` options, as one value)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .exporting import ExportSettings
from .limits import DEFAULT_BODY_BYTES_PER_SPAN_ROW, DEFAULT_MAX_BODY_BYTES


@dataclass(frozen=True)
class ServerSettings:
    """The ``serve`` options. ``token``: needed on every write when set, and on reads too with
    ``protect_reads``. ``body_bytes_per_span_row``: a rollouts body may cut one span row per that
    many bytes, at least 65,536 (0: no cap). ``exporters``: OTLP and W&B besides Prometheus.
    ``data_dir``: where every acknowledged write is persisted; None keeps runs in memory only."""

    token: str | None = field(default=None, repr=False)  # never printed
    protect_reads: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_bytes_per_span_row: int = DEFAULT_BODY_BYTES_PER_SPAN_ROW
    exporters: ExportSettings = field(default_factory=ExportSettings)
    data_dir: Path | None = None

    def __post_init__(self) -> None:
        from .security import check_token

        check_token(self.token)
