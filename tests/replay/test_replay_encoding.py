"""The fast replay path (simdjson / orjson, records parsed as they are read, arrays written natively)
writes the same values as the standard-library path it replaced (issue 12), and the same bytes as the
general path (every line decoded by orjson, batches encoded from lists).

The oracle is the old path, kept here only: every event line decoded by ``json.loads``, rollouts
added as dicts one event batch at a time, each ship encoded with ``json.dumps`` of plain lists. The
replay command's files must parse to equal values, line by line, on random streams of every policy,
lenient streams with invalid rollouts included.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics import Sink, StalenessConfig
from staleness_metrics.cli import main as cli_main
from staleness_metrics.errors import EventError, TraceError
from staleness_metrics.records import jsonio
from staleness_metrics.replay.stream import read_events, run_events
from tests.reference.compare import write_events
from tests.reference.streams import ReplayConfig, random_stream
from tests.replay.test_replay_hostile import BEFORE, HOSTILE, Hostile


def _config(replay_config: ReplayConfig) -> StalenessConfig:
    options = replay_config.reference_options()
    lenient = options.pop("lenient")
    return StalenessConfig(**options, strict=not lenient)


def old_path(lines: list[str], config: StalenessConfig) -> tuple[list[Any], list[Any]]:
    """Replay as the project did before issue 12: stdlib JSON, dict records, lists in the output."""
    sink = Sink(config)
    metrics: list[Any] = []
    batches: list[Any] = []
    pending: list[dict[str, Any]] = []

    def flush() -> None:
        try:
            sink.add(pending)
        except TraceError:
            for record in pending:
                sink.add(record)
        pending.clear()

    for text in lines:
        if not text.strip():
            continue
        event = json.loads(text)
        if event["type"] == "rollout":
            pending.append(event["rollout"])
            continue
        if pending:
            flush()
        if event["type"] == "sweep":
            sink.sweep(event["step"])
            continue
        shipment = sink.ship(event["step"], event.get("ids"))
        metrics.append(json.loads(json.dumps(shipment.report.row())))
        batches.append(json.loads(json.dumps(shipment.batches_line())))
    if pending:
        flush()
    return metrics, batches


def general_path(events_path: Path, config: StalenessConfig) -> tuple[bytes, bytes] | str:
    """The replay files as the general path writes them (or its error): every line decoded by orjson
    (``read_events`` without ``parse``), the batches encoded from plain lists, not arrays."""
    sink = Sink(config)
    metrics, batches = [], []
    try:
        with events_path.open("rb") as handle:
            for shipment in run_events(read_events(handle), sink):
                metrics.append(jsonio.dumps(shipment.report.row()) + b"\n")
                batches.append(jsonio.dumps(shipment.batches_line()) + b"\n")
    except EventError as error:
        return str(error)
    return b"".join(metrics), b"".join(batches)


@pytest.mark.parametrize("policy", ["token", "episode", "group", "xtuner"])
@pytest.mark.parametrize("lenient", [False, True])
def test_replay_files_are_the_bytes_of_the_general_path(
    policy: str, lenient: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The replay command (rollout lines read by simdjson, arrays encoded natively) writes byte for
    byte what the general path writes, and refuses a stream with the same message."""
    parsed_lines = 0
    for seed in range(40):
        replay_config, events = random_stream(seed, policy, lenient=lenient, defects=2 if lenient else 0)
        events_path = tmp_path / "events.jsonl"
        write_events(events, events_path)
        parsed_lines += sum(
            e.parsed is not None for e in read_events(events_path.read_bytes().splitlines(), parse=True)
        )
        expected = general_path(events_path, _config(replay_config))
        metrics_path, batches_path = tmp_path / "m.jsonl", tmp_path / "b.jsonl"
        metrics_path.unlink(missing_ok=True)
        batches_path.unlink(missing_ok=True)
        argv = ["replay", str(events_path), *replay_config.cli_args(), "--metrics-out", str(metrics_path),
                "--batches-out", str(batches_path), "--no-progress"]  # fmt: skip
        code = cli_main(argv)
        err = capsys.readouterr().err
        if isinstance(expected, str):
            assert code == 2 and err.strip() == expected, f"seed {seed}"
            continue
        assert code == 0, f"seed {seed}: {err}"
        assert metrics_path.read_bytes() == expected[0], f"seed {seed}"
        assert batches_path.read_bytes() == expected[1], f"seed {seed}"
    assert parsed_lines > 100  # the fast read took most rollout lines: the comparison is not vacuous


def _read(path: Path) -> list[Any]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("policy", ["token", "episode", "group", "xtuner"])
@pytest.mark.parametrize("lenient", [False, True])
def test_replay_files_hold_the_values_of_the_old_path(policy: str, lenient: bool, tmp_path: Path) -> None:
    checked = 0
    for seed in range(40):
        replay_config, events = random_stream(seed, policy, lenient=lenient, defects=2 if lenient else 0)
        events_path = tmp_path / "events.jsonl"
        lines = write_events(events, events_path)
        config = _config(replay_config)
        try:
            expected_metrics, expected_batches = old_path(lines, config)
        except (TraceError, ValueError):
            continue  # a stream the old path refused: the crosscheck tests cover refusals
        metrics_path, batches_path = tmp_path / "m.jsonl", tmp_path / "b.jsonl"
        argv = ["replay", str(events_path), *replay_config.cli_args(), "--metrics-out", str(metrics_path),
                "--batches-out", str(batches_path), "--no-progress"]  # fmt: skip
        assert cli_main(argv) == 0, f"seed {seed}"
        assert _read(metrics_path) == expected_metrics, f"seed {seed}"
        assert _read(batches_path) == expected_batches, f"seed {seed}"
        checked += 1
    assert checked >= 20  # most random streams are valid: the comparison ran on them


def test_encoder_writes_float32_arrays_as_the_float64_values_lists_gave() -> None:
    """Arrays go to the encoder widened to float64: 0.1 as float32 is written as 0.10000000149011612,
    the value ``float(np.float32(0.1))`` has and the old path wrote."""
    import numpy as np

    from staleness_metrics import RolloutBatch

    weights = np.array([0.1, 0.7], dtype=np.float32)
    batch = RolloutBatch(
        ids=["r"], sample_offsets=np.array([0, 1]), position_offsets=np.array([0, 2]),
        mask=np.ones(2, dtype=np.float32), rl_weights=weights, dispatch_version=np.array([3]),
    )  # fmt: skip
    sink = Sink(StalenessConfig())
    sink.add(batch)
    shipment = sink.ship(4)
    fast = json.loads(jsonio.dumps(shipment.batches_line(arrays=True)))
    assert fast == json.loads(json.dumps(shipment.batches_line()))
    assert fast["shipped"][0]["samples"][0]["rl_weights"] == [float(np.float32(0.1)), float(np.float32(0.7))]


def test_lines_the_fast_decoder_refuses_mean_what_they_always_meant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """orjson refuses NaN literals; the line is read again by the standard library, so the rollout is
    refused for its non-finite weight (lenient: set aside and counted), not as bad JSON."""
    record = {"id": "r", "dispatch_version": 0, "samples": [{"mask": [1], "rl_weights": [float("nan")]}]}
    events_path = tmp_path / "events.jsonl"
    events_path.write_text(
        json.dumps({"type": "rollout", "rollout": record}) + "\n" + json.dumps({"type": "ship", "step": 1}) + "\n"
    )
    metrics_path = tmp_path / "m.jsonl"
    assert cli_main(["replay", str(events_path), "--lenient", "--metrics-out", str(metrics_path)]) == 0
    assert "1 invalid set aside" in capsys.readouterr().err
    assert "staleness/token/mean" not in _read(metrics_path)[0]  # nothing shipped
    assert cli_main(["replay", str(events_path), "--strict"]) == 2
    assert "rl_weights" in capsys.readouterr().err and "bad JSON" not in capsys.readouterr().err


@pytest.mark.parametrize("field", ["rl_weights", "token_versions"])
@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 10**30])
def test_integers_beyond_64_bits_mean_what_the_standard_library_reads(field: str, value: int) -> None:
    """orjson would read these as floats (a weight of 1.8e19 accepted, a version "not an integer");
    the line is decoded by the standard library instead, so the rollout is refused as it always was."""
    sample: dict[str, Any] = {"mask": [1, 1], field: [value, 1]}
    line = json.dumps({"type": "rollout", "rollout": {"id": "r", "dispatch_version": 0, "samples": [sample]}})
    assert jsonio.loads(line.encode()) == json.loads(line)
    assert type(jsonio.loads(line)["rollout"]["samples"][0][field][0]) is int
    sink = Sink(StalenessConfig(strict=True))
    with pytest.raises(EventError, match=field):
        list(run_events(read_events([line.encode(), b'{"type": "ship", "step": 1}']), sink))


_WEIGHT_VALUES = st.sampled_from([0.0, 1.0, -0.0, 0.5, 2.0, 1e-300, 1e300, math.inf, -1.0, math.nan, 5e-324])


def test_a_line_past_orjsons_depth_is_too_deep_whatever_the_pythons_recursion_limit() -> None:
    """On Python 3.13 the standard library read 5,000 levels that 3.11 refuses: a line's meaning hung on it
    (here: 3.11 with a recursion limit that lets it read them)."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        with pytest.raises(jsonio.DecodeError, match=r"^arrays or objects nested too deeply"):
            jsonio.loads(b'{"type": "sweep", "step": 1, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    finally:
        sys.setrecursionlimit(old)


@settings(max_examples=300, deadline=None)
@given(
    arrays=st.lists(st.lists(st.sampled_from([0.0, 1.0]), max_size=12), max_size=5),
    odd=st.one_of(st.none(), st.tuples(st.integers(0, 4), st.integers(0, 11), _WEIGHT_VALUES)),
)
def test_zero_one_weights_are_written_as_orjson_writes_them(
    arrays: list[list[float]], odd: tuple[int, int, float] | None
) -> None:
    """The table look-up writes each array exactly as orjson formats it, or declines when a value
    (anywhere in the ship) is not 0.0 / 1.0: -0.0, NaN, other numbers."""
    import numpy as np
    import orjson

    if odd is not None and odd[0] < len(arrays) and arrays[odd[0]]:
        arrays[odd[0]][odd[1] % len(arrays[odd[0]])] = odd[2]
    values = [np.array(a, dtype=np.float64) for a in arrays]
    texts = jsonio.zero_one_floats(values)
    zero_one = all(
        np.float64(v).tobytes() in (np.float64(0).tobytes(), np.float64(1).tobytes()) for a in arrays for v in a
    )
    assert (texts is not None) == zero_one
    if texts is not None:
        assert [orjson.dumps(t) for t in texts] == [orjson.dumps(v, option=orjson.OPT_SERIALIZE_NUMPY) for v in values]
        assert orjson.dumps({"w": texts}) == orjson.dumps({"w": values}, option=orjson.OPT_SERIALIZE_NUMPY)


def test_without_pysimdjson_replay_reads_every_line_by_the_general_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """pysimdjson is not installed on every Python (no wheel for 3.14 yet): replay is then only slower."""
    from staleness_metrics.records import simd_records

    replay_config, events = random_stream(3, "token")
    events_path = tmp_path / "events.jsonl"
    write_events(events, events_path)
    outputs = []
    for available in (True, False):
        monkeypatch.setattr(simd_records, "AVAILABLE", available)
        read = list(read_events(events_path.read_bytes().splitlines(), parse=True))
        assert any(e.parsed is not None for e in read) is available
        metrics, batches = tmp_path / f"m{available}.jsonl", tmp_path / f"b{available}.jsonl"
        assert cli_main(["replay", str(events_path), *replay_config.cli_args(), "--metrics-out", str(metrics),
                         "--batches-out", str(batches)]) == 0  # fmt: skip
        outputs.append((metrics.read_bytes(), batches.read_bytes()))
    assert outputs[0] == outputs[1] and outputs[0][1]


@pytest.mark.parametrize("mode", ["--strict", "--lenient"])
@pytest.mark.parametrize("case", HOSTILE, ids=[case.name for case in HOSTILE])
def test_without_pysimdjson_hostile_files_end_the_same(
    case: Hostile, mode: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Deep nesting, lone surrogates, invalid UTF-8, NUL bytes (tests/replay/test_replay_hostile.py): the same
    exit status, message and files whether simdjson reads the plain rollout lines around them or not."""
    from staleness_metrics.records import simd_records

    events_path = tmp_path / "events.jsonl"
    events_path.write_bytes(case.content)
    outcomes = []
    for available in (True, False):
        monkeypatch.setattr(simd_records, "AVAILABLE", available)
        if case.content.startswith(BEFORE):  # a plain rollout line, which the fast path reads when on
            first = next(read_events(case.content.splitlines()[:1], parse=True))
            assert (first.parsed is not None) is available
        metrics, batches = tmp_path / f"m{available}.jsonl", tmp_path / f"b{available}.jsonl"
        code = cli_main(["replay", str(events_path), mode, "--env-breakdown", "--metrics-out", str(metrics),
                         "--batches-out", str(batches)])  # fmt: skip
        files = [path.read_bytes() if path.exists() else None for path in (metrics, batches)]
        outcomes.append((code, capsys.readouterr().err, files))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == (0 if mode == "--lenient" and case.lenient is None else 2)
