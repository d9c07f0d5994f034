"""The lines of the AReaL and TRL pages of the docs are the ones tests/trainers runs, word for word (in order).

The pages' complete examples (blocks marked ``<!-- runs... -->``) run on their own (test_docs_examples.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def snippets(page: str) -> list[list[str]]:
    """The python snippets of ``docs/trainers/<page>.md`` (not the complete examples), as stripped non-empty
    lines."""
    text = (ROOT / "docs" / "trainers" / f"{page}.md").read_text(encoding="utf-8")
    blocks = re.findall(r"(?:^|\n)([^\n]*)\n```python\n(.*?)```", text, flags=re.S)
    return [
        [line.strip() for line in block.splitlines() if line.strip()]
        for before, block in blocks
        if not before.startswith("<!-- runs")
    ]


def imported(lines: list[str]) -> set[tuple[str, str]]:
    """(module, name as bound) of every ``from M import a, b as c`` / ``import M as n`` line."""
    out = set()
    for line in lines:
        found = re.match(r"from (\S+) import \(?([^)]*)\)?$", line)
        if found:
            for name in found.group(2).split(","):
                if name.strip():
                    out.add((found.group(1), name.strip()))
        elif line.startswith("import "):
            out.add(("", line.removeprefix("import ").strip()))
    return out


def contains_in_order(haystack: list[str], needle: list[str]) -> bool:
    return any(haystack[i : i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


@pytest.mark.parametrize(("trainer", "test_file"), [("areal", "test_areal.py"), ("trl", "test_trl.py")])
def test_every_page_snippet_is_run_by_the_trainer_tests(trainer: str, test_file: str) -> None:
    blocks = snippets(trainer)
    assert len(blocks) >= 2, f"{trainer}: expected the call and the cost-family lines on the page"
    source = (ROOT / "tests" / "trainers" / test_file).read_text(encoding="utf-8").splitlines()
    tested = [line.split("  # ")[0].strip() for line in source]  # a trailing comment is not part of the line
    tested = [line for line in tested if line]
    for block in blocks:
        imports = [line for line in block if line.startswith(("from ", "import "))]
        lines = [line for line in block if line not in imports]
        missing = imported(imports) - imported(tested)
        assert not missing, f"{trainer}: page imports not imported by {test_file}: {sorted(missing)}"
        assert contains_in_order(tested, lines), f"{trainer}: page lines not in {test_file}:\n" + "\n".join(lines)
