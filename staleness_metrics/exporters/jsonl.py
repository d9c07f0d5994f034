"""JSONL exporter: one ``report.row()`` per line (the ``--metrics-out`` format), flushed per line."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import IO

import numpy as np

from ..report import StepReport
from .background import DEFAULT_QUEUE_SIZE, ExportQueue
from .base import ExportContext, ExportErrors

__all__ = ["JsonlExporter", "row_json"]


def _plain(value: object) -> object:
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def row_json(report: StepReport) -> str:
    """The report's ``{"step": S, <key>: <value>, ...}`` line, without the newline."""
    return json.dumps(report.row(), default=_plain, allow_nan=False)


class JsonlExporter:
    """Appends one line per ship to ``path`` (written on a background queue, flushed line by line).

    ``append=False`` (default) starts a new file; ``append=True`` continues an existing one (resumed runs).
    """

    name = "jsonl"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        append: bool = False,
        max_queue: int = DEFAULT_QUEUE_SIZE,
        retry_initial: float = 0.5,
        retry_max: float = 10.0,
        close_timeout: float = 10.0,
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = self.path.open("a" if append else "w", encoding="utf-8")
        self._file_lock = threading.Lock()
        self._close_timeout = close_timeout
        self._errors = ExportErrors()
        self._errors.register(self.name)
        self._queue: ExportQueue[str] = ExportQueue(
            self.name,
            self._write,
            lambda message, exc: self._errors.record(self.name, message, exc),
            max_size=max_queue,
            retry_initial=retry_initial,
            retry_max=retry_max,
        )

    def attach(self, context: ExportContext) -> None:
        self._errors = context.share_errors(self.name, self._errors)

    def export(self, report: StepReport) -> None:
        self._queue.put(row_json(report) + "\n")

    def _write(self, line: str) -> None:
        with self._file_lock:
            self._file.write(line)
            self._file.flush()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued line is written (False when ``timeout`` passed first)."""
        return self._queue.flush(timeout)

    def close(self) -> None:
        self._queue.close(self._close_timeout)
        with self._file_lock:
            self._file.close()
