"""Run ``staleness-metrics migrate`` the way a user does: in process through the CLI, or as a process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from staleness_metrics.cli import main

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"
BEFORE = FIXTURES / "before"
EXPECTED = FIXTURES / "expected"


@dataclass
class Run:
    code: int
    out: str
    err: str

    @property
    def lines(self) -> list[str]:
        return self.out.splitlines()


def migrate(capsys: pytest.CaptureFixture[str], *argv: str) -> Run:
    capsys.readouterr()
    try:
        code = main(["migrate", *argv])
    except SystemExit as exc:  # argparse usage errors
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return Run(code, captured.out, captured.err)


def migrate_process(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    entry = ["-m", "staleness_metrics.cli", "migrate"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *entry, *argv], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )


_HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+\d+(?:,(\d+))? @@")


def apply_patch(diff: str, strip: str = "a/") -> None:
    """Apply a unified diff to the files it names, strictly: every context and removed line must match.

    Used where GNU ``patch`` is not installed, so the ``--diff`` check never has to be skipped.
    """
    lines = diff.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        assert lines[i].startswith("--- " + strip) and lines[i + 1].startswith("+++ "), lines[i : i + 2]
        path = Path(lines[i][4 + len(strip) :].rstrip("\n"))
        old = path.read_text(encoding="utf-8").splitlines(keepends=True)
        new: list[str] = []
        at = 0
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            match = _HUNK.match(lines[i])
            assert match, lines[i]
            old_count = int(match.group(2) or 1)
            new_count = int(match.group(3) or 1)
            start = int(match.group(1)) - (1 if old_count else 0)
            assert start >= at, f"{path}: overlapping hunks"
            new += old[at:start]
            at = start
            i += 1
            while old_count or new_count:
                tag, text = lines[i][0], lines[i][1:]
                # "\ No newline at end of file" after a line: that line has no newline
                if i + 1 < len(lines) and lines[i + 1].startswith("\\"):
                    text = text.removesuffix("\n")
                if tag in " -":
                    assert at < len(old) and old[at] == text, f"{path}:{at + 1}: patch does not apply"
                    at += 1
                    old_count -= 1
                if tag in " +":
                    new.append(text)
                    new_count -= 1
                assert tag in " -+" and old_count >= 0 and new_count >= 0, f"{path}: malformed hunk"
                i += 1
                while i < len(lines) and lines[i].startswith("\\"):
                    i += 1
        new += old[at:]
        path.write_text("".join(new), encoding="utf-8")
