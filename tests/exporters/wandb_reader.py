"""Read an offline W&B run file (``run-<id>.wandb``) back, for tests.

wandb 0.31 writes it from its Go core and ships no Python reader. The format: a 7-byte header
(``:W&B``, magic 0xBEE1, version 0), then LevelDB-log framing in 32 KiB blocks; each chunk has a 7-byte
header (crc32 LE u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) and the records are
``wandb.proto.wandb_internal_pb2.Record`` messages.
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2 as pb

__all__ = ["OfflineRun", "find_run_file", "read_records", "read_run"]

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path: Path) -> Iterator[Any]:
    """Every record of a ``.wandb`` file, in order (CRC-checked)."""
    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "not a W&B run file"
    pos, pending = 7, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if kind == 0 and length == 0:  # zero padding
            pos += left
            continue
        if pos + _HEADER + length > len(data):  # the writer is mid-chunk: stop at what is complete
            return
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, "corrupt chunk"
        if kind == _FULL:
            yield pb.Record.FromString(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pb.Record.FromString(pending + chunk)
            pending = b""


@dataclass
class MetricDefinition:
    name: str
    step_metric: str
    hidden: bool
    summary_max: bool


@dataclass
class OfflineRun:
    """What a test wants from a run file: history rows, define_metric records, the final summary."""

    history: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, MetricDefinition] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)


def _item_key(item: Any) -> str:
    return str(item.key or "/".join(item.nested_key))


def read_run(path: Path, timeout: float = 60.0) -> OfflineRun:
    """The run's history, metric definitions and summary, once the file is complete.

    ``run.finish()`` can return before wandb-core has written everything, so this waits (up to
    ``timeout`` seconds) for the ``exit`` record that ends a finished run.
    """
    deadline = time.monotonic() + timeout
    while True:
        records = list(read_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} has no exit record after {timeout} s (run not finished?)")
        time.sleep(0.05)
    run = OfflineRun()
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            run.history.append({_item_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "metric":
            metric = record.metric
            name = metric.name or metric.glob_name
            run.metrics[name] = MetricDefinition(
                name=name,
                step_metric=metric.step_metric,
                hidden=bool(metric.options.hidden),
                summary_max=bool(metric.summary.max),
            )
        elif kind == "summary":
            for item in record.summary.update:
                run.summary[_item_key(item)] = json.loads(item.value_json)
    return run


def find_run_file(directory: Path) -> Path:
    """The single ``run-*.wandb`` file under ``directory`` (an offline run's ``dir``)."""
    files = sorted(Path(directory).rglob("run-*.wandb"))
    assert len(files) == 1, f"expected one run file under {directory}, found {files}"
    return files[0]
