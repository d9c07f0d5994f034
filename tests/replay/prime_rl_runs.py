"""Unit fixtures: prime-rl runs in the current layout written from JSON records made here (the records of
verifiers' own classes are the end-to-end tests' business), following ``prime-rl-traces.md``: the episode
stream in chunks (plain, or sealed as seekable zstd: frames of at most ``frame_bytes`` and a seek table in a
skippable frame), its index, per-producer annotation updates and the logged ``metrics.jsonl``."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import zstandard

SKIPPABLE_SEEK_TABLE = 0x184D2A5E
SEEKABLE_FOOTER = 0x8F92EAB1


def node(
    tokens: int,
    sampled: list[int] | None = None,
    logprobs: list[float] | None = None,
    parent: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A message node of ``tokens`` tokens, the positions in ``sampled`` sampled (logprobs default -0.5 each)."""
    positions = set(sampled or [])
    mask = [i in positions for i in range(tokens)]
    record: dict[str, Any] = {
        "message": {"role": "assistant" if positions else "user", "content": "x"},
        "sampled": bool(positions),
        "token_ids": list(range(100, 100 + tokens)),
        "mask": mask,
        "logprobs": logprobs if logprobs is not None else [-0.5] * len(positions),
    }
    if parent is not None:
        record["parent"] = parent
    record.update(extra)
    return record


def trace(
    trace_id: str, nodes: list[dict[str, Any]], arrival: int | None, kind: str = "train", **extra: Any
) -> dict[str, Any]:
    info: dict[str, Any] = {"kind": kind, "dispatch": {"step": 1, "time": 0.0}}
    if arrival is not None:
        info["arrival"] = {"step": arrival, "time": 1.0}
    record = {
        "id": trace_id,
        "nodes": nodes,
        "calls": [],
        "rewards": {},
        "metrics": {},
        "info": info,
        "ok": True,
        "errors": [],
        "agent": {"name": "agent", "trainable": True},
    }
    record.update(extra)
    return record


def episode(
    episode_id: str,
    traces: list[dict[str, Any]],
    policy: tuple[int, int] | None,
    *,
    step: int = 1,
    env: str = "math",
    group: str | None = None,
    kind: str = "train",
    **extra: Any,
) -> dict[str, Any]:
    work: dict[str, Any] = {"type": kind, "step": step}
    if policy is not None:
        work["policy"] = {"start": policy[0], "end": policy[1]}
    record: dict[str, Any] = {
        "id": episode_id,
        "env": {"id": env, "name": env},
        "task": {"type": "T"},
        "run": {"type": "train", "id": "run", "work": work},
        "ok": True,
        "errors": [],
        "traces": traces,
    }
    if group is not None:
        record["group"] = {"id": group}
    record.update(extra)
    return record


def seekable_zstd(data: bytes, frame_bytes: int = 4 << 20) -> bytes:
    """``data`` as the zstd seekable format: independent frames, then the seek table in a skippable frame."""
    compressor = zstandard.ZstdCompressor(level=3)
    frames, entries = [], []
    for start in range(0, len(data), frame_bytes):
        part = data[start : start + frame_bytes]
        frame = compressor.compress(part)
        frames.append(frame)
        entries.append(struct.pack("<II", len(frame), len(part)))
    table = b"".join(entries) + struct.pack("<IBI", len(entries), 0, SEEKABLE_FOOTER)
    return b"".join(frames) + struct.pack("<II", SKIPPABLE_SEEK_TABLE, len(table)) + table


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode() + b"\n"


class RunWriter:
    """Writes a run under ``root/monitors/file``: ``chunk_lines`` lines per chunk (None: one chunk), or the
    single-file layout (``chunked=False``)."""

    def __init__(self, root: Path, *, chunked: bool = True, chunk_lines: int | None = None) -> None:
        self.file = root / "monitors" / "file"
        self.traces = self.file / "traces"
        self.traces.mkdir(parents=True, exist_ok=True)
        self.chunked, self.chunk_lines = chunked, chunk_lines
        self.lines: dict[str, list[int]] = {}  # stream base -> [chunk, lines in it, size]
        self.logged = 0

    def _append(self, base: Path, line: bytes) -> tuple[int | None, int]:
        key = str(base)
        if not self.chunked:
            path = base.with_name(base.name + ".jsonl")
            path.parent.mkdir(parents=True, exist_ok=True)
            offset = path.stat().st_size if path.is_file() else 0
            with path.open("ab") as out:
                out.write(line)
            return None, offset
        base.mkdir(parents=True, exist_ok=True)
        chunk, count = self.lines.get(key, [0, 0])
        if self.chunk_lines is not None and count >= self.chunk_lines:
            chunk, count = chunk + 1, 0
        path = base / f"{chunk:05d}.jsonl"
        offset = path.stat().st_size if path.is_file() else 0
        with path.open("ab") as out:
            out.write(line)
        self.lines[key] = [chunk, count + 1]
        return chunk, offset

    def episode(self, record: dict[str, Any]) -> None:
        chunk, offset = self._append(self.traces / "stream", dumps(record))
        self.logged += 1
        row = {
            "line": self.logged,
            "offset": offset,
            "id": record["id"],
            "kind": record["run"]["work"]["type"],
            "trace_ids": [t["id"] for t in record["traces"]],
        }
        if chunk is not None:
            row["chunk"] = chunk
        with (self.traces / "stream.index.jsonl").open("ab") as out:
            out.write(dumps(row))

    def update(
        self,
        producer: str,
        trace_id: str,
        info: dict[str, Any] | None = None,
        branches: dict[int, dict[str, Any]] | None = None,
    ) -> None:
        record = {
            "version": 1,
            "trace_id": trace_id,
            "info": info or {},
            "branches": [{"index": i, **streams} for i, streams in (branches or {}).items()],
        }
        base = self.traces / "annotations" / producer
        chunk, offset = self._append(base, dumps(record))
        index = {"trace_id": trace_id, "offset": offset, "info": info or {}}
        if chunk is not None:
            index["chunk"] = chunk
        with (self.traces / "annotations" / f"{producer}.index.jsonl").open("ab") as out:
            out.write(dumps(index))

    def ship(self, step: int, *trace_ids: str, producer: str = "orch") -> None:
        for trace_id in trace_ids:
            self.update(producer, trace_id, {"effective": True, "ship": {"step": step, "time": 2.0}})

    def trainer(self, trace_id: str, branch: int, trainer_logprobs: list[float | None]) -> None:
        self.update("trainer", trace_id, {}, {branch: {"trainer_logprobs": trainer_logprobs}})

    def metrics(self, row: dict[str, Any]) -> None:
        with (self.file / "metrics.jsonl").open("a") as out:
            out.write(json.dumps({"time": 0.0, **row}) + "\n")

    def seal(self, base: str = "stream", frame_bytes: int = 4 << 20) -> None:
        """Seal every plain chunk of a stream (``stream`` or ``annotations/<producer>``) but none, as a finished run."""
        for path in sorted((self.traces / base).glob("*.jsonl")):
            path.with_name(path.name + ".zst").write_bytes(seekable_zstd(path.read_bytes(), frame_bytes))
            path.unlink()
