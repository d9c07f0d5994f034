"""What pyproject.toml promises an install: floors of the extras' dependencies high enough for what
the package needs of them."""

from __future__ import annotations

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


def test_the_server_extra_needs_a_pydantic_that_answers_integer_metrics_as_integers() -> None:
    """The service's ``metrics: dict[str, float | int | str]``: pydantic 2.6-2.8 try ``float`` first
    and answer SPEC 6's integers (maxima, quantiles, counts) as ``2.0``; 2.9 keeps them ints."""
    from staleness_metrics.server.models import StepRow

    server = _requirement(_pyproject()["project"]["optional-dependencies"]["server"], "pydantic")
    assert not server.specifier.contains("2.8.2") and server.specifier.contains(pydantic.VERSION)
    metrics = pydantic.TypeAdapter(StepRow.model_fields["metrics"].annotation)  # under the pydantic installed here
    answered = metrics.dump_python(metrics.validate_python({"max": 3, "mean": 1.5}), mode="json")
    assert answered == {"max": 3, "mean": 1.5} and type(answered["max"]) is int
