"""What the demo's drift model predicts, for the tests that measure the demo against it."""

from __future__ import annotations

import math

from staleness_metrics.demo import DriftModel


def expected_suggested_bound(model: DriftModel, budget: float | None = None) -> int:
    """SPEC 14's suggested bound at full speed: the largest lag whose expected excess
    ``(speed * lag)^2 / 2`` is within ``budget`` (default: the floor's k3, ``floor^2 / 2``)."""
    beta = model.floor**2 / 2 if budget is None else budget
    return math.floor(math.sqrt(2 * beta) / model.drift_per_version)
