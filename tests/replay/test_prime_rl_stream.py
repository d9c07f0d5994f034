"""prime-rl runs in the current layout (monitors/file/traces): hand-computed unit tests of the reader.

The records here are JSON written directly (unit fixtures, :mod:`tests.replay.prime_rl_runs`); the runs written
from verifiers' own classes are tested in tests/prime_rl_verifiers.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from staleness_metrics.cli import main
from staleness_metrics.config import StalenessConfig
from staleness_metrics.errors import EventError
from staleness_metrics.records.model import ParsedRollout
from staleness_metrics.replay.sources import detect_source, read_run_events
from staleness_metrics.replay.sources.prime_rl import fold_streams
from staleness_metrics.replay.sources.prime_rl.compare import compare_prime_rl, describe_comparison
from staleness_metrics.replay.sources.prime_rl.episodes import Stream
from staleness_metrics.replay.stream import Event, replay
from tests.replay.prime_rl_runs import RunWriter, episode, node, seekable_zstd, trace

NAN = math.nan


def _events(root: Path, **options: Any) -> list[Event]:
    return list(read_run_events(root, **options))


def _rollouts(events: list[Event]) -> dict[str, ParsedRollout]:
    return {e.parsed.id: e.parsed for e in events if e.kind == "rollout" and e.parsed is not None}


def _plan(events: list[Event]) -> list[tuple[str, object]]:
    return [
        ("add", e.parsed.id if e.parsed else None) if e.kind == "rollout" else ("ship", (e.step, e.ids)) for e in events
    ]


def _simple_run(root: Path, **writer: Any) -> RunWriter:
    """Two steps: t0, t1 arrive at 1 and ship at 1; t2 arrives at 2 and ships at 2."""
    w = RunWriter(root, **writer)
    for i in range(2):
        nodes = [node(3), node(4, [1, 2, 3], [-0.1, -0.2, -0.3], parent=0)]
        w.episode(episode(f"e{i}", [trace(f"t{i}", nodes, arrival=1)], (0, 0), group="g"))
    w.ship(1, "t0", "t1")
    w.trainer("t0", 0, [None, None, None, None, -0.1, -0.25, -0.3])
    w.episode(episode("e2", [trace("t2", [node(2), node(2, [0, 1], parent=0)], arrival=2)], (0, 1)))
    w.ship(2, "t2")
    return w


# -- folding ----------------------------------------------------------------------------------------


def test_fold_newest_wins_position_by_position_and_nulls_leave_what_was_there() -> None:
    base = np.array([NAN, -1.0, -2.0, NAN])
    first = Stream(np.array([NAN, -1.5, NAN, -4.0]), "u", 1)
    second = Stream(np.array([NAN, NAN, -2.5]), "u", 2)  # shorter: position 3 keeps the first's
    out = fold_streams(4, base, [first, second])
    assert out is not None
    np.testing.assert_array_equal(out, [NAN, -1.5, -2.5, -4.0])


def test_fold_of_a_stream_shorter_than_its_branch_covers_what_it_holds() -> None:
    out = fold_streams(5, None, [Stream(np.array([NAN, -0.1, -0.2]), "u", 1)])
    assert out is not None
    np.testing.assert_array_equal(out, [NAN, -0.1, -0.2, NAN, NAN])
    assert fold_streams(3, None, []) is None
    assert fold_streams(3, None, [Stream(np.array([NAN, NAN]), "u", 1)]) is None  # nothing covered


def test_a_trainer_stream_shorter_than_its_branch_leaves_only_the_rest_uncovered(tmp_path: Path) -> None:
    w = RunWriter(tmp_path)
    # a node of 4 sampled tokens; the trainer's stream stops inside it (prime-rl's fold would leave it bare)
    w.episode(episode("e", [trace("t", [node(2), node(4, [0, 1, 2, 3], [-1.0] * 4, parent=0)], arrival=1)], (0, 0)))
    w.ship(1, "t")
    w.trainer("t", 0, [None, None, -1.1, -1.2])
    sample = _rollouts(_events(tmp_path))["t"].samples[0]
    np.testing.assert_array_equal(sample.mask, [0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(sample.trainer_logprobs, [NAN, NAN, -1.1, -1.2, NAN, NAN])
    np.testing.assert_array_equal(sample.logprobs, [0, 0, -1, -1, -1, -1])


def test_later_trainer_updates_win_and_the_records_own_values_are_the_base(tmp_path: Path) -> None:
    w = RunWriter(tmp_path)
    sampled = node(2, [0, 1], [-1.0, -2.0], parent=0, trainer_logprobs=[-0.9, None])
    w.episode(episode("e", [trace("t", [node(1), sampled], arrival=1)], (0, 0)))
    w.ship(1, "t")
    w.trainer("t", 0, [None, -0.8, -1.8])
    w.trainer("t", 0, [None, None, -1.7])  # a resumed trainer writes again: newest wins, null leaves
    sample = _rollouts(_events(tmp_path))["t"].samples[0]
    np.testing.assert_array_equal(sample.trainer_logprobs, [NAN, -0.8, -1.7])


def test_one_sample_per_trainable_branch_and_a_shared_sampled_node_trains_in_the_first_only(tmp_path: Path) -> None:
    w = RunWriter(tmp_path)
    nodes = [
        node(2),  # 0: prompt
        node(2, [0, 1], [-0.1, -0.2], parent=0),  # 1: sampled, shared by both branches
        node(1, parent=1),  # 2: a tool reply
        node(2, [0, 1], [-0.3, -0.4], parent=2),  # 3: leaf of branch 0
        node(3, [2], [-0.5], parent=1),  # 4: leaf of branch 1
    ]
    w.episode(episode("e", [trace("t", nodes, arrival=1)], (0, 0)))
    w.ship(1, "t")
    w.trainer("t", 0, [None, None, -0.1, -0.2, None, -0.3, -0.4])
    w.trainer("t", 1, [None, None, None, None, None, None, -0.55])
    samples = _rollouts(_events(tmp_path))["t"].samples
    assert len(samples) == 2
    np.testing.assert_array_equal(samples[0].mask, [0, 0, 1, 1, 0, 1, 1])
    np.testing.assert_array_equal(samples[1].mask, [0, 0, 0, 0, 0, 0, 1])  # node 1 trained in branch 0
    np.testing.assert_array_equal(samples[1].logprobs, [0, 0, -0.1, -0.2, 0, 0, -0.5])
    np.testing.assert_array_equal(samples[1].trainer_logprobs, [NAN] * 6 + [-0.55])
    assert _rollouts(_events(tmp_path))["t"].agentic  # several sampled turns


def test_a_compaction_attempt_not_resumed_from_is_not_trainable(tmp_path: Path) -> None:
    w = RunWriter(tmp_path)
    nodes = [
        node(1),
        node(2, [0, 1], parent=0, semantic_parents=[{"node": 0, "type": "compaction_attempt"}]),  # dangling leaf
        node(2, [1], parent=0),
    ]
    w.episode(episode("e", [trace("t", nodes, arrival=1)], (0, 0)))
    w.ship(1, "t")
    samples = _rollouts(_events(tmp_path))["t"].samples
    assert [s.mask.tolist() for s in samples] == [[0, 0, 1]]


def test_weight_versions_on_a_node_label_its_sampled_tokens_from_k(tmp_path: Path) -> None:
    w = RunWriter(tmp_path)
    labelled = node(6, [1, 2, 3, 4, 5], parent=0, weight_versions=[[3, 1], [5, 3]])
    compact = node(3, [0, 2], parent=1, token_versions=[-1, 4])
    w.episode(episode("e", [trace("t", [node(2), labelled, compact], arrival=7)], (2, 5)))
    w.ship(7, "t")
    sample = _rollouts(_events(tmp_path))["t"].samples[0]
    # sampled k = 0..4 at positions 3..7; k0 unlabelled, k1-2 version 3, k3-4 version 5; then 8, 10
    assert sample.token_versions is not None
    np.testing.assert_array_equal(sample.token_versions, [-1, -1, -1, -1, 3, 3, 5, 5, -1, -1, 4])
    shipment = replay(iter(_events(tmp_path)), StalenessConfig(max_staleness=8))[0]
    # T = 6: unlabelled take the dispatch version 2 (lag 4), then lags 3, 3, 1, 1, and 4 -> lag 2
    assert shipment.report.metrics["staleness/token/mean"] == pytest.approx((4 + 3 + 3 + 1 + 1 + 4 + 2) / 7)
    assert shipment.report.metrics["staleness/token/unlabelled"] == pytest.approx(2 / 7)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"weight_versions": [[3, 2], [4, 1]]}, "nodes[1].weight_versions[1]"),
        ({"weight_versions": [[3, 5]]}, "nodes[1].weight_versions[0]"),
        ({"token_versions": [1]}, "nodes[1].token_versions"),
        ({"logprobs": [-0.1]}, "nodes[1].logprobs"),
    ],
)
def test_bad_per_token_fields_name_the_trace_node_and_field(tmp_path: Path, extra: dict[str, Any], field: str) -> None:
    w = RunWriter(tmp_path)
    w.episode(episode("e", [trace("t", [node(1), node(3, [0, 1, 2], parent=0, **extra)], arrival=1)], (0, 0)))
    w.ship(1, "t")
    named = r"line 1: .*stream/00000\.jsonl: " + re.escape(f"rollout 't': field {field}:")  # its file and line
    with pytest.raises(EventError, match=named):
        replay(iter(_events(tmp_path)), StalenessConfig())
    shipments = replay(iter(_events(tmp_path, strict=False)), StalenessConfig(strict=False))
    assert shipments[0].report.tally.rollouts_invalid == 1


def test_parents_in_a_loop_name_the_trace_by_file_and_line_and_lenient_sets_it_aside(tmp_path: Path) -> None:
    w = RunWriter(tmp_path)
    looped = [node(1, parent=1), node(2, [1], parent=0), node(2, [0, 1], parent=1)]  # 0 -> 1 -> 0; leaf 2
    w.episode(episode("good", [trace("u", [node(1), node(2, [0, 1], parent=0)], arrival=1)], (0, 0)))
    w.episode(episode("bad", [trace("t", looped, arrival=1)], (0, 0)))
    w.ship(1, "u", "t")
    named = r"line 2: .*stream/00000\.jsonl: rollout 't': field nodes\[\d\]\.parent: the parents form a loop"
    with pytest.raises(EventError, match=named):
        replay(iter(_events(tmp_path)), StalenessConfig())
    shipment = replay(iter(_events(tmp_path, strict=False)), StalenessConfig(strict=False))[0]
    assert [r.id for r in shipment.rollouts] == ["u"] and shipment.report.tally.rollouts_invalid == 1


# -- the stream: layouts, chunks, torn lines, relaunches ----------------------------------------------


@pytest.mark.parametrize("writer", [{"chunked": True}, {"chunked": False}, {"chunk_lines": 1}])
def test_events_of_a_run_in_arrival_order_with_ships_between(tmp_path: Path, writer: dict[str, Any]) -> None:
    _simple_run(tmp_path, **writer)
    events = _events(tmp_path)
    assert _plan(events) == [
        ("add", "t0"),
        ("add", "t1"),
        ("ship", (1, ("t0", "t1"))),
        ("add", "t2"),
        ("ship", (2, ("t2",))),
    ]
    t0 = _rollouts(events)["t0"]
    assert (t0.dispatch_version, t0.completion_version, t0.group_id, t0.env) == (0, 0, "g", "math")
    assert detect_source(tmp_path) == "prime-rl"
    # monitors/file and traces folders are found too
    assert _plan(_events(tmp_path / "monitors" / "file")) == _plan(events)
    assert _plan(_events(tmp_path / "monitors" / "file" / "traces")) == _plan(events)


def test_sealed_chunks_of_several_frames_read_as_plain_ones(tmp_path: Path) -> None:
    plain, sealed = tmp_path / "plain", tmp_path / "sealed"
    _simple_run(plain, chunk_lines=2)
    w = _simple_run(sealed, chunk_lines=2)
    w.seal("stream", frame_bytes=64)  # many frames per chunk
    w.seal("annotations/trainer", frame_bytes=64)
    assert sorted(p.name for p in (sealed / "monitors/file/traces/stream").iterdir()) == [
        "00000.jsonl.zst",
        "00001.jsonl.zst",
    ]
    a, b = _events(plain), _events(sealed)
    assert _plan(a) == _plan(b)
    np.testing.assert_array_equal(
        _rollouts(a)["t0"].samples[0].trainer_logprobs, _rollouts(b)["t0"].samples[0].trainer_logprobs
    )


def test_a_sealed_chunk_beside_its_plain_twin_is_read_once(tmp_path: Path) -> None:
    w = _simple_run(tmp_path)
    chunk = w.traces / "stream" / "00000.jsonl"
    chunk.with_name("00000.jsonl.zst.tmp").write_bytes(b"partial")  # a seal in progress
    chunk.with_name("00000.jsonl.zst").write_bytes(seekable_zstd(chunk.read_bytes()))
    assert [e.kind for e in _events(tmp_path)].count("rollout") == 3


def test_chunks_sealed_after_the_reader_listed_them_are_read_sealed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prime-rl seals a full chunk in the background (``.zst`` written, the plain file removed): a replay of a
    live run that listed a plain chunk reads its sealed twin, the stream's and the trainer's alike (the stream's
    chunk was damage, the trainer's log-probabilities were lost without a word)."""
    from staleness_metrics.replay.sources.prime_rl import chunks, run

    _simple_run(tmp_path / "plain", chunk_lines=2)
    expected = _events(tmp_path / "plain")
    w = _simple_run(tmp_path / "live", chunk_lines=2)

    def listed_then_sealed(path: Any) -> Any:
        layout = chunks.find_layout(path)
        w.seal("stream")
        w.seal("annotations/trainer")
        return layout

    monkeypatch.setattr(run, "find_layout", listed_then_sealed)
    read = read_run_events(tmp_path / "live")
    got = list(read)
    assert _plan(got) == _plan(expected) and read.notes.damage.total == 0
    np.testing.assert_array_equal(
        _rollouts(got)["t0"].samples[0].trainer_logprobs, _rollouts(expected)["t0"].samples[0].trainer_logprobs
    )


def test_a_chunk_the_writer_rolls_to_after_the_listing_is_read_by_the_next_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prime-rl rolls to a new chunk (its line, then its index row) while a replay reads: the index is read
    as it was when the chunks were listed, so the new episode is the next replay's (a strict replay stopped:
    'the row of episode ... points at chunk 00001, offset 0: past the end of the stream')."""
    from staleness_metrics.replay.sources.prime_rl import chunks, run

    w = _simple_run(tmp_path, chunk_lines=3)  # e0, e1, e2 fill chunk 00000
    expected = _plan(_events(tmp_path))

    def listed_then_rolled(path: Any) -> Any:
        layout = chunks.find_layout(path)
        w.episode(episode("e3", [trace("t3", [node(1), node(1, [0], parent=0)], arrival=3)], (0, 0)))
        return layout

    monkeypatch.setattr(run, "find_layout", listed_then_rolled)
    read = read_run_events(tmp_path)
    assert _plan(list(read)) == expected and read.notes.damage.total == 0
    assert (w.traces / "stream/00001.jsonl").is_file()
    monkeypatch.undo()
    assert ("add", "t3") in _plan(_events(tmp_path, max_staleness=0))  # read at rest: stale, never shipped


def test_an_index_the_replay_cannot_read_is_left_out_as_a_missing_one(tmp_path: Path) -> None:
    """The index is a cross-check: unreadable (its permissions), the run replays as without it (a lenient
    replay stopped on it). Run without the capability to read past permissions, as root has it."""
    import os
    import subprocess
    import sys

    _simple_run(tmp_path)
    index = tmp_path / "monitors/file/traces/stream.index.jsonl"
    command = [sys.executable, "-m", "staleness_metrics", "replay", str(tmp_path), "--lenient"]
    if os.geteuid() == 0:
        command = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *command]
    index.chmod(0)
    unreadable = subprocess.run(command, capture_output=True, text=True, check=False)
    index.unlink()
    missing = subprocess.run(command, capture_output=True, text=True, check=False)
    assert (unreadable.returncode, unreadable.stderr) == (missing.returncode, missing.stderr) == (0, missing.stderr)
    assert "3 rollouts shipped" in missing.stderr


def test_a_torn_last_line_ends_the_stream(tmp_path: Path) -> None:
    _simple_run(tmp_path)
    chunk = tmp_path / "monitors/file/traces/stream/00000.jsonl"
    with chunk.open("ab") as out:
        out.write(b'{"id": "e3", "traces": [{"id": "t3", "nod')
    read = read_run_events(tmp_path)
    assert _plan(list(read))[-1] == ("ship", (2, ("t2",)))
    assert read.notes.torn == 1 and read.notes.damage.total == 0


def test_a_relaunch_appends_after_a_torn_line_and_the_index_says_where(tmp_path: Path) -> None:
    w = _simple_run(tmp_path)
    chunk = w.traces / "stream" / "00000.jsonl"
    with chunk.open("ab") as out:
        out.write(b'{"id": "lost", "tra')  # the first attempt died mid-append
    relaunched = RunWriter(tmp_path)  # appends to the plain last chunk, as prime-rl's writer does
    relaunched.logged = w.logged
    relaunched.episode(episode("e3", [trace("t3", [node(1), node(1, [0], parent=0)], arrival=3)], (1, 2)))
    relaunched.ship(3, "t3")
    read = read_run_events(tmp_path)
    plan = _plan(list(read))
    assert plan[-2:] == [("add", "t3"), ("ship", (3, ("t3",)))]
    assert read.notes.split_lines == 1 and read.notes.damage.total == 0


def test_a_relaunch_after_a_sealed_chunk_starts_a_new_one(tmp_path: Path) -> None:
    w = _simple_run(tmp_path)
    w.seal()
    relaunched = RunWriter(tmp_path)
    relaunched.lines[str(relaunched.traces / "stream")] = [1, 0]  # the next chunk after the sealed 00000
    relaunched.logged = w.logged
    relaunched.episode(episode("e3", [trace("t3", [node(1), node(1, [0], parent=0)], arrival=3)], (2, 2)))
    relaunched.ship(3, "t3")
    assert _plan(_events(tmp_path))[-2:] == [("add", "t3"), ("ship", (3, ("t3",)))]


# -- what enters, what is left out ----------------------------------------------------------------------


def test_eval_errored_frozen_and_never_shipped_episodes(tmp_path: Path) -> None:
    w = RunWriter(tmp_path)
    sampled = [node(1), node(1, [0], parent=0)]
    w.episode(episode("ev", [trace("tev", sampled, arrival=1, kind="eval")], (0, 0), kind="eval"))
    w.episode(episode("err", [trace("terr", sampled, arrival=1)], (0, 0), ok=False, errors=[{"type": "x"}]))
    w.episode(episode("fz", [trace("tfz", sampled, arrival=1)], None))  # frozen, shipped
    w.episode(episode("fz2", [trace("tfz2", sampled, arrival=1)], None))  # frozen, never shipped
    w.episode(episode("fresh", [trace("tfresh", sampled, arrival=1)], (0, 0)))  # never shipped, fresh
    w.episode(episode("ok", [trace("tok", sampled, arrival=1)], (0, 0)))
    w.ship(1, "tfz", "tok")
    w.ship(1, "tev")  # eval epochs get ship updates too
    w.episode(episode("stale", [trace("tstale", sampled, arrival=12)], (1, 2)))  # (12 - 1) - 1 > 8
    w.episode(episode("late", [trace("tlate", sampled, arrival=12)], (10, 11)))
    w.ship(12, "tlate")
    read = read_run_events(tmp_path, max_staleness=8)
    events = list(read)
    assert _plan(events) == [
        ("add", "tfz"),
        ("add", "tok"),
        ("ship", (1, ("tfz", "tok"))),
        ("add", "tstale"),
        ("add", "tlate"),
        ("ship", (12, ("tlate",))),
    ]
    assert _rollouts(events)["tfz"].frozen
    notes = read.notes
    assert (notes.eval_episodes, notes.errored_traces, notes.frozen_unshipped, notes.unshipped_left_out) == (1, 1, 1, 1)
    assert notes.unshipped_stale == 1
    shipments = replay(iter(_events(tmp_path)), StalenessConfig())
    assert shipments[1].report.metrics["staleness/rollout/dropped"] == 1
    assert shipments[0].report.tally.rollouts_frozen == 1
    # at a looser bound the stale one is not stale: left out
    assert ("add", "tstale") not in _plan(_events(tmp_path, max_staleness=10))


def test_a_trace_without_nodes_is_one_sampled_position(tmp_path: Path) -> None:
    w = RunWriter(tmp_path)
    w.episode(episode("e", [trace("t", [], arrival=2)], (0, 1)))
    w.ship(2, "t")
    sample = _rollouts(_events(tmp_path))["t"].samples[0]
    assert sample.mask.tolist() == [1] and sample.logprobs is None


# -- damage: strict stops naming file, line and reason; lenient sets it aside and counts it -------------


def _damaged(tmp_path: Path, kind: str) -> Path:
    w = _simple_run(tmp_path)
    traces = w.traces
    if kind == "not_json":
        (traces / "stream/00000.jsonl").write_bytes(b"{nope\n" + (traces / "stream/00000.jsonl").read_bytes())
    elif kind == "not_episode":
        with (traces / "stream/00000.jsonl").open("ab") as out:
            out.write(b'{"hello": 1}\n')
    elif kind == "not_update":
        with (traces / "annotations/orch/00000.jsonl").open("ab") as out:
            out.write(b"[1, 2]\n")
    elif kind == "unknown_trace":
        w.ship(2, "ghost")
    elif kind == "index_nowhere":
        with (traces / "stream.index.jsonl").open("ab") as out:
            out.write(b'{"line": 9, "chunk": 4, "offset": 0, "id": "e9"}\n')
    elif kind == "bad_chunk":
        w.seal()
        sealed = traces / "stream/00000.jsonl.zst"
        data = bytearray(sealed.read_bytes())
        data[1] ^= 0xFF  # the first frame's magic number
        sealed.write_bytes(bytes(data))
    elif kind == "cut_chunk":
        w.seal()
        sealed = traces / "stream/00000.jsonl.zst"
        sealed.write_bytes(sealed.read_bytes()[:40])
    elif kind == "empty_chunk":  # sealed (renamed) but never flushed before a crash: no frame at all
        w.seal("annotations/orch")
        (traces / "annotations/orch/00000.jsonl.zst").write_bytes(b"")
    elif kind == "bad_branch":
        w.trainer("t1", 3, [None, -0.1])
    elif kind == "duplicate_trace":  # the first episode's line written again
        data = (traces / "stream/00000.jsonl").read_bytes()
        (traces / "stream/00000.jsonl").write_bytes(data + data.splitlines(keepends=True)[0])
    return tmp_path


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("not_json", r"line 1: .*00000\.jsonl: not JSON"),
        ("not_episode", r"line 4: .*00000\.jsonl: not an episode record"),
        ("not_update", r"line 4: .*orch/00000\.jsonl: not an update"),
        ("unknown_trace", r"line 4: .*orch/00000\.jsonl: an update for trace 'ghost'"),
        ("index_nowhere", r"line 4: .*stream\.index\.jsonl: the row of episode 'e9' points at chunk 00004"),
        ("bad_chunk", r"00000\.jsonl\.zst: corrupt zstd data"),
        ("cut_chunk", r"00000\.jsonl\.zst: corrupt zstd data .*cut short"),
        ("empty_chunk", r"line 1: .*orch/00000\.jsonl\.zst: corrupt zstd data .*no frame at all"),
        ("bad_branch", r"line 2: .*trainer/00000\.jsonl: trace 't1' has no branch 3"),
        ("duplicate_trace", r"line 4: .*stream/00000\.jsonl: trace 't0' was read before"),
    ],
)
def test_damage_strict_names_file_line_reason_and_lenient_counts_it(tmp_path: Path, kind: str, message: str) -> None:
    root = _damaged(tmp_path, kind)
    with pytest.raises(EventError, match=message):
        _events(root)
    read = read_run_events(root, strict=False)
    list(read)
    assert read.notes.damage.total >= 1
    assert read.notes.damage.summary()


def test_an_episode_the_sink_refuses_is_named_strict_and_set_aside_lenient_as_reading_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The refused rollout's error outlives its line, and the reader's parser is reused for the next ones."""
    w = RunWriter(tmp_path, chunk_lines=2)
    for i in range(4):
        record = episode(f"e{i}", [trace(f"t{i}", [node(3), node(4, [1, 2, 3], parent=0)], arrival=1)], (0, 0))
        if i == 2:
            record["run"]["work"]["policy"]["start"] = "zero"
        w.episode(record)
    w.ship(1, "t0", "t1", "t2", "t3")
    assert main(["replay", str(tmp_path)]) == 2
    chunk = w.traces / "stream" / "00001.jsonl"  # its file and its line there, as damage is named
    refused = f"line 1: {chunk}: rollout 't2': field run.work.policy.start: expected an integer, got 'zero'"
    assert refused in capsys.readouterr().err
    assert main(["replay", str(tmp_path), "--lenient"]) == 0
    assert "3 rollouts shipped, 0 dropped, 0/9 sampled tokens masked, 1 invalid set aside" in capsys.readouterr().err


def test_replay_cli_strict_exits_2_and_lenient_says_what_it_set_aside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _damaged(tmp_path, "not_episode")
    assert main(["replay", str(root)]) == 2
    assert "not an episode record" in capsys.readouterr().err
    assert main(["replay", str(root), "--lenient"]) == 0
    assert "set aside as damaged (--lenient): 1 stream lines that are not an episode record" in capsys.readouterr().err


def test_a_torn_last_line_of_metrics_jsonl_ends_it_and_a_bad_line_before_stops_with_no_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every process appends to metrics.jsonl: a torn last line is a run still being written, read as the
    end and said (replay died with a traceback after writing --metrics-out, report refused the run); a bad
    line before it is one line of error, exit 2, and no output file left (SPEC 9)."""
    w = _simple_run(tmp_path / "run")
    w.metrics({"step": 1, "producer": "orch", "off_policy/max": 0.0})
    metrics = w.file / "metrics.jsonl"
    with metrics.open("a") as out:
        out.write('{"step": 2, "producer": "orch", "off_po')
    rows = tmp_path / "rows.jsonl"
    assert main(["replay", str(tmp_path / "run"), "--metrics-out", str(rows)]) == 0
    err = capsys.readouterr().err
    assert f"{metrics}: a torn last line (line 2), read as the end" in err
    assert "prime-rl's logged orchestrator staleness: 1 of 1 steps equal ours" in err
    assert len(rows.read_text().splitlines()) == 2
    assert main(["report", str(tmp_path / "run"), "-o", str(tmp_path / "r.html")]) == 0
    assert "a torn last line (line 2), read as the end" in (tmp_path / "r.html").read_text()
    capsys.readouterr()
    metrics.write_text('{"step": 1, "off_po\n{"step": 2, "producer": "orch"}\n')
    rows.unlink()
    assert main(["replay", str(tmp_path / "run"), "--metrics-out", str(rows)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"line 1: {metrics}: bad JSON")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html", "run"]  # no output, no temp file


# -- prime-rl's own numbers -----------------------------------------------------------------------------


def test_comparison_with_prime_rl_logged_values_per_episode_frozen_and_mismatch(tmp_path: Path) -> None:
    w = RunWriter(tmp_path)
    two = [
        trace("a0", [node(1), node(2, [0, 1], [-1.0, -1.0], parent=0)], arrival=3),
        trace("a1", [node(1), node(2, [0, 1], [-1.0, -1.0], parent=0)], arrival=3),
    ]
    w.episode(episode("A", two, (0, 2)))  # one episode, two traces: total 2, in flight 2
    w.episode(episode("B", [trace("b0", [node(1), node(2, [0, 1], [-1.0, -1.0], parent=0)], arrival=3)], (2, 2)))
    w.episode(episode("F", [trace("f0", [node(1), node(1, [0], [-1.0], parent=0)], arrival=3)], None))
    w.ship(3, "a0", "a1", "b0", "f0")
    for t in ("a0", "a1", "b0"):
        w.trainer(t, 0, [None, -0.9, -1.1])
    w.trainer("f0", 0, [None, -0.5])
    k3 = [math.expm1(0.1) - 0.1, math.expm1(-0.1) + 0.1, math.expm1(0.5) - 0.5]
    prime_mean = (3 * (k3[0] + k3[1]) + k3[2]) / 7  # per token, the frozen sample's token included
    w.metrics(
        {
            "step": 3,
            "producer": "orch",
            "off_policy/mean": (2 + 0 + 0) / 3,
            "off_policy/max": 2.0,
            "off_policy/dropped": 0,
        }
    )
    w.metrics({"step": 3, "producer": "trainer", "mismatch_kl/all/mean": prime_mean, "mismatch_kl/all/max": k3[2]})
    read = read_run_events(tmp_path)
    shipments = replay(iter(read), StalenessConfig(floor_min_tokens=1))
    rows = {row.legacy_key: row for row in compare_prime_rl(tmp_path, [s.report for s in shipments], notes=read.notes)}
    # ours: per trace, frozen out: (2 + 2 + 0) / 3; prime-rl: per episode, frozen as 0: (2 + 0 + 0) / 3
    assert rows["off_policy/mean"].recomputed == pytest.approx(4 / 3)
    assert rows["off_policy/mean"].legacy_rule == pytest.approx(2 / 3)
    assert rows["off_policy/mean"].status == "prime_rl_rule"
    assert rows["off_policy/max"].status == "match"
    assert rows["off_policy/dropped"].status == "match"
    ours_k3 = 3 * (k3[0] + k3[1]) / 6
    assert rows["mismatch_kl/all/mean"].recomputed == pytest.approx(ours_k3)
    assert rows["mismatch_kl/all/mean"].legacy_rule == pytest.approx(prime_mean)
    assert rows["mismatch_kl/all/mean"].status == "prime_rl_rule"
    assert rows["mismatch_kl/all/max"].legacy_rule == pytest.approx(k3[2])
    text = "\n".join(describe_comparison(list(rows.values())))
    assert "prime-rl averages over episodes, SPEC 9 over traces" in text
    assert "frozen-model episodes as staleness 0" in text
    assert "tokens of frozen-model samples" in text


def test_without_simdjson_the_reader_gives_the_same_events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from staleness_metrics.replay.sources.prime_rl import lazy

    w = _simple_run(tmp_path, chunk_lines=2)
    w.seal()
    fast = _events(tmp_path)
    monkeypatch.setattr(lazy, "simdjson", None)  # orjson reads every line (Python 3.14 and later, so far)
    slow = _events(tmp_path)
    assert _plan(fast) == _plan(slow)
    for a, b in zip(_rollouts(fast).values(), _rollouts(slow).values(), strict=True):
        for x, y in zip(a.samples, b.samples, strict=True):
            np.testing.assert_array_equal(x.mask, y.mask)
            np.testing.assert_array_equal(x.logprobs, y.logprobs)
            np.testing.assert_array_equal(x.trainer_logprobs, y.trainer_logprobs)
