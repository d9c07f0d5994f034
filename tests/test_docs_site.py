"""The documentation site: ``mkdocs build --strict`` passes (a broken link, anchor or API reference fails it),
its API reference names every public name, and the README stays short and points at pages that exist."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

import staleness_metrics
from tests.support.programs import missing_program

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings_handlers") is None:
        missing_program("mkdocs is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-6000:]
    return out


class _Ids(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.ids.update(value for name, value in attrs if name == "id" and value)


def test_the_strict_build_passes_and_the_api_reference_names_every_public_name(site: Path) -> None:
    parser = _Ids()
    parser.feed((site / "api" / "index.html").read_text(encoding="utf-8"))
    missing = [name for name in staleness_metrics.__all__ if f"staleness_metrics.{name}" not in parser.ids]
    assert not missing, f"the API reference does not document {missing}"
    source = (ROOT / "docs" / "api" / "index.md").read_text(encoding="utf-8")
    assert set(re.findall(r"^::: staleness_metrics\.(\w+)$", source, re.M)) == set(staleness_metrics.__all__)
    # the submodules users import have their pages, built from their docstrings
    for page, anchor in [("exporters", "staleness_metrics.exporters.PrometheusExporter"),
                         ("adapters", "staleness_metrics.adapters.verl.ship"),
                         ("client", "staleness_metrics.client.StalenessClient")]:  # fmt: skip
        parser = _Ids()
        parser.feed((site / "api" / page / "index.html").read_text(encoding="utf-8"))
        assert anchor in parser.ids, page
    # every page of docs/ is in the site, the pictures of the report too
    for page in (ROOT / "docs").rglob("*.md"):
        relative = page.relative_to(ROOT / "docs").with_suffix("")
        built = site / (relative.parent if relative.name == "index" else relative) / "index.html"
        assert built.is_file(), f"{page} was not built"
    assert sorted(p.name for p in (site / "images").glob("*.png")) == sorted(
        p.name for p in (ROOT / "docs" / "images").glob("*.png")
    )


def test_the_readme_is_short_and_its_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme) <= 12000
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if not re.match(r"\w+://", t)]
    assert any(t.startswith("docs/images/") for t in local), "the README shows a picture of the report"
    assert [t for t in local if not (ROOT / t).exists()] == []
    for command in ("staleness-metrics demo", "bash .ci/test"):
        assert command in readme


def test_the_docs_spec_is_the_contract() -> None:
    """docs/SPEC.md is the project's copy of the contract; where the shared copy sits beside the checkout
    (as on a developer's machine and in CI), they are the same text."""
    ours = (ROOT / "docs" / "SPEC.md").read_text(encoding="utf-8")
    assert ours.startswith("# ") and "## 15." in ours
    shared = ROOT.parent / "shared" / "SPEC.md"
    if shared.is_file():
        assert ours == shared.read_text(encoding="utf-8"), f"docs/SPEC.md differs from {shared}"


def _hook(name: str) -> Any:
    if importlib.util.find_spec("griffe") is None:
        missing_program("griffe is not installed (pip install -e '.[docs]')")
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", ROOT / "docs" / "hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sphinx_roles_become_code_spans_and_literal_blocks_stay_blocks() -> None:
    plain = _hook("sphinx_roles").plain
    text = "Raises :class:`~staleness_metrics.errors.TraceError` from :meth:`.Sink.add`; see :mod:`numpy`.\n\nExample::"
    assert plain(text) == "Raises `TraceError` from `Sink.add`; see `numpy`.\n\nExample:"
    assert plain("Before\n\n::\n\n    code") == "Before\n\n\n    code"
