"""The code blocks of the documentation (README.md and every page under docs/) marked as complete examples.

A fenced block right after the line ``<!-- runs -->`` runs as it is, in this environment; after
``<!-- runs: trainers -->`` it needs a trainer's own package and runs in the environment ``.ci/trainers-env``
builds (``tests/trainers``). Other blocks are snippets. The blocks of one page run in order in one directory,
so a later block may read what an earlier one wrote. In a bash block, a line ``#> text`` is output that the
block must print.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- runs(?::\s*(?P<env>[\w-]+))?\s*-->$")
ENVIRONMENTS = {None, "trainers"}
LANGUAGES = {"python", "bash", "sh"}
FENCE = re.compile(r"^```(?P<lang>\w*)\n(?P<code>.*?)^```$", re.M | re.S)

# The README's first command makes a virtualenv and installs the package into it; here the package is
# installed already, so the block runs against this environment's (the rest of the line as written), with a
# short run of the demo on a free port and without the offline W&B run.
REWRITES = {
    "python3 -m venv .venv && .venv/bin/pip install -q -e '.[all]' && .venv/bin/staleness-metrics demo --steps 60": (
        "staleness-metrics demo --steps 6 --speed 0 --prometheus-port 0 --no-wandb"
    ),
}


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence
    language: str
    code: str
    environment: str | None


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def markers(page: Path) -> list[tuple[int, str]]:
    """Every line that starts like a marker, with its number (checked apart, so a typo is an error)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    return [(i + 1, line) for i, line in enumerate(lines) if line.startswith("<!-- runs")]


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.match(before)
        if marker:
            line = text.count("\n", 0, match.start()) + 1
            name = str(page.relative_to(ROOT))
            found.append(Block(name, line, match.group("lang"), match.group("code"), marker.group("env")))
    return found


def runnable(environment: str | None) -> dict[str, list[Block]]:
    """The marked blocks for ``environment``, by page."""
    by_page: dict[str, list[Block]] = {}
    for page in pages():
        for block in blocks(page):
            if block.environment == environment:
                by_page.setdefault(block.page, []).append(block)
    return by_page


def run_page(blocks_of_page: list[Block], directory: Path) -> None:
    """Run a page's blocks in order in ``directory``, with this interpreter and the package of this tree
    (``tests/examples`` reachable from ``directory`` as from the repository's root)."""
    bin_dir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    env.update(
        PATH=os.pathsep.join([bin_dir, env.get("PATH", "")]),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
        WANDB_MODE="offline",
        MPLBACKEND="Agg",
    )
    # Pages name the repository's example runs by their path from its root, as a reader of a clone would.
    examples = directory / "tests" / "examples"
    if not examples.exists():
        examples.parent.mkdir(parents=True, exist_ok=True)
        examples.symlink_to(ROOT / "tests" / "examples", target_is_directory=True)
    for i, block in enumerate(blocks_of_page):
        where = f"{block.page}:{block.line}"
        if block.language == "python":
            script = directory / f"block_{i}.py"
            script.write_text(block.code, encoding="utf-8")
            command = [sys.executable, str(script)]
        else:
            code = block.code
            for written, run in REWRITES.items():
                code = code.replace(written, run)
            # `staleness-metrics` is this environment's console script; run it as a module of this tree
            code = re.sub(r"(?m)^staleness-metrics ", f'"{sys.executable}" -m staleness_metrics.cli ', code)
            script = directory / f"block_{i}.sh"
            script.write_text("set -euo pipefail\n" + code, encoding="utf-8")
            command = ["bash", str(script)]
        done = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=600)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{where}: exit {done.returncode}\n{output[-4000:]}"
        for expected in re.findall(r"(?m)^#> (.*)$", block.code):
            assert expected in output, f"{where}: the block did not print {expected!r}:\n{output[-4000:]}"
