"""What replay, what-if and report read and write, as paths: outputs checked before any replay and named by
their flag (a folder, a missing folder, an input or the other output), outputs that are FIFOs or links to a
pipe written in place, an input that is a pipe named as such, the progress bar on stderr."""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest

from staleness_metrics import html_report
from staleness_metrics.cli import main
from tests.support.examples import EXAMPLES

ROLLOUT = {"id": "a", "dispatch_version": 0, "samples": [{"mask": [1, 1, 1, 1], "token_versions": [0, 0, 2, 2]}]}


def _events(tmp_path: Path) -> Path:
    events = tmp_path / "events.jsonl"
    lines = [{"type": "rollout", "rollout": ROLLOUT}, {"type": "ship", "step": 3}]
    events.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return events


def _run_directory(tmp_path: Path) -> Path:
    _events(tmp_path)
    run = {"format": "staleness-metrics run", "version": 1, "run": "r", "config": {},
           "files": {"events": "events.jsonl"}}  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(run))
    return tmp_path


# (argv, the message after "staleness-metrics COMMAND: "), {d} the test's folder
REFUSED = [
    (["replay", "{d}/events.jsonl", "--metrics-out", "{d}/events.jsonl"],
     "--metrics-out {d}/events.jsonl: would write over the input {d}/events.jsonl"),
    (["report", "{d}/events.jsonl", "-o", "{d}/./events.jsonl"],
     "-o {d}/events.jsonl: would write over the input {d}/events.jsonl"),
    (["replay", "{d}", "--batches-out", "{d}/events.jsonl"],
     "--batches-out {d}/events.jsonl: would write over the input {d}/events.jsonl"),
    (["replay", "{d}/events.jsonl", "--metrics-out", "{d}/out.jsonl", "--batches-out", "{d}/sub/../out.jsonl"],
     "--batches-out {d}/sub/../out.jsonl: would write over --metrics-out {d}/out.jsonl"),
    (["replay", "{d}/events.jsonl", "--metrics-out", "{d}/sub"], "--metrics-out {d}/sub: is a folder"),
    (["report", "{d}/events.jsonl", "-o", "{d}/sub"], "-o {d}/sub: is a folder"),
    (["report", "{d}/events.jsonl", "-o", "{d}/nodir/r.html"], "-o {d}/nodir/r.html: its folder does not exist"),
    (["report", "{d}", "-o", "{d}/run.json"], "-o {d}/run.json: would write over the input {d}/run.json"),
    (["replay", "{d}", "--metrics-out", "{d}/run.json"],
     "--metrics-out {d}/run.json: would write over the input {d}/run.json"),
    (["replay", "{d}/events.jsonl", "--batches-out", "{d}/sub/../run.json"],
     "--batches-out {d}/sub/../run.json: would write over the input {d}/run.json"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "message"), REFUSED)
def test_an_output_that_cannot_be_written_or_would_overwrite_an_input_is_refused_before_the_replay(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    message: str,
) -> None:
    """replay a.jsonl --metrics-out a.jsonl wrote its metrics over its events; --metrics-out X --batches-out X
    kept one of the two; report -o nodir/r.html replayed the whole run first, then named '.r.html.xxxxxxxx';
    report DIR -o DIR/run.json replaced the run file, and every later replay of DIR stopped."""
    run = _run_directory(tmp_path)
    (run / "sub").mkdir()
    before = _contents(run)
    monkeypatch.setattr(html_report, "collect", lambda *_: pytest.fail("the report was drawn before the check"))
    assert main([arg.format(d=run) for arg in argv]) == 2
    assert capsys.readouterr().err == f"staleness-metrics {argv[0]}: {message.format(d=run)}\n"
    assert _contents(run) == before and not (run / "out.jsonl").exists()


def _contents(root: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


# a prime-rl run folder's files (its logged metrics, a traces file, the index of its stream) and a new one
PRIME_RL_OUTPUTS = [
    ("prime-rl-run", ["replay", "--metrics-out"], "metrics.jsonl"),
    ("prime-rl-run", ["replay", "--batches-out"], "rollouts/step_3/train/effective/traces.jsonl"),
    ("prime-rl-run-current", ["report", "-o"], "monitors/file/traces/stream.index.jsonl"),
    ("prime-rl-run-current", ["replay", "--metrics-out"], "staleness.jsonl"),
]


@pytest.mark.parametrize(("example", "command", "output"), PRIME_RL_OUTPUTS)
def test_an_output_inside_a_prime_rl_run_folder_is_refused_before_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], example: str, command: list[str], output: str
) -> None:
    """replay RUN --metrics-out RUN/metrics.jsonl replaced prime-rl's own logged metrics (exit 0), and
    report RUN -o RUN/.../stream.index.jsonl the index every later replay of the run reads."""
    run = shutil.copytree(EXAMPLES / example, tmp_path / example)
    before = _contents(run)
    (subcommand, flag), path = command, run / output
    assert main([subcommand, str(run), flag, str(path)]) == 2
    message = f"{flag} {path}: would write into the input folder {run}"
    assert capsys.readouterr().err == f"staleness-metrics {subcommand}: {message}\n"
    assert _contents(run) == before
    assert main(["replay", str(run)]) == 0  # (the run still replays)


def test_a_fifo_output_is_written_in_place_for_its_reader(tmp_path: Path) -> None:
    events, fifo = _events(tmp_path), tmp_path / "metrics.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    assert main(["replay", str(events), "--metrics-out", str(fifo)]) == 0
    reader.join(timeout=60)
    assert len(got) == 1 and json.loads(got[0])["step"] == 3  # one ship, one metrics line
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="making a device node needs root")
def test_a_null_device_takes_both_outputs_and_stays_a_device(tmp_path: Path) -> None:
    null = tmp_path / "null"  # (made here: never the machine's /dev/null)
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    argv = ["replay", str(_events(tmp_path)), "--metrics-out", str(null), "--batches-out", str(null)]
    assert main(argv) == 0 and stat.S_ISCHR(null.lstat().st_mode)


def test_a_report_through_a_symlink_writes_its_target(tmp_path: Path) -> None:
    events, target, link = _events(tmp_path), tmp_path / "kept.html", tmp_path / "report.html"
    target.write_text("the last report")
    link.symlink_to(target.name)
    assert main(["report", str(events), "-o", str(link)]) == 0
    assert link.is_symlink() and target.read_text().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize("command", ["replay", "what-if", "report"])
def test_a_pipe_as_input_is_named_as_one_not_as_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """`replay <(cat f)` and `cat f | what-if /dev/stdin` said 'no such file or directory'."""
    pipe = tmp_path / "events.fifo"  # (nobody writes it: the commands refuse it before opening it)
    os.mkfifo(pipe)
    assert main([command, str(pipe), *(["-o", str(tmp_path / "r.html")] if command == "report" else [])]) == 2
    err = capsys.readouterr().err
    assert err == f"staleness-metrics {command}: {pipe}: not a regular file (a pipe?); save it to a file first\n"


def test_the_progress_bar_is_drawn_on_stderr_not_on_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--progress is decided by stderr being a terminal, and replay prints nothing on stdout."""
    pytest.importorskip("rich")
    assert main(["replay", str(_events(tmp_path)), "--progress"]) == 0
    captured = capsys.readouterr()
    bar, summary = captured.err.splitlines()
    assert captured.out == "" and bar.startswith("replay ") and summary.startswith("replayed 1 ships:")
