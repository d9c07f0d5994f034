"""Where a prime-rl run keeps its trace stream, index, annotations and logged rows (current layout,
``prime-rl-traces.md`` section 1), under ``<run>/monitors/file/``: ``metrics.jsonl``,
``traces/stream/NNNNN.jsonl[.zst]`` (or the earlier single ``traces/stream.jsonl``),
``traces/stream.index.jsonl`` and ``traces/annotations/<producer>/...``. A chunk with both a plain
and a sealed file is read from the plain one, as prime-rl's reader does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

_CHUNK = re.compile(r"^(\d+)\.jsonl(\.zst)?$")
_INDEX_SUFFIX = ".index.jsonl"


@dataclass(frozen=True)
class ChunkFile:
    """One file of a stream: ``number`` its chunk (None: single file), ``sealed`` when zstd."""

    path: Path
    number: int | None
    sealed: bool


@dataclass(frozen=True)
class TracesLayout:
    """The files of a run in the current layout, each stream's files in reading order."""

    traces: Path
    stream: list[ChunkFile]
    index: Path | None
    annotations: dict[str, list[ChunkFile]] = field(default_factory=dict)
    metrics: Path | None = None


def _chunks(folder: Path) -> list[ChunkFile]:
    """A chunked stream's files in chunk order, a plain file preferred to its sealed twin."""
    found: dict[int, ChunkFile] = {}
    for path in folder.iterdir():
        match = _CHUNK.match(path.name)
        if match is None or not path.is_file():
            continue
        number, sealed = int(match.group(1)), match.group(2) is not None
        if number not in found or (found[number].sealed and not sealed):
            found[number] = ChunkFile(path, number, sealed)
    return [found[number] for number in sorted(found)]


def _stream_files(base: Path) -> list[ChunkFile]:
    """``base.jsonl`` then ``base/`` chunks (a run relaunched by a newer prime-rl holds both)."""
    files = []
    single = base.with_name(base.name + ".jsonl")
    if single.is_file():
        files.append(ChunkFile(single, None, False))
    if base.is_dir():
        files.extend(_chunks(base))
    return files


def _traces_folder(path: Path) -> Path | None:
    for candidate in (path / "monitors" / "file" / "traces", path / "traces", path):
        if (candidate / "stream").is_dir() or (candidate / "stream.jsonl").is_file():
            return candidate
    return None


def find_layout(path: str | Path) -> TracesLayout | None:
    """The files of the run at ``path`` (root, ``monitors/file`` or ``traces``); None without a
    trace stream."""
    root = Path(path)
    if not root.is_dir():
        return None
    traces = _traces_folder(root)
    if traces is None:
        return None
    index = traces / f"stream{_INDEX_SUFFIX}"
    annotations: dict[str, list[ChunkFile]] = {}
    folder = traces / "annotations"
    if folder.is_dir():
        names = {p.name for p in folder.iterdir() if p.is_dir()}
        names |= {
            p.name.removesuffix(".jsonl")
            for p in folder.iterdir()
            if p.is_file() and p.name.endswith(".jsonl") and not p.name.endswith(_INDEX_SUFFIX)
        }
        for name in sorted(names):
            files = _stream_files(folder / name)
            if files:
                annotations[name] = files
    metrics = traces.parent / "metrics.jsonl"
    return TracesLayout(
        traces=traces,
        stream=_stream_files(traces / "stream"),
        index=index if index.is_file() else None,
        annotations=annotations,
        metrics=metrics if metrics.is_file() else None,
    )


def is_current_layout(path: str | Path) -> bool:
    """Whether ``path`` holds a prime-rl trace stream in the current layout."""
    return find_layout(path) is not None
