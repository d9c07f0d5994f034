"""prime-rl run benchmark: replaying a run in prime-rl's current layout against decoding the same files.

    python bench/prime_rl.py [--episodes 600] [--full] [--repeat 1] [--json]

Generates a run under a temporary directory as prime-rl writes it (``monitors/file/traces``): episode
records of two sampled turns (a prompt, an assistant reply, a tool reply, a second reply; 4-decimal
log-probabilities), one trace each, 16 episodes a step, dispatched 0-3 versions behind; the orchestrator's
ship update for each; the trainer's full-length ``trainer_logprobs`` for each (nulls off the sampled
tokens); chunks rolling at ``--chunk-mib`` and sealed as seekable zstd (frames of 4 MiB), all but the last
(a run still being written). ``--full`` writes at least 1 GiB of episode stream (decompressed).

Then times, each in a fresh process (so that its peak RSS is its own):
- decoding every file: zstd decompression and ``orjson.loads`` of every line, nothing else (the yardstick);
- ``staleness-metrics replay RUN --metrics-out M`` (the reader, the sink, the SPEC 11 sums);
- ``staleness-metrics what-if RUN --max-staleness 0..8`` (nine bounds and the curve's no-removal replay).
Goals: replay <= 3x the decoding, what-if <= 2x the replay. Memory: the replay's peak RSS, against the
decoding's and the largest chunk; what the reader held for traces whose trainer streams came before their
episode is the steps in flight, not the run (``held_peak``: traces at once).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import zstandard

BENCH = Path(__file__).resolve()
PER_STEP = 16
FRAME = 4 << 20


class _Chunks:
    """A stream's chunk files, rolling past ``limit`` bytes; finished chunks sealed (seekable zstd)."""

    def __init__(self, folder: Path, limit: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.limit = folder, limit
        self.number, self.size = 0, 0
        self.out = (folder / "00000.jsonl").open("wb")

    def append(self, line: bytes) -> tuple[int, int]:
        if self.size and self.size + len(line) > self.limit:
            self.out.close()
            _seal(self.folder / f"{self.number:05d}.jsonl")
            self.number, self.size = self.number + 1, 0
            self.out = (self.folder / f"{self.number:05d}.jsonl").open("wb")
        offset = self.size
        self.out.write(line)
        self.size += len(line)
        return self.number, offset

    def close(self) -> None:
        self.out.close()  # the live chunk stays plain: a run still being written


def _seal(path: Path) -> None:
    compressor = zstandard.ZstdCompressor(level=3)
    with path.open("rb") as src, path.with_name(path.name + ".zst").open("wb") as dst:
        while block := src.read(FRAME):
            dst.write(compressor.compress(block))
        dst.write(b"\x5e\x2a\x4d\x18\x09\x00\x00\x00" + b"\x00" * 5 + b"\xb1\xea\x92\x8f")  # an empty seek table
    path.unlink()


def generate(root: Path, episodes: int, chunk_bytes: int, seed: int = 0) -> dict[str, int]:
    """Write the run; returns its sizes."""
    rng = np.random.default_rng(seed)
    traces = root / "monitors" / "file" / "traces"
    stream = _Chunks(traces / "stream", chunk_bytes)
    orch = _Chunks(traces / "annotations" / "orch", chunk_bytes)
    trainer = _Chunks(traces / "annotations" / "trainer", chunk_bytes)
    index = (traces / "stream.index.jsonl").open("wb")
    written = tokens = 0
    pending: list[tuple[str, int, list[Any]]] = []
    for n in range(episodes):
        step = n // PER_STEP + 1
        start = max(0, step - 1 - int(rng.integers(0, 4)))
        end = min(step - 1, start + int(rng.integers(0, 2)))
        sizes = [
            int(rng.integers(200, 600)),
            int(rng.integers(300, 1500)),
            int(rng.integers(50, 200)),
            int(rng.integers(300, 1500)),
        ]
        nodes, full = [], []
        for i, size in enumerate(sizes):
            sampled = i % 2 == 1
            logprobs = np.round(-rng.random(size) * 2, 4) if sampled else np.zeros(0)
            node: dict[str, Any] = {
                "message": {"role": "assistant" if sampled else "user", "content": "x" * 32},
                "sampled": sampled,
                "token_ids": rng.integers(0, 150_000, size).tolist(),
                "mask": [sampled] * size,
                "logprobs": logprobs.tolist(),
            }
            if i:
                node["parent"] = i - 1
            nodes.append(node)
            full.extend((np.round(logprobs + rng.normal(0, 0.02, size), 4)).tolist() if sampled else [None] * size)
        trace_id = f"ep{n:07d}-t0"
        trace = {
            "id": trace_id,
            "nodes": nodes,
            "calls": [],
            "rewards": {"r": 1.0},
            "metrics": {},
            "ok": True,
            "errors": [],
            "info": {"kind": "train", "dispatch": {"step": step, "time": 0.0}, "arrival": {"step": step, "time": 1.0}},
            "agent": {"name": "agent", "trainable": True},
        }
        record = {
            "id": f"ep{n:07d}",
            "env": {"id": "math", "name": "math"},
            "group": {"id": f"g{n // 4}"},
            "run": {
                "type": "train",
                "id": "bench",
                "work": {"type": "train", "step": start + 1, "policy": {"start": start, "end": end}},
            },
            "ok": True,
            "errors": [],
            "traces": [trace],
        }
        line = orjson.dumps(record) + b"\n"
        chunk, offset = stream.append(line)
        index.write(
            orjson.dumps(
                {
                    "line": n + 1,
                    "offset": offset,
                    "chunk": chunk,
                    "id": record["id"],
                    "kind": "train",
                    "trace_ids": [trace_id],
                }
            )
            + b"\n"
        )
        written += len(line)
        tokens += sum(sizes)
        pending.append((trace_id, step, full))
        if (n + 1) % PER_STEP == 0 or n == episodes - 1:  # the batch ships, then the trainer trains it
            for tid, ship_step, _ in pending:
                orch.append(
                    orjson.dumps(
                        {
                            "version": 1,
                            "trace_id": tid,
                            "info": {"effective": True, "ship": {"step": ship_step, "time": 2.0}},
                            "branches": [],
                        }
                    )
                    + b"\n"
                )
            for tid, _, values in pending:
                trainer.append(
                    orjson.dumps(
                        {
                            "version": 1,
                            "trace_id": tid,
                            "info": {},
                            "branches": [{"index": 0, "trainer_logprobs": values}],
                        }
                    )
                    + b"\n"
                )
            pending = []
    for chunks in (stream, orch, trainer):
        chunks.close()
    index.close()
    return {"episodes": episodes, "tokens": tokens, "stream_bytes": written}


def _files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "monitors" / "file" / "traces").rglob("*") if p.is_file())


def decode(root: Path) -> int:
    """Decompress and decode every line of every file: the yardstick."""
    lines = 0
    for path in _files(root):
        with path.open("rb") as raw:
            handle: Any = raw
            if path.suffix == ".zst":
                handle = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
            for line in handle:
                orjson.loads(line)
                lines += 1
    return lines


def replay(root: Path) -> dict[str, Any]:
    from staleness_metrics.config import StalenessConfig
    from staleness_metrics.engine.sink import Sink
    from staleness_metrics.records import jsonio
    from staleness_metrics.replay.sources import read_run_events
    from staleness_metrics.replay.stream import run_events

    read = read_run_events(root)
    sink = Sink(StalenessConfig())
    with (root.parent / "metrics-out.jsonl").open("wb") as out:
        for shipment in run_events(iter(read), sink):
            out.write(jsonio.dumps_line(shipment.report.row()))
    return {"ships": sink.totals.rollouts_shipped, "held_peak": read.notes.held_peak}


def what_if(root: Path) -> dict[str, Any]:
    from staleness_metrics.replay.what_if import what_if_with_curve

    return {"rows": len(what_if_with_curve(root, range(9)).rows)}


def child(mode: str, root: Path) -> None:
    if mode != "decode":  # imported before the clock starts, as the decoder's orjson and zstandard are
        import staleness_metrics.engine.sink
        import staleness_metrics.replay.sources
        import staleness_metrics.replay.stream
        import staleness_metrics.replay.what_if  # noqa: F401
    start = time.perf_counter()
    measured = {
        "decode": lambda: {"lines": decode(root)},
        "replay": lambda: replay(root),
        "what-if": lambda: what_if(root),
    }
    extra: dict[str, Any] = measured[mode]()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "peak_rss": peak, **extra}))


def run_child(mode: str, root: Path) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH.parent.parent), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, str(BENCH), "--child", mode, str(root)], capture_output=True, text=True, check=True, env=env
    )
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=600, help="episodes (default: 600, about 12 MiB)")
    parser.add_argument("--full", action="store_true", help="at least 1 GiB of episode stream")
    parser.add_argument("--chunk-mib", type=int, default=64, help="chunk size in MiB (default: 64)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "RUN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]))
        return
    episodes = 26_000 if args.full else args.episodes  # about 1.1 GiB of stream
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "run"
        sizes = generate(root, episodes, args.chunk_mib << 20)
        on_disk = sum(p.stat().st_size for p in _files(root))
        decoded = min((run_child("decode", root) for _ in range(args.repeat)), key=lambda r: r["seconds"])
        replayed = min((run_child("replay", root) for _ in range(args.repeat)), key=lambda r: r["seconds"])
        asked = min((run_child("what-if", root) for _ in range(args.repeat)), key=lambda r: r["seconds"])
    result = {
        **sizes,
        "bytes_on_disk": on_disk,
        "decode_seconds": decoded["seconds"],
        "replay_seconds": replayed["seconds"],
        "replay_over_decode": replayed["seconds"] / decoded["seconds"],
        "decode_peak_rss": decoded["peak_rss"],
        "replay_peak_rss": replayed["peak_rss"],
        "held_peak": replayed["held_peak"],
        "tokens_per_second": sizes["tokens"] / replayed["seconds"],
        "what_if_seconds": asked["seconds"],
        "what_if_over_replay": asked["seconds"] / replayed["seconds"],
        "what_if_peak_rss": asked["peak_rss"],
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"run: {sizes['episodes']} episodes, {sizes['tokens']} tokens, {sizes['stream_bytes'] / 2**20:.0f} MiB of "
        f"stream ({on_disk / 2**20:.0f} MiB on disk)"
    )
    print(f"decode (zstd + orjson)   {decoded['seconds']:8.2f} s   peak RSS {decoded['peak_rss'] / 2**20:.0f} MiB")
    print(
        f"replay                   {replayed['seconds']:8.2f} s   peak RSS {replayed['peak_rss'] / 2**20:.0f} MiB, "
        f"{result['replay_over_decode']:.2f}x the decoding (goal <= 3x); at most {replayed['held_peak']} traces' "
        "trainer streams held ahead of their episode"
    )
    print(
        f"what-if 0..8             {asked['seconds']:8.2f} s   peak RSS {asked['peak_rss'] / 2**20:.0f} MiB, "
        f"{result['what_if_over_replay']:.2f}x the replay (goal <= 2x)"
    )


if __name__ == "__main__":
    main()
