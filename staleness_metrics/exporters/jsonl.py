"""JSONL exporter: one ``report.row()`` per line (the ``--metrics-out`` format), flushed per line."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import IO

from .. import jsonio
from ..report import StepReport
from .background import DEFAULT_QUEUE_SIZE, QueuedExporter

__all__ = ["JsonlExporter", "row_json"]


def row_json(report: StepReport) -> str:
    """The report's ``{"step": S, <key>: <value>, ...}`` line, without the newline."""
    return jsonio.dumps(report.row()).decode()


class JsonlExporter(QueuedExporter[str]):
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
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = self.path.open("a" if append else "w", encoding="utf-8")
        self._file_lock = threading.Lock()
        self._start_queue(
            self._write,
            max_queue=max_queue,
            retry_initial=retry_initial,
            retry_max=retry_max,
            close_timeout=close_timeout,
        )

    def export(self, report: StepReport) -> None:
        self._queue.put(row_json(report) + "\n")

    def _write(self, line: str) -> None:
        with self._file_lock:
            self._file.write(line)
            self._file.flush()

    def _close_resources(self) -> None:
        with self._file_lock:
            self._file.close()
