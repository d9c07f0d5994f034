"""JSONL exporter: one ``report.row()`` per line (the ``--metrics-out`` format); trainer-side sums
add a line ``{"step": S, <SPEC 11/14 keys>}`` of the step's sums merged so far."""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import threading
from pathlib import Path

from ..metrics.report import StepReport
from ..records import jsonio
from .base import DEFAULT_CLOSE_TIMEOUT, DEFAULT_QUEUE_SIZE, MismatchReport, QueuedExporter


class JsonlExporter(QueuedExporter[bytes]):
    """Appends one line per ship to ``path`` (on a background queue, flushed line by line); a new
    file unless ``append=True`` (resumed runs). A pipe or a FIFO is written as it goes."""

    name = "jsonl"

    def __init__(self, path: str | os.PathLike[str], *, append: bool = False,
                 max_queue: int = DEFAULT_QUEUE_SIZE, retry_initial: float = 0.5,
                 retry_max: float = 10.0, close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
                 ) -> None:  # fmt: skip
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("ab" if append else "wb", buffering=0)  # a line: one write call
        # where the last whole line ends; None for a stream (a pipe, a FIFO): written as it goes
        self._end = self._file.seek(0, os.SEEK_END) if self._file.seekable() else None
        if append and self._end:  # a line torn by a process that died in it: cut at the first write
            with self.path.open("rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as tail:
                self._end = tail.rfind(b"\n") + 1  # (searched from the end: a page or two read)
        self._file_lock = threading.Lock()
        self._start_queue(self._write, max_queue, retry_initial, retry_max, close_timeout)

    def export(self, report: StepReport) -> None:
        self._queue.put(jsonio.dumps_line(report.row()))

    def export_mismatch(self, report: MismatchReport) -> None:
        """One more line for the step: its SPEC 11 keys, merged over the step's calls so far."""
        try:
            line = jsonio.dumps_line({"step": report.step, **report.metrics})
        except Exception as exc:  # never into the trainer
            self._errors.record(self.name, "mismatch sums not written", exc)
            return
        self._queue.put(line)

    def _write(self, line: bytes) -> None:
        with self._file_lock:
            self._cut_torn()  # torn by a process that died (append), or the cut below failed
            try:
                write_all(self._file, line)
            except OSError:  # cut now: a retry may never come (given up, or closed meanwhile)
                with contextlib.suppress(OSError):
                    self._cut_torn()
                raise
            self._end = None if self._end is None else self._file.tell()

    def _cut_torn(self) -> None:
        """Cut a failed write's part back to the last whole line (a stream is as it is)."""
        if self._end is not None and self._file.tell() != self._end:
            self._file.seek(self._end)
            self._file.truncate()

    def _close_resources(self) -> None:
        with self._file_lock:
            self._file.close()


def write_all(file: io.FileIO, data: bytes) -> None:
    """All of ``data`` to an unbuffered ``file``; a failed write's error names the file."""
    try:
        while data:  # short on a full disk: the next call raises
            data = data[file.write(data) :]
    except OSError as error:
        error.filename = file.name  # (a write's own names none)
        raise
