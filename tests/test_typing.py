"""The public API as a typed user sees it: the documented usages in ``tests/typing/`` pass ``mypy --strict``
against the package (its ``py.typed``), and run."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from tests.typing.documented_usage import prime_rl_orchestrator, training_loop

ROOT = Path(__file__).resolve().parents[1]


def test_the_documented_usages_pass_mypy_strict(tmp_path: Path) -> None:
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path), "--config-file", "pyproject.toml",  # (strict)
         "tests/typing/documented_usage.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_documented_usages_run() -> None:
    assert training_loop() == [1, 2, 3, 9]
    assert asyncio.run(prime_rl_orchestrator()) == 0
