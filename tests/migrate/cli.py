"""Run ``staleness-metrics migrate`` the way a user does: in process through the CLI, or as a process."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from staleness_metrics.commands import COMMANDS
from staleness_metrics.commands import migrate as migrate_command

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"
BEFORE = FIXTURES / "before"
EXPECTED = FIXTURES / "expected"


def registered() -> bool:
    """Whether the console script knows ``migrate`` yet (until then the module's own entry is used)."""
    return migrate_command.register in COMMANDS


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
        if registered():
            from staleness_metrics.cli import main

            code = main(["migrate", *argv])
        else:
            code = migrate_command.main(list(argv))
    except SystemExit as exc:  # argparse usage errors
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return Run(code, captured.out, captured.err)


def migrate_process(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    entry = ["-m", "staleness_metrics.cli", "migrate"] if registered() else ["-m", migrate_command.__name__]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *entry, *argv], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )
