"""Every code block of the documentation marked as a complete example runs (tests/support/doc_blocks.py says
how blocks are marked); those that need a trainer's package run in tests/trainers/test_docs_examples.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.doc_blocks import (
    ENVIRONMENTS,
    LANGUAGES,
    MARKER,
    REWRITES,
    blocks,
    markers,
    pages,
    run_page,
    runnable,
)

HERE = runnable(None)


def test_every_marker_is_well_formed_and_marks_a_block_that_can_run() -> None:
    for page in pages():
        marked = {block.line - 1 for block in blocks(page)}
        for line, text in markers(page):
            found = MARKER.match(text)
            assert found and found.group("env") in ENVIRONMENTS, f"{page}:{line}: unknown marker {text!r}"
            assert line in marked, f"{page}:{line}: the marker is not right before a fenced block"
        for block in blocks(page):
            assert block.language in LANGUAGES, f"{block.page}:{block.line}: cannot run a {block.language!r} block"


def test_the_pages_have_runnable_examples_and_each_rewrite_still_applies() -> None:
    assert {"README.md", "docs/getting-started.md", "docs/bound.md", "docs/checkpoints.md"} <= set(HERE)
    assert len([page for page in HERE if page.startswith("docs/trainers/")]) >= 2
    code = [block.code for page in HERE.values() for block in page]
    for written in REWRITES:
        assert any(written in text for text in code), f"no block runs {written!r} any more: drop the rewrite"


@pytest.mark.parametrize("page", sorted(HERE))
def test_the_page_examples_run(page: str, tmp_path: Path) -> None:
    run_page(HERE[page], tmp_path)


def test_the_replay_pages_report_draws_the_run_at_the_bound_its_text_names(tmp_path: Path) -> None:
    """docs/replay.md: "The run at the bound of 4 ... and what every bound from 0 to 8 would have kept"."""
    run_page(HERE["docs/replay.md"], tmp_path)
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "policy: token · max_staleness: 4" in page and "<tr class=current><td>4</td>" in page
    assert "<td>0</td>" in page and "<td>8</td>" in page
