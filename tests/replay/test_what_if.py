"""``what-if``: the run replayed at each bound; at the run's own bound it equals the replay."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gzip
import json
import math
import multiprocessing
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from staleness_metrics.cli import main
from staleness_metrics.cli.commands import what_if as what_if_command
from staleness_metrics.config import PolicyName, StalenessConfig
from staleness_metrics.demo import Simulation
from staleness_metrics.errors import ConfigError, EventError
from staleness_metrics.html_report import collect
from staleness_metrics.migrate.legacy import RENAMED_SETTING_FLAGS
from staleness_metrics.replay.sources import as_replay_events, detect_and_read, read_xtuner_states
from staleness_metrics.replay.stream import replay
from staleness_metrics.replay.what_if import (
    WhatIfRow,
    format_table,
    parse_bounds,
    run_tally,
    to_json,
    what_if,
    what_if_with_curve,
)
from tests.support.examples import EXAMPLES


def _what_if_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="staleness-metrics")
    what_if_command.register(parser.add_subparsers())
    args = parser.parse_args(["what-if", *argv])
    code = args.func(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _demo_events(steps: int = 25, seed: int = 1) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for _, step in zip(range(steps), Simulation(seed).steps(), strict=False):
        events.extend(step.events())
    return events


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bounds_are_parsed_as_written() -> None:
    assert parse_bounds("0..3") == [0, 1, 2, 3]
    assert parse_bounds(" 2 .. 2 ") == [2]
    assert parse_bounds("4") == [4]
    assert parse_bounds("8,2,4,2") == [2, 4, 8]
    for bad in ("3..1", "a..b", "x", "-1", "1,,2"):
        with pytest.raises(ConfigError):
            parse_bounds(bad)
    # a range is counted before it is built: a huge one is refused at once, not after filling the memory
    with pytest.raises(ConfigError, match="at most 257 bounds at once, got 100000000001"):
        parse_bounds("0..100000000000")


@pytest.mark.parametrize("end", [str(2**63), "9" * 20, "9" * 5000])
def test_a_range_too_long_to_count_is_refused_naming_the_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], end: str
) -> None:
    """0..2**63 was an OverflowError traceback (len of the range); 5000 digits Python's own message."""
    with pytest.raises(ConfigError, match=r"^max_staleness: "):
        parse_bounds(f"0..{end}")
    source = str(_run_directory(tmp_path))
    for command in (["what-if", source], ["report", source, "-o", str(tmp_path / "r.html")]):
        assert main([*command, "--max-staleness", f"0..{end}"]) == 2
        assert capsys.readouterr().err.startswith(f"staleness-metrics {command[0]}: max_staleness: ")


@pytest.mark.parametrize("bounds", [f"0,{2**53 + 1}", f"{2**53 - 1}..{2**53 + 1}"])
def test_every_bound_of_a_list_or_range_is_checked_as_a_config_checks_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bounds: str
) -> None:
    """Only the first bound went through StalenessConfig: a later one past 2**53 was replayed."""
    with pytest.raises(ConfigError, match=r"^max_staleness: bounds must be in 0\.\.9007199254740992"):
        parse_bounds(bounds)
    assert main(["what-if", str(_run_directory(tmp_path)), "--max-staleness", bounds]) == 2
    assert "max_staleness: bounds must be in 0..9007199254740992" in capsys.readouterr().err


def _run_directory(tmp_path: Path) -> Path:
    """A run whose run.json says ``episode`` at bound 1; its one rollout holds tokens of lag 1 and 3."""
    rollout = {"id": "a", "dispatch_version": 0, "samples": [{"mask": [1, 1, 1, 1], "token_versions": [0, 0, 2, 2]}]}
    events = [{"type": "rollout", "rollout": rollout}, {"type": "ship", "step": 3}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    config = {"policy": "episode", "max_staleness": 1}
    run = {
        "format": "staleness-metrics run",
        "version": 1,
        "run": "r",
        "config": config,
        "files": {"events": "events.jsonl"},
    }
    (tmp_path / "run.json").write_text(json.dumps(run))
    return tmp_path


@pytest.mark.parametrize("target", [".", "events.jsonl"])
def test_a_flag_given_wins_over_the_run_directory_even_at_its_default_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    """The run's settings apply where the command line gives none: replay and what-if agree either way."""
    source = str(_run_directory(tmp_path) / target)
    shipped = "replayed 1 ships: {} rollouts shipped, {} dropped, {}/{} sampled tokens masked"
    for flags, (kept, dropped, masked) in (([], (0, 1, 0)), (["--policy", "token"], (1, 0, 2))):
        assert main(["replay", source, *flags]) == 0
        assert shipped.format(kept, dropped, masked, 4 * kept) in capsys.readouterr().err
        code, out, _ = _what_if_cli(capsys, source, "--max-staleness", "1", "--json", *flags)
        (row,) = json.loads(out)
        assert code == 0 and (row["rollouts_shipped"], row["rollouts_dropped"], row["tokens_masked"]) == (
            kept,
            dropped,
            masked,
        )
    assert main(["report", source, "--policy", "token", "--bound", "8", "-o", str(tmp_path / "r.html")]) == 0
    assert "policy: token · max_staleness: 8" in (tmp_path / "r.html").read_text()


def _with_config(run: Path, **config: Any) -> Path:
    data = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**data, "config": config}))
    return run


def test_what_if_replays_fixed_bounds_on_a_run_that_adapted_its_bound(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A demo made with --adapt-every: `what-if DIR --max-staleness 0..10` (docs/getting-started.md) said
    'max_staleness: 0 is outside adapt_low..adapt_high 1..16'; each row judges one fixed bound."""
    run = _with_config(_run_directory(tmp_path), policy="token", max_staleness=8, adapt_every=3)
    code, out, err = _what_if_cli(capsys, str(run), "--max-staleness", "0..10", "--json")
    assert code == 0, err
    assert [row["max_staleness"] for row in json.loads(out)] == list(range(11))
    assert [row["tokens_masked"] for row in json.loads(out)][:3] == [2, 2, 0]  # its tokens of lag 2
    _with_config(run, policy="token", max_staleness=8)  # the same run, its bound fixed: the same rows
    assert _what_if_cli(capsys, str(run), "--max-staleness", "0..10", "--json")[1] == out


@pytest.mark.parametrize(
    ("config", "command"),
    [
        ({"policy": "xtuner", "max_staleness": 1, "sync_interval": 2, "max_token_staleness": 3}, "replay"),
        ({"policy": "xtuner", "max_staleness": 1, "sync_interval": 2, "retry_expired": True}, "what-if"),
        ({"policy": "token", "max_staleness": 1, "adapt_every": 3, "adapt_high": 4}, "report"),
    ],
)
def test_a_policy_given_drops_the_settings_only_the_runs_policy_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, Any], command: str
) -> None:
    """`replay DIR --policy token` on an xtuner run said 'max_token_staleness: only the 'xtuner' policy
    takes it'; `report DIR --policy episode` on an adapting run, 'adapt_every: only the 'token' policy'."""
    run = _with_config(_run_directory(tmp_path), **config)
    policy = "episode" if config["policy"] == "token" else "token"
    out = ["-o", str(tmp_path / "r.html")] if command == "report" else ["--max-staleness", "1"] * (command == "what-if")
    assert main([command, str(run), "--policy", policy, *out]) == 0, capsys.readouterr().err
    if command == "report":
        assert f"policy: {policy} · max_staleness: 1" in (tmp_path / "r.html").read_text()
    assert main([command, str(run), *out]) == 0  # (the run's own settings still apply without the flag)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["replay", "{run}", "--max-staleness", "-1"], "--max-staleness: must be in 0..9007199254740992, got -1"),
        (["replay", "{run}", "--floor-min-tokens", "0"], "--floor-min-tokens: must be in 1..9007199254740992, got 0"),
        (["report", "{run}", "--bound", "-1"], "--bound: must be in 0..9007199254740992, got -1"),
        (["replay", "{run}", "--max-staleness", "0"],
         "--max-staleness: 0 is outside adapt_low..adapt_high 1..16, where the adaptive bound starts"),
        (["replay", "{run}", "--policy", "episode", "--adapt-every", "2"],
         "--adapt-every: only the 'token' policy adapts its bound (policy is 'episode')"),
        (["replay", "{run}", "--adapt-high", "4"],
         "{run}/run.json: config: max_staleness: 8 is outside adapt_low..adapt_high 1..4, where the adaptive "
         "bound starts"),
    ],
)  # fmt: skip
def test_a_bad_flag_is_named_by_its_flag_not_blamed_on_run_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    run = _with_config(_run_directory(tmp_path), policy="token", max_staleness=8, adapt_every=3)
    assert main([arg.format(run=run) for arg in argv]) == 2
    assert capsys.readouterr().err == f"staleness-metrics {argv[0]}: {message.format(run=run)}\n"


@pytest.mark.parametrize("command", ["replay", "what-if", "report", "demo"])
def test_a_renamed_settings_flag_is_refused_naming_the_new_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """SPEC 7: --max-off-policy-steps 8 was argparse's "unrecognized arguments", not naming the new flag."""
    source = [] if command == "demo" else [str(_run_directory(tmp_path))]
    for old, new in RENAMED_SETTING_FLAGS.items():
        for given in ([f"--{old}", "8"], [f"--{old}=8"]):
            with pytest.raises(SystemExit) as exited:
                main([command, *source, *given])
            assert exited.value.code == 2
            assert f"staleness-metrics {command}: error: --{old}: renamed to --{new}" in capsys.readouterr().err


def test_a_bad_setting_of_run_json_is_still_named_there(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _with_config(_run_directory(tmp_path), floor_min_tokens=0)
    assert main(["replay", str(run), "--max-staleness", "3"]) == 2
    err = capsys.readouterr().err
    assert err == f"staleness-metrics replay: {run}/run.json: config: floor_min_tokens: must be in 1..{2**53}, got 0\n"


@pytest.mark.parametrize("command", ["replay", "what-if", "report"])
@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"max_off_policy_steps": 1}, "max_off_policy_steps: renamed to 'max_staleness'; run `staleness-metrics "
         "migrate --write PATH` to update config files"),
        ({"max_stalenes": 1}, "max_stalenes: unknown setting (known: "),
    ],
)  # fmt: skip
def test_an_unknown_or_renamed_setting_of_run_json_is_named_there_not_ignored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, config: dict[str, Any], reason: str
) -> None:
    """{"max_off_policy_steps": 1} or a misspelt {"max_stalenes": 1} was left out: the run replayed at 8."""
    run = _with_config(_run_directory(tmp_path), **config)
    assert main([command, str(run), *(["-o", str(tmp_path / "r.html")] if command == "report" else [])]) == 2
    assert capsys.readouterr().err.startswith(f"staleness-metrics {command}: {run}/run.json: config: {reason}")
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("version", [2, "1", True, None])
def test_a_run_file_of_another_version_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], version: object
) -> None:
    """A later release's run.json was read as version 1's, whatever its layout meant."""
    run = _run_directory(tmp_path)
    (run / "run.json").write_text(json.dumps({**json.loads((run / "run.json").read_text()), "version": version}))
    assert main(["replay", str(run)]) == 2
    reads = "this staleness-metrics reads run files of version 1"
    assert capsys.readouterr().err == f"staleness-metrics replay: {run}/run.json: version: {version!r}: {reads}\n"


@pytest.mark.parametrize("encode", [gzip.compress, lambda data: b"\xef\xbb\xbf" + data], ids=["gzip", "bom"])
def test_a_run_directory_reads_its_stream_as_replay_does_compressed_or_with_a_bom(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], encode: Callable[[bytes], bytes]
) -> None:
    """replay, what-if and report read a run directory's events as replay reads a stream, its trainer
    log-probabilities joined (what-if and report stopped: 'utf-8' codec can't decode byte 0x8b; Unexpected
    UTF-8 BOM)."""
    outputs = []
    for name in ("plain", "encoded"):
        (tmp_path / name).mkdir()
        run = _run_directory(tmp_path / name)
        events = run / "events.jsonl"
        lines = [json.loads(line) for line in events.read_text().splitlines()]
        lines[0]["rollout"]["samples"][0]["logprobs"] = [-0.5] * 4
        events.write_bytes("".join(json.dumps(e) + "\n" for e in lines).encode())
        if name == "encoded":
            events.write_bytes(encode(events.read_bytes()))
        (run / "logprobs.jsonl").write_text(json.dumps({"id": "a", "trainer_logprobs": [[-0.4] * 4]}) + "\n")
        config = json.loads((run / "run.json").read_text())
        config["files"]["trainer_logprobs"] = "logprobs.jsonl"
        (run / "run.json").write_text(json.dumps(config))
        assert main(["replay", str(run), "--metrics-out", str(tmp_path / f"{name}.jsonl")]) == 0
        code, out, _ = _what_if_cli(capsys, str(run), "--max-staleness", "0..3", "--json")
        assert code == 0 and json.loads(out)[-1]["trained_k3"] is not None  # (the costs joined)
        report = collect(run, StalenessConfig(), [0, 1])
        outputs.append(((tmp_path / f"{name}.jsonl").read_text(), out, report.rows, report.what_if))
    assert outputs[0] == outputs[1]


def _limit_file_size() -> None:  # (a full disk, for a child process)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))


def test_a_report_that_cannot_be_written_whole_leaves_the_last_one_whole(tmp_path: Path) -> None:
    source, page = str(_run_directory(tmp_path)), tmp_path / "report.html"
    assert main(["report", source, "-o", str(page)]) == 0
    before = page.read_bytes()
    assert len(before) > 8192
    command = [sys.executable, "-m", "staleness_metrics.cli", "report", source, "-o", str(page), "--title", "again"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(command, preexec_fn=_limit_file_size, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "File too large" in done.stderr
    assert page.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "events.jsonl",
        "report.html",
        "run.json",
    ]


def test_a_report_at_a_bound_above_256_draws_the_257_bounds_up_to_it(tmp_path: Path) -> None:
    source, page = str(_run_directory(tmp_path)), tmp_path / "report.html"
    assert main(["report", source, "--bound", "300", "-o", str(page)]) == 0  # (0..300 is over the limit)
    assert "policy: episode · max_staleness: 300" in page.read_text()


def test_what_if_refuses_an_adaptive_bound_it_would_not_apply(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _what_if_cli(capsys, str(EXAMPLES / "xtuner-states.jsonl"), "--adapt-every", "2")
    assert code == 2 and "--adapt-every: what-if replays each bound fixed" in err


def _sampled_per_ship(events: list[dict[str, Any]], lines: list[dict[str, Any]]) -> list[int]:
    """Sampled positions (as they arrived) of each ship's live samples, from the original events."""
    original = {e["rollout"]["id"]: e["rollout"] for e in events if e["type"] == "rollout"}
    dropped = {(i, k) for line in lines for i, k in line["dropped_samples"]}
    return [
        sum(
            sum(sample["mask"])
            for r in line["shipped"]
            if original[r["id"]].get("source") != "frozen"
            for k, sample in enumerate(original[r["id"]]["samples"])
            if (r["id"], k) not in dropped
        )
        for line in lines
    ]


@pytest.mark.parametrize(
    ("run", "policy", "bound"),
    [
        ("prime-rl-run", "episode", 3),
        ("prime-rl-run", "token", 5),
        ("xtuner-states.jsonl", "token", 1),
        ("demo", "token", 2),
    ],
)
def test_what_if_at_the_replayed_bound_equals_the_replay(
    tmp_path: Path, run: str, policy: PolicyName, bound: int
) -> None:
    source = EXAMPLES / run
    if run == "demo":
        source = tmp_path / "events.jsonl"
        source.write_text("".join(json.dumps(e) + "\n" for e in _demo_events(steps=15)))
    metrics, batches = tmp_path / "metrics.jsonl", tmp_path / "batches.jsonl"
    argv = ["replay", str(source), "--policy", policy, "--max-staleness", str(bound)]
    assert main([*argv, "--metrics-out", str(metrics), "--batches-out", str(batches)]) == 0
    rows, lines = _jsonl(metrics), _jsonl(batches)
    (mine,) = what_if(source, [bound], StalenessConfig(policy=policy))
    assert mine.max_staleness == bound
    assert mine.rollouts_dropped == sum(r["staleness/rollout/dropped"] for r in rows) > 0
    assert mine.samples_dropped == sum(r["staleness/sample/dropped"] for r in rows)
    assert mine.samples_dropped == sum(len(line["dropped_samples"]) for line in lines)
    assert mine.rollouts_held == sum(r["staleness/rollout/held"] for r in rows)
    # The replay's per-ship masked ratios, weighted by each ship's sampled tokens, give the run's figures.
    sampled = _sampled_per_ship(list(detect_and_read(source, max_staleness=bound)), lines)
    masked = sum(r.get("staleness/token/masked", 0.0) * n for r, n in zip(rows, sampled, strict=True))
    assert mine.tokens_sampled == sum(sampled)
    assert mine.tokens_masked == round(masked)
    assert mine.tokens_kept == sum(sampled) - round(masked)


def test_the_xtuner_example_at_its_bound_matches_the_one_ship_the_replay_reports(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    argv = [
        "replay",
        str(EXAMPLES / "xtuner-states.jsonl"),
        "--max-staleness",
        "1",
        "--metrics-out",
        str(metrics),
    ]
    assert main(argv) == 0
    (row,) = _jsonl(metrics)
    (mine,) = what_if(EXAMPLES / "xtuner-states.jsonl", [1])
    assert mine.masked_ratio == pytest.approx(row["staleness/token/masked"])
    assert mine.rollouts_dropped == row["staleness/rollout/dropped"] == 2
    assert mine.tokens_kept == mine.tokens_sampled - mine.tokens_masked


def test_a_looser_bound_never_drops_or_masks_more_on_the_demo_run() -> None:
    events = _demo_events(steps=12)
    kept = copy.deepcopy(events)
    rows = what_if(events, range(11))
    assert events == kept  # the caller's event dicts are not masked in place
    dropped = [r.rollouts_dropped for r in rows]
    masked = [r.tokens_masked + r.tokens_dropped for r in rows]
    assert dropped == sorted(dropped, reverse=True) and dropped[0] > 0
    assert masked == sorted(masked, reverse=True) and masked[0] > masked[-1]
    # Each row is the replay at that bound.
    for row in (rows[1], rows[5]):
        shipments = replay(as_replay_events(events), StalenessConfig(max_staleness=row.max_staleness))
        tally = run_tally(s.report for s in shipments)
        assert (row.tokens_sampled, row.tokens_masked, row.rollouts_dropped) == (
            tally.tokens_sampled,
            tally.tokens_masked,
            tally.rollouts_dropped,
        )


def test_the_command_prints_a_table_or_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _what_if_cli(capsys, str(EXAMPLES / "xtuner-states.jsonl"), "--max-staleness", "0..3")
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].split()[0] == "max_staleness" and len(lines) == 2 + 4
    assert [line.split()[0] for line in lines[2:]] == ["0", "1", "2", "3"]
    code, out, _ = _what_if_cli(
        capsys, str(EXAMPLES / "xtuner-states.jsonl"), "--max-staleness", "1", "--policy", "xtuner", "--json"
    )
    assert code == 0
    (row,) = json.loads(out)
    (expected,) = what_if(EXAMPLES / "xtuner-states.jsonl", [1], StalenessConfig(policy="xtuner"))
    assert row == expected.as_dict()


def test_the_command_explains_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = _what_if_cli(capsys, str(EXAMPLES / "xtuner-states.jsonl"), "--max-staleness", "5..2")
    assert code == 2 and "start is above the end" in err
    code, _, err = _what_if_cli(capsys, str(tmp_path / "missing.jsonl"))
    assert code == 2 and "no such file" in err
    states = read_xtuner_states(EXAMPLES / "xtuner-states.jsonl").events
    states[0]["rollout"]["samples"][0]["mask"] = [2]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(e) + "\n" for e in states))
    code, _, err = _what_if_cli(capsys, str(bad))
    assert code == 2 and "line 1" in err and "rollout '1'" in err


def _rollout_line(rollout_id: str, dispatch_version: int) -> str:
    rollout = {"id": rollout_id, "dispatch_version": dispatch_version, "samples": [{"mask": [1] * 50}]}
    return json.dumps({"type": "rollout", "rollout": rollout})


def _write_lines(path: Path, lines: list[str], cut_short: bool) -> None:
    data = "".join(line + "\n" for line in lines).encode()
    compressed = gzip.compress(data)
    path.write_bytes(compressed[: len(compressed) * 9 // 10] if cut_short else data)  # (its last tenth cut)


@pytest.mark.parametrize("cut_short", [False, True], ids=["plain", "gzip-cut-short"])
@pytest.mark.parametrize("step_down", [True, False], ids=["step-down", "no-step-down"])
def test_what_if_names_the_first_error_in_stream_order_as_replay_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cut_short: bool, step_down: bool
) -> None:
    """docs/replay.md: a rollout a ship refuses at line 2 is the error, not a step that goes down at line 900
    nor a gzip file cut short after it. what-if read the whole stream first and named the later fault."""
    lines = [_rollout_line("fut", 5), json.dumps({"type": "ship", "step": 3})]  # line 2 refuses 'fut'
    lines += [_rollout_line(f"r{i}", 0) for i in range(897)]
    lines += [json.dumps({"type": "ship", "step": 1 if step_down else 4})]  # line 900
    lines += [_rollout_line(f"z{i}", 0) for i in range(3000)]
    stream = tmp_path / ("events.jsonl.gz" if cut_short else "events.jsonl")
    _write_lines(stream, lines, cut_short)
    assert main(["replay", str(stream)]) == 2
    replayed = capsys.readouterr().err
    assert replayed.startswith("line 2: rollout 'fut': field dispatch_version: version 5 is above")
    assert _what_if_cli(capsys, str(stream), "--max-staleness", "0..2")[::2] == (2, replayed)
    if cut_short or step_down:  # without the rollout 'fut', the later fault is the error
        lines[:2] = [json.dumps({"type": "ship", "step": 3}), json.dumps({"type": "ship", "step": 3})]
        _write_lines(stream, lines, cut_short)
        code, _, err = _what_if_cli(capsys, str(stream), "--max-staleness", "0..2")
        later = "line 900: step 1 is below an earlier step 3" if step_down else "gzip data damaged or cut short"
        assert code == 2 and later in err


@pytest.mark.parametrize("policy", ["token", "episode", "group", "xtuner"])
def test_nine_bounds_from_one_parse_equal_nine_separate_replays(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """what-if parses the stream once and runs every bound over the parsed records; each row must equal
    a replay from scratch at that bound (random streams, lenient ones with invalid rollouts too). Bounds
    above the first that removed nothing are not replayed: their rows must equal the separate replays too."""
    from staleness_metrics.replay import what_if as what_if_module
    from tests.reference.streams import random_stream

    sinks: list[int] = []

    class CountedSink(what_if_module.Sink):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            sinks.append(args[0].max_staleness)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(what_if_module, "Sink", CountedSink)
    compared = shared = 0
    for seed in range(12):
        lenient = seed % 2 == 0  # invalid rollouts set aside in half the streams
        replay_config, events = random_stream(seed, policy, lenient=lenient, defects=2 if lenient else 0)
        options = replay_config.reference_options()
        # Every bound 0..8 from the start: the adaptive bound (SPEC 14) would move away from some of them.
        kept = {k: v for k, v in options.items() if k != "lenient" and not k.startswith("adapt_")}
        base = StalenessConfig(**kept, strict=not lenient)
        separate = []
        try:
            for bound in range(9):
                shipments = replay(as_replay_events(events), dataclasses.replace(base, max_staleness=bound))
                # The cost of what each bound trains (SPEC 11) must match too: the streams carry trainer log-probs.
                costs = [c for s in shipments if (c := s.trained_sums(base.mismatch_band)) is not None]
                cost = sum(costs[1:], costs[0]) if costs else None
                separate.append(
                    WhatIfRow.from_tally(bound, run_tally(s.report for s in shipments), cost, base.floor_min_tokens)
                )
        except EventError:
            with pytest.raises(EventError):
                what_if(events, range(9), base)
            continue
        # The run's curve judges each row besides (tests below); the replayed figures are the separate replays'.
        sinks.clear()
        judged = what_if_with_curve(events, range(9), base, processes=1).rows
        shared += len(set(range(9)) - set(sinks))
        unjudged = [
            dataclasses.replace(r, excess_at_bound=None, within_budget=None, suggested=None, suggested_bound=None)
            for r in judged
        ]
        assert unjudged == separate, f"seed {seed}"
        compared += 1
    assert compared >= 10
    assert shared > 0, "every bound was replayed: the rows shared by larger bounds were never compared"


def _k3(d: float) -> float:
    return math.exp(d) - 1 - d


# Step 5 trains version 4. One rollout per lag, two tokens each with d = +x and -x (trainer minus sampler),
# so the mean k3 of lag l is (k3(x) + k3(-x)) / 2 for its x: lag 1 is cheaper than lag 0 (noise), and lag 3
# cheaper than lag 2 (a violation the isotonic fit pools).
_SPREAD = {0: 0.1, 1: 0.05, 2: 0.2, 3: 0.15, 4: 0.3}
_CURVE_EVENTS: list[dict[str, Any]] = [
    *(
        {"type": "rollout", "rollout": {"id": f"lag{lag}", "dispatch_version": 4 - lag, "samples": [{
            "mask": [1, 1], "token_versions": [4 - lag, 4 - lag], "logprobs": [-1.0, -1.0],
            "trainer_logprobs": [-1.0 + x, -1.0 - x]}]}}
        for lag, x in _SPREAD.items()
    ),
    {"type": "ship", "step": 5},
]  # fmt: skip


def _mean_k3(lag: int) -> float:
    return (_k3(_SPREAD[lag]) + _k3(-_SPREAD[lag])) / 2


def test_each_bound_is_judged_by_the_runs_curve_computed_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    config = StalenessConfig(floor_min_tokens=2)
    floor = _mean_k3(0)
    raw = {lag: _mean_k3(lag) - floor for lag in (1, 2, 3, 4)}
    pooled = (raw[2] + raw[3]) / 2  # equal token counts: the violators' plain mean
    fitted = {1: raw[1], 2: pooled, 3: pooled, 4: raw[4]}
    assert raw[1] < 0 < pooled <= raw[2] and raw[3] < raw[2]

    # Budget = the floor: only lag 1 is within it; bound 0 trains only lag 0, below the curve's first
    # point, which is within the budget (more lag cannot make a token cheaper).
    result = what_if_with_curve(_CURVE_EVENTS, range(5), config)
    assert result.curve is not None
    assert (result.curve.floor.value, result.curve.floor.source, result.curve.budget) == (
        pytest.approx(floor),
        "lag0",
        pytest.approx(floor),
    )
    assert result.curve.curve.lags == (1, 2, 3, 4)
    assert list(result.curve.curve.fitted) == pytest.approx([fitted[lag] for lag in (1, 2, 3, 4)])
    assert (result.curve.suggested, result.curve.crossed) == (1, True)
    rows = {row.max_staleness: row for row in result.rows}
    assert rows[0].excess_at_bound is None and rows[0].within_budget is True
    for bound in (1, 2, 3, 4):
        assert rows[bound].excess_at_bound == pytest.approx(fitted[bound])
    assert [rows[b].within_budget for b in range(5)] == [True, True, False, False, False]
    assert [rows[b].suggested for b in range(5)] == [False, True, False, False, False]

    # A budget set between the pooled lags 2-3 and lag 4: the suggestion moves to 3.
    budget = (pooled + raw[4]) / 2
    result = what_if_with_curve(_CURVE_EVENTS, range(5), dataclasses.replace(config, mismatch_budget=budget))
    assert result.curve is not None and result.curve.budget == budget
    assert (result.curve.suggested, result.curve.crossed) == (3, True)
    assert [row.within_budget for row in result.rows] == [True, True, True, True, False]
    assert [row.suggested for row in result.rows] == [False, False, False, True, False]

    # --json carries both per bound; the table marks the suggested bound.
    as_json = {row["max_staleness"]: row for row in json.loads(to_json(result.rows))}
    assert as_json[3]["suggested"] is True and as_json[3]["within_budget"] is True
    assert as_json[4]["within_budget"] is False and as_json[4]["excess_at_bound"] == pytest.approx(raw[4])
    lines = format_table(result.rows, result.curve).splitlines()
    assert lines[0].split()[-5:] == ["excess", "at", "bound", "within", "budget"]
    assert lines[2 + 3].endswith("yes <- suggested") and lines[2 + 4].endswith("no")
    assert "suggested bound 3 (the largest lag within the budget)" in lines[-1]


def test_a_budget_never_crossed_says_a_looser_bound_may_be_as_good() -> None:
    config = StalenessConfig(floor_min_tokens=2, mismatch_budget=1.0)
    result = what_if_with_curve(_CURVE_EVENTS, range(3), config)
    assert result.curve is not None and (result.curve.suggested, result.curve.crossed) == (4, False)
    assert [row.within_budget for row in result.rows] == [True, True, True]
    assert not any(row.suggested for row in result.rows)  # 4 is outside the range tried...
    assert {json.loads(to_json(result.rows))[0]["suggested_bound"]} == {4}  # ...and --json still says it
    assert "a looser bound may be as good" in format_table(result.rows, result.curve)


def test_without_enough_tokens_for_a_floor_no_bound_is_judged() -> None:
    result = what_if_with_curve(_CURVE_EVENTS, range(3), StalenessConfig())  # floor_min_tokens 1000
    assert result.curve is None
    assert all((r.excess_at_bound, r.within_budget, r.suggested) == (None, None, None) for r in result.rows)


def _two_processes_against_one(policy: str) -> tuple[int, int]:
    """Every seed's what-if on two processes against one, in a process of its own: what-if forks only where
    no other thread runs, and a test process may hold threads of earlier tests. Returns (forks, raised)."""
    from tests.reference.streams import random_stream

    real_fork, forks = os.fork, []

    def counted_fork() -> int:
        pid = real_fork()
        if pid:  # the parent's count: the child exits without returning here
            forks.append(pid)
        return pid

    os.fork = counted_fork
    raised = 0
    for seed in range(8):
        lenient = seed % 2 == 0
        replay_config, events = random_stream(seed, policy, lenient=lenient, defects=2 if lenient else 0)
        options = replay_config.reference_options()
        kept = {k: v for k, v in options.items() if k != "lenient" and not k.startswith("adapt_")}
        base = StalenessConfig(**{**kept, "floor_min_tokens": 2}, strict=not lenient)
        try:
            alone = what_if_with_curve(events, range(9), base, processes=1)
        except EventError as error:
            with pytest.raises(EventError) as forked:
                what_if_with_curve(events, range(9), base, processes=2)
            assert str(forked.value) == str(error)
            raised += 1
            continue
        # Bounds that each drop something leave the curve to the replay that removes nothing, run beside them.
        for bounds in (range(9), range(2)):
            assert what_if_with_curve(events, bounds, base, processes=2) == what_if_with_curve(
                events, bounds, base, processes=1
            ), f"seed {seed}"
        assert alone.rows == what_if_with_curve(events, range(9), base, processes=2).rows
    return len(forks), raised


@pytest.mark.parametrize("policy", ["token", "group"])
def test_bounds_replayed_on_two_processes_give_what_one_process_gives(policy: str) -> None:
    """Half the bounds replayed in a forked process: the same rows, the same curve, the same error raised."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        forks, raised = pool.submit(_two_processes_against_one, policy).result()
    assert raised < 8  # rows were compared, not only errors
    assert forks, "processes=2 never forked: the comparison was one process against itself"


def test_a_run_without_trainer_logprobs_has_no_curve_on_any_process_count() -> None:
    events = [e for e in _CURVE_EVENTS if e["type"] == "ship"] + [
        {"type": "rollout", "rollout": {**copy.deepcopy(e["rollout"]), "samples": [
            {k: v for k, v in s.items() if k != "trainer_logprobs"} for s in e["rollout"]["samples"]]}}
        for e in _CURVE_EVENTS if e["type"] == "rollout"
    ]  # fmt: skip
    events = events[1:] + events[:1]  # the rollouts, then the ship
    config = StalenessConfig(floor_min_tokens=2)
    for processes in (1, 2):
        result = what_if_with_curve(events, range(3), config, processes=processes)
        assert result.curve is None
        assert [r.rollouts_shipped for r in result.rows] == [1, 2, 3]
        assert all(r.trained_covered is None for r in result.rows)


def test_an_invalid_rollout_in_strict_mode_is_named_alike_on_two_processes() -> None:
    events: list[dict[str, Any]] = [
        {"type": "rollout", "rollout": {"id": "a", "dispatch_version": 0, "samples": [{"mask": [1, 1]}]}},
        {"type": "rollout", "rollout": {"id": "b", "dispatch_version": 0, "samples": [{"mask": [1, "x"]}]}},
        {"type": "ship", "step": 1},
    ]
    messages = []
    for processes in (1, 2):
        with pytest.raises(EventError) as error:
            what_if_with_curve(events, range(4), StalenessConfig(strict=True), processes=processes)
        messages.append(str(error.value))
    assert messages[0] == messages[1] and "line 2" in messages[0] and "'b'" in messages[0]
