"""The example run in prime-rl's current layout, ``tests/examples/prime-rl-run-current``: the simulated run of
:mod:`tests.support.prime_rl_sim` with :data:`EXAMPLE`, a finished run whose stream and trainer annotations
span several sealed chunks.

Regenerate it (after a change to the writer or the simulation) from the repository root with
``python -m tests.support.prime_rl_example``; ``tests/prime_rl_verifiers/test_example_current.py`` fails while
the committed files differ from what this writes.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from .examples import EXAMPLES
from .prime_rl_sim import SimConfig, SimRun, simulate

EXAMPLE = SimConfig(chunk_bytes=400_000, frame_bytes=64 << 10)
EXAMPLE_DIR = EXAMPLES / "prime-rl-run-current"


def write_example(root: Path) -> SimRun:
    """Write the example run under ``root`` (which must not exist yet)."""
    return simulate(root, EXAMPLE)


def main() -> int:
    if EXAMPLE_DIR.exists():
        shutil.rmtree(EXAMPLE_DIR)
    write_example(EXAMPLE_DIR)
    print(f"wrote {EXAMPLE_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
