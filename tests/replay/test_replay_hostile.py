"""``staleness-metrics replay`` keeps SPEC 9's contract for every file (issue 19): hostile inputs end in
exit 2 with a one-line ``line L: ...`` message and no output file (or, lenient, a rollout set aside and
counted), never a traceback, a wrong guess at the encoding, or a silently shortened sample.

The CLI runs as a user runs it, in a subprocess. ``HOSTILE`` is shared with the test that replays the
same files with the simdjson fast path turned off (tests/replay/test_replay_encoding.py).
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from staleness_metrics.cli import main as cli_main
from staleness_metrics.records import simd_records
from staleness_metrics.replay.stream import read_events

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def rollout_line(rid: str, mask: list[int] | None = None, **fields: Any) -> bytes:
    record = {"id": rid, "dispatch_version": 0, "samples": [{"mask": mask or [1, 1, 0]}], **fields}
    return json.dumps({"type": "rollout", "rollout": record}).encode()


SHIP = b'{"type": "ship", "step": 1}'
# valid rollout lines around each hostile one: the fast path reads them, in the same batch as the hostile one
BEFORE, AFTER = rollout_line("a"), rollout_line("b", [1, 0, 1, 1])


def stream(*lines: bytes) -> bytes:
    return b"".join(line + b"\n" for line in lines)


def raw_rollout(text: bytes) -> bytes:
    """A rollout line written by hand (escapes and bytes exactly as given)."""
    return b'{"type": "rollout", "rollout": {' + text + b', "dispatch_version": 0, "samples": [{"mask": [1, 1]}]}}'


@dataclass(frozen=True)
class Hostile:
    name: str
    content: bytes
    strict: str  # the message of exit 2 under --strict
    lenient: str | None = None  # lenient's exit-2 message; None: exit 0 with one rollout set aside


DEEP = b"[" * 5000 + b"]" * 5000
HOSTILE = [
    Hostile(
        "deep nesting",
        stream(BEFORE, raw_rollout(b'"id": "d", "group_id": ' + DEEP), AFTER, SHIP),
        "line 2: bad JSON: arrays or objects nested too deeply",
        "line 2: bad JSON: arrays or objects nested too deeply",
    ),
    Hostile(
        "deep nesting on the first line",
        stream(b'{"type": "sweep", "step": 1, "x": ' + DEEP + b"}", BEFORE, SHIP),
        "line 1: bad JSON: arrays or objects nested too deeply",
        "line 1: bad JSON: arrays or objects nested too deeply",
    ),
    Hostile(
        "lone surrogate in an id",
        stream(BEFORE, raw_rollout(b'"id": "x\\ud800"'), AFTER, SHIP),
        "line 2: rollout 'x\\ud800': field id: not valid Unicode (a lone surrogate \\ud800)",
    ),
    Hostile(
        "lone surrogate in an env",
        stream(BEFORE, raw_rollout(b'"id": "e", "env": "math\\udfff"'), AFTER, SHIP),
        "line 2: rollout 'e': field env: not valid Unicode (a lone surrogate \\udfff)",
    ),
    Hostile(
        "lone surrogate in a sample's field name",
        stream(
            BEFORE,
            b'{"type": "rollout", "rollout": {"id": "k", "dispatch_version": 0, '
            b'"samples": [{"mask": [1], "w\\ud800": [1]}]}}',
            AFTER,
            SHIP,
        ),
        "line 2: rollout 'k': field samples[0].w\\ud800: not valid Unicode (a lone surrogate \\ud800)",
    ),
    Hostile(
        "lone surrogate on a line the standard library reads anyway (a NaN weight)",
        stream(
            BEFORE,
            b'{"type": "rollout", "rollout": {"id": "n", "group_id": "\\ud800", "dispatch_version": 0, '
            b'"samples": [{"mask": [1], "rl_weights": [NaN]}]}}',
            SHIP,
        ),
        "line 2: rollout 'n': field group_id: not valid Unicode (a lone surrogate \\ud800)",
    ),
    Hostile(
        "invalid UTF-8 in an id",
        stream(BEFORE, raw_rollout(b'"id": "r\xff1"'), AFTER, SHIP),
        "line 2: rollout 'r\\udcff1': field id: not valid UTF-8 (byte 0xff)",
    ),
    Hostile(
        "invalid UTF-8 outside any string",
        stream(BEFORE, b'{"type": "ship", "step": 1}\xc3', SHIP),
        "line 2: not valid UTF-8: byte 0xc3 at column 28",
        "line 2: not valid UTF-8: byte 0xc3 at column 28",
    ),
    Hostile(
        "NUL bytes",
        stream(BEFORE, b"\x00" * 12, SHIP),
        "line 2: a NUL byte at column 1: not a line of UTF-8 JSON (binary data, or UTF-16/32 text?)",
        "line 2: a NUL byte at column 1: not a line of UTF-8 JSON (binary data, or UTF-16/32 text?)",
    ),
    Hostile(
        "a NUL byte inside a string",
        stream(BEFORE, raw_rollout(b'"id": "a\x00b"'), SHIP),
        "line 2: a NUL byte at column 41: not a line of UTF-8 JSON (binary data, or UTF-16/32 text?)",
        "line 2: a NUL byte at column 41: not a line of UTF-8 JSON (binary data, or UTF-16/32 text?)",
    ),
    Hostile(
        "a ship naming an id that is not valid Unicode",
        stream(BEFORE, b'{"type": "ship", "step": 1, "ids": ["a", "\\udc00"]}'),
        "line 2: 'ids': '\\udc00' is not valid Unicode (a lone surrogate \\udc00)",
        "line 2: 'ids': '\\udc00' is not valid Unicode (a lone surrogate \\udc00)",
    ),
    Hostile(  # a misspelt "ids" would ship every queued rollout
        "a ship with a key it does not have",
        stream(BEFORE, AFTER, b'{"type": "ship", "step": 1, "id": ["a"]}'),
        "line 3: unknown key 'id' in a ship event (expected type, step, ids)",
        "line 3: unknown key 'id' in a ship event (expected type, step, ids)",
    ),
    Hostile(
        "a sweep with a key it does not have",
        stream(BEFORE, b'{"type": "sweep", "stpe": 3, "step": 1}', SHIP),
        "line 2: unknown key 'stpe' in a sweep event (expected type, step)",
        "line 2: unknown key 'stpe' in a sweep event (expected type, step)",
    ),
    Hostile(  # a line the fast reader would otherwise take
        "a rollout line with a key it does not have",
        stream(BEFORE, rollout_line("c")[:-1] + b', "note": 1}', AFTER, SHIP),
        "line 2: unknown key 'note' in a rollout event (expected type, rollout)",
        "line 2: unknown key 'note' in a rollout event (expected type, rollout)",
    ),
    Hostile(
        "a step beyond 2**53",
        stream(BEFORE, b'{"type": "ship", "step": 18446744073709551616}'),
        "line 2: 'step' must be an integer in 1..9007199254740992, got 18446744073709551616",
        "line 2: 'step' must be an integer in 1..9007199254740992, got 18446744073709551616",
    ),
]


@dataclass(frozen=True)
class Run:
    code: int
    err: str
    metrics: bytes | None
    batches: bytes | None


def run_cli(events: Path, *options: str, tmp_path: Path) -> Run:
    """``python -m staleness_metrics.cli replay`` in a subprocess, as a user runs it."""
    metrics, batches = tmp_path / "metrics.jsonl", tmp_path / "batches.jsonl"
    metrics.unlink(missing_ok=True)
    batches.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "staleness_metrics.cli", "replay", str(events), *options,
            "--metrics-out", str(metrics), "--batches-out", str(batches)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, check=False)
    return Run(
        done.returncode,
        done.stderr,
        metrics.read_bytes() if metrics.exists() else None,
        batches.read_bytes() if batches.exists() else None,
    )


@pytest.mark.parametrize("case", HOSTILE, ids=[case.name for case in HOSTILE])
def test_hostile_lines_end_in_exit_2_naming_the_line(case: Hostile, tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    events.write_bytes(case.content)
    strict = run_cli(events, "--strict", "--env-breakdown", tmp_path=tmp_path)
    assert (strict.code, strict.err) == (2, case.strict + "\n")
    assert strict.metrics is None and strict.batches is None  # no output file on exit 2
    lenient = run_cli(events, "--lenient", "--env-breakdown", tmp_path=tmp_path)
    if case.lenient is not None:
        assert (lenient.code, lenient.err) == (2, case.lenient + "\n")
        assert lenient.metrics is None and lenient.batches is None
        return
    # lenient: the rollout is set aside and counted; the others ship, and the files are valid UTF-8 JSON
    assert lenient.code == 0, lenient.err
    assert "1 invalid set aside" in lenient.err and "Traceback" not in lenient.err
    assert lenient.metrics is not None and lenient.batches is not None
    shipped = [r["id"] for line in lenient.batches.splitlines() for r in orjson.loads(line)["shipped"]]
    assert sorted(shipped) == ["a", "b"][: len(shipped)] and "a" in shipped
    for line in lenient.metrics.splitlines():
        assert all("\\u" not in key and "\ufffd" not in key for key in orjson.loads(line))


def plain_stream() -> bytes:
    return stream(BEFORE, rollout_line("c", env="math"), SHIP, AFTER, b'{"type": "ship", "step": 2}')


@pytest.mark.parametrize(
    ("suffix", "compress"), [(".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress)]
)
def test_gzip_bzip2_and_xz_files_are_read_as_the_plain_file(suffix: str, compress: Any, tmp_path: Path) -> None:
    """Known by their first bytes, whatever their name (here named .jsonl)."""
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(plain_stream())
    expected = run_cli(plain, "--max-staleness", "0", tmp_path=tmp_path)
    assert expected.code == 0 and expected.batches
    packed = tmp_path / f"packed{suffix}"
    packed.write_bytes(compress(plain_stream()))
    misnamed = tmp_path / "events.jsonl"
    misnamed.write_bytes(compress(plain_stream()))
    for path in (packed, misnamed):
        assert run_cli(path, "--max-staleness", "0", tmp_path=tmp_path) == expected


def test_what_if_reads_a_gzip_file_as_the_plain_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain, packed = tmp_path / "plain.jsonl", tmp_path / "events.jsonl.gz"
    plain.write_bytes(plain_stream())
    packed.write_bytes(gzip.compress(plain_stream()))
    assert cli_main(["what-if", str(plain), "--max-staleness", "0..2", "--json"]) == 0
    expected = capsys.readouterr().out
    assert cli_main(["what-if", str(packed), "--max-staleness", "0..2", "--json"]) == 0
    assert capsys.readouterr().out == expected and len(json.loads(expected)) == 3


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b"\x28\xb5\x2f\xfd" + b"\x00" * 16,
            "compressed with zstd, which replay does not read: decompress it first (zstd -d ",
        ),
        (b"PK\x03\x04" + b"\x00" * 16, "a zip archive: extract the event stream first (unzip "),
        ("\ufeff".encode("utf-16-le") + SHIP.decode().encode("utf-16-le"), "UTF-16 text; replay reads UTF-8"),
        (gzip.compress(plain_stream())[:-12], "gzip data damaged or cut short"),
        (lzma.compress(plain_stream())[:40], "xz data damaged or cut short"),
    ],
    ids=["zstd", "zip", "utf-16", "gzip cut short", "xz cut short"],
)
def test_files_replay_cannot_read_are_named(content: bytes, message: str, tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    events.write_bytes(content)
    run = run_cli(events, tmp_path=tmp_path)
    assert run.code == 2 and run.err.startswith(f"staleness-metrics replay: {events}: ") and message in run.err
    assert run.err.count("\n") == 1 and run.metrics is None and run.batches is None


@pytest.mark.parametrize("later", ["step down", "gzip cut short"])
def test_the_first_error_of_the_stream_is_the_one_named_whatever_comes_after_it(later: str, tmp_path: Path) -> None:
    """A strict replay reads ahead (windows of adds with the ships and sweeps between them), yet names the first
    error in stream order: the ship at line 2 meeting a version above the trained one, before a step that goes
    down at a later line or before the end of a gzip file cut short (the later error came out first)."""
    record = {"id": "ahead", "dispatch_version": 0, "samples": [{"mask": [1], "token_versions": [5]}]}
    ahead = json.dumps({"type": "rollout", "rollout": record}).encode()  # the ship at step 1 trains version 0
    lines = [ahead, SHIP, *(rollout_line(f"r{i}") for i in range(600)), b'{"type": "ship", "step": 5}']
    if later == "step down":
        content = stream(*lines, b'{"type": "sweep", "step": 3}')
    else:
        content = gzip.compress(stream(*lines))[:-12]
    events = tmp_path / "events.jsonl"
    events.write_bytes(content)
    run = run_cli(events, "--strict", tmp_path=tmp_path)
    assert run.code == 2 and run.err.startswith("line 2: rollout 'ahead': field samples[0].token_versions"), run.err


LONG = (1 << 24) + 5  # simdjson counts a list's elements in 24 bits: 16,777,215 at most


def test_a_sample_longer_than_2_24_positions_is_replayed_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The positions beyond 2**24 - 1 are kept, in every output, by the fast path and the general one.

    Positions up to 2**24 are stale (version 1) and masked at the ship; the last four are fresh
    (version 10) and kept: a sample cut to 2**24 - 1 positions would keep none. A short rollout in the
    same batch of lines must keep its own values (the cut shifted every later list)."""
    mask = b",".join([b"1"] * LONG)
    big = (b'{"type": "rollout", "rollout": {"id": "big", "dispatch_version": 1, "samples": [{"mask": ['
           + mask + b'], "weight_versions": [[1, 0], [10, %d]]}]}}' % (LONG - 4))  # fmt: skip
    short = rollout_line(
        "short", [1, 0, 1], dispatch_version=10, samples=[{"mask": [1, 0, 1], "token_versions": [10, 10, 10]}]
    )
    events = tmp_path / "events.jsonl"
    events.write_bytes(stream(big, short, b'{"type": "ship", "step": 11}'))
    del mask, big

    parsed = [e.parsed for e in read_events([events.read_bytes().split(b"\n")[0]], parse=True)]
    assert parsed[0] is not None and len(parsed[0].samples[0].mask) == LONG  # the fast path read it

    run = run_cli(events, "--max-staleness", "5", tmp_path=tmp_path)
    assert run.code == 0, run.err
    assert f"{LONG - 4}/{LONG + 2} sampled tokens masked" in run.err
    assert run.metrics is not None and run.batches is not None
    metrics = orjson.loads(run.metrics)
    assert metrics["staleness/rollout/dropped"] == 0
    shipped = {r["id"]: r["samples"][0] for r in orjson.loads(run.batches)["shipped"]}
    assert shipped["short"]["mask"] == [1, 0, 1]
    big_mask = shipped["big"]["mask"]
    assert len(big_mask) == LONG and big_mask[-4:] == [1, 1, 1, 1] and sum(big_mask) == 4
    del shipped, big_mask

    # the general path (no simdjson) writes the same bytes
    monkeypatch.setattr(simd_records, "AVAILABLE", False)
    metrics_path, batches_path = tmp_path / "m.jsonl", tmp_path / "b.jsonl"
    argv = ["replay", str(events), "--max-staleness", "5", "--metrics-out", str(metrics_path),
            "--batches-out", str(batches_path)]  # fmt: skip
    assert cli_main(argv) == 0
    assert metrics_path.read_bytes() == run.metrics and batches_path.read_bytes() == run.batches
