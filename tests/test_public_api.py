"""The package has one public face: ``__all__``. An accidental export fails here, and so does an export
that cannot be imported or that drags modules into ``import staleness_metrics``."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import staleness_metrics


def _public_names() -> set[str]:
    return {
        name
        for name, value in vars(staleness_metrics).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType) and name != "annotations"
    }


def test_all_lists_exactly_the_public_names() -> None:
    for name in staleness_metrics.__all__:  # resolve the lazily imported names first
        getattr(staleness_metrics, name)
    assert set(staleness_metrics.__all__) == _public_names() | {"__version__"}
    assert set(staleness_metrics.__all__) <= set(dir(staleness_metrics))


def test_every_export_resolves_to_what_its_module_defines() -> None:
    for name in staleness_metrics.__all__:
        value = getattr(staleness_metrics, name)
        assert value is not None, name
        if name != "__version__":
            home = sys.modules[staleness_metrics._HOME[name].replace(".", "staleness_metrics.", 1)]
            assert getattr(home, name) is value, name


def test_every_export_is_usable() -> None:
    """The names a user reaches for do what the README shows: a sink takes a record and ships it."""
    from staleness_metrics import METRICS, Sink, StalenessConfig, TraceError

    sink = Sink(StalenessConfig(max_staleness=1))
    sink.add({"id": "r0", "dispatch_version": 0, "samples": [{"mask": [0, 1, 1]}]})
    shipment = sink.ship(1)
    assert shipment.ids == ["r0"]
    assert len(METRICS) > 0
    assert issubclass(TraceError, staleness_metrics.StalenessError)
    # every deliberate refusal is a StalenessError naming its field, catchable by its public class
    try:
        staleness_metrics.mismatch_sums([0, 1], [0.0, 0.0], [0.0])
    except staleness_metrics.FieldError as error:
        assert error.field == "trainer_logprobs" and isinstance(error, staleness_metrics.StalenessError)
    else:
        raise AssertionError("mismatch_sums took arrays of different lengths")
    for name in ("FieldTypeError", "MissingFieldError"):
        assert issubclass(getattr(staleness_metrics, name), staleness_metrics.StalenessError)


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        staleness_metrics.no_such_name  # noqa: B018
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("an unknown name resolved")


def test_import_loads_no_reader_exporter_or_service_module() -> None:
    """``import staleness_metrics`` in a fresh interpreter loads only the package itself: replay, the
    JSON readers, the service, the dashboards and the legacy keys come in when first used."""
    code = "import sys, json, staleness_metrics; print(json.dumps(sorted(sys.modules)))"
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True).stdout))
    heavy = {"numpy", "orjson", "simdjson", "numba", "staleness_metrics.replay.stream",
             "staleness_metrics.server", "staleness_metrics.dashboards", "staleness_metrics.migrate.legacy",
             "staleness_metrics.engine.sink"}  # fmt: skip
    assert not heavy & loaded
    code = "import sys, json; from staleness_metrics import Sink; print(json.dumps(sorted(sys.modules)))"
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True).stdout))
    assert (
        not {
            "simdjson",
            "staleness_metrics.replay.stream",
            "staleness_metrics.server",
            "staleness_metrics.migrate.legacy",
        }
        & loaded
    )
