"""The example runs the tests read, kept in the repository (tests/examples) so a fresh checkout has them:
``prime-rl-run`` (a prime-rl run directory with its logged ``metrics.jsonl``) and ``xtuner-states.jsonl``."""

from __future__ import annotations

from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
