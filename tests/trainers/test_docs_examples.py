"""The documentation's complete examples that need a trainer's own package (marked ``<!-- runs: trainers -->``),
run in the environment ``.ci/trainers-env`` builds, with the package of this tree."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("verl")
pytest.importorskip("areal")
pytest.importorskip("trl")

from tests.support.doc_blocks import run_page, runnable  # (after the skips)

PAGES = runnable("trainers")


def test_the_trainer_pages_have_complete_examples() -> None:
    assert {"docs/trainers/verl.md", "docs/trainers/areal.md", "docs/trainers/trl.md"} <= set(PAGES)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_page_examples_run_on_the_trainers_packages(page: str, tmp_path: Path) -> None:
    run_page(PAGES[page], tmp_path)
