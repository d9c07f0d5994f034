"""The package has one public face: ``__all__``. An accidental export fails here."""

from __future__ import annotations

import types

import staleness_metrics


def test_all_lists_exactly_the_public_names() -> None:
    public = {
        name
        for name, value in vars(staleness_metrics).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType) and name != "annotations"
    }
    assert set(staleness_metrics.__all__) == public | {"__version__"}


def test_every_export_resolves() -> None:
    for name in staleness_metrics.__all__:
        assert getattr(staleness_metrics, name) is not None
