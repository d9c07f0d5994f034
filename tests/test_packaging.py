"""What pyproject.toml promises an install: the license text that goes with every copy, and floors
of the extras' dependencies high enough for what the package needs of them."""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

import pydantic
import tomlkit
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict[str, Any]:
    return tomlkit.parse((ROOT / "pyproject.toml").read_text(encoding="utf-8")).unwrap()


def _requirement(requirements: list[str], name: str) -> Requirement:
    return next(r for r in map(Requirement, requirements) if r.name == name)


def test_the_apache_license_text_is_declared_and_goes_into_the_wheel_and_sdist() -> None:
    """Apache-2.0 section 4(a): a copy of the license goes with every redistribution. The SPDX
    ``license`` and ``license-files`` put it in both the wheel and the sdist (setuptools >= 77)."""
    pyproject = _pyproject()
    project = pyproject["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    setuptools = _requirement(pyproject["build-system"]["requires"], "setuptools")
    assert not setuptools.specifier.contains("76.1.0")  # would refuse the SPDX `license` string
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    words = text.split()
    assert words[:6] == ["Apache", "License", "Version", "2.0,", "January", "2004"]
    assert words[-3:] == ["under", "the", "License."]
    sections = ["Definitions", "Grant of Copyright License", "Grant of Patent License", "Redistribution",
                "Submission of Contributions", "Trademarks", "Disclaimer of Warranty", "Limitation of Liability",
                "Accepting Warranty or Additional Liability"]  # fmt: skip
    for number, title in enumerate(sections, 1):
        assert f"\n   {number}. {title}." in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text


def test_the_server_extra_needs_a_pydantic_that_answers_integer_metrics_as_integers() -> None:
    """The service's ``metrics: dict[str, float | int | str]``: pydantic 2.6-2.8 try ``float`` first
    and answer SPEC 6's integers (maxima, quantiles, counts) as ``2.0``; 2.9 keeps them ints."""
    from staleness_metrics.server.models import StepRow

    server = _requirement(_pyproject()["project"]["optional-dependencies"]["server"], "pydantic")
    assert not server.specifier.contains("2.8.2") and server.specifier.contains(pydantic.VERSION)
    metrics = pydantic.TypeAdapter(StepRow.model_fields["metrics"].annotation)  # under the pydantic installed here
    answered = metrics.dump_python(metrics.validate_python({"max": 3, "mean": 1.5}), mode="json")
    assert answered == {"max": 3, "mean": 1.5} and type(answered["max"]) is int


def test_every_data_file_the_package_reads_goes_into_the_wheel() -> None:
    """migrate's peer table is data (``data/peers.toml``); setuptools puts into the wheel only the
    non-Python files ``package-data`` names, and an install without it fails at ``--from``."""
    package = ROOT / "staleness_metrics"
    globs = _pyproject()["tool"]["setuptools"]["package-data"]["staleness_metrics"]
    data = [path.relative_to(package).as_posix() for path in package.rglob("*")
            if path.is_file() and path.suffix not in {".py", ".pyc"} and "__pycache__" not in path.parts]  # fmt: skip
    assert "data/peers.toml" in data
    assert [name for name in data if not any(fnmatch.fnmatchcase(name, glob) for glob in globs)] == []
