"""The package has one public face: ``__all__``. An accidental export fails here, and so does an export
that cannot be imported or that drags modules into ``import staleness_metrics``."""

from __future__ import annotations

import enum
import inspect
import json
import re
import subprocess
import sys
import types

import numpy as np

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


# Every export by the kind of thing the README documents it as.
EXCEPTIONS = {"StalenessError", "ConfigError", "EventError", "TraceError"}
POLICIES = {"TokenPolicy": "token", "EpisodePolicy": "episode", "GroupPolicy": "group", "XtunerPolicy": "xtuner"}
CLASSES = {
    "Decision", "Judgement", "LegacyKey", "MetricDef", "MismatchSums", "PaddedShipment", "Rollout", "RolloutBatch",
    "Sample", "Shipment", "ShippedRollout", "Sink", "StalenessConfig", "StalenessMonitor", "StepReport", "Tally",
}  # fmt: skip
FUNCTIONS = {"mismatch_sums", "padded_shipment", "read_events", "run_events"}
VALUES = {"LAG_BUCKETS", "LEGACY_KEYS", "METRICS", "__version__"}


def test_every_export_is_of_its_documented_kind() -> None:
    """Each name resolves to what it is documented as: an error class, a concrete policy, a class, a
    function taking arguments, or a value of its type."""
    kinds = EXCEPTIONS | set(POLICIES) | CLASSES | FUNCTIONS | VALUES | {"Policy", "MetricKind"}
    assert kinds == set(staleness_metrics.__all__)
    for name in EXCEPTIONS:
        assert issubclass(getattr(staleness_metrics, name), staleness_metrics.StalenessError), name
    assert inspect.isabstract(staleness_metrics.Policy)
    for name in POLICIES:
        value = getattr(staleness_metrics, name)
        assert issubclass(value, staleness_metrics.Policy) and not inspect.isabstract(value), name
    for name in CLASSES:
        value = getattr(staleness_metrics, name)
        assert inspect.isclass(value) and not inspect.isabstract(value), name
    for name in FUNCTIONS:
        value = getattr(staleness_metrics, name)
        assert inspect.isfunction(value) and inspect.signature(value).parameters, name
    assert issubclass(staleness_metrics.MetricKind, enum.Enum) and list(staleness_metrics.MetricKind)
    assert staleness_metrics.LAG_BUCKETS and all(isinstance(b, str) for b in staleness_metrics.LAG_BUCKETS)
    assert all(isinstance(m, staleness_metrics.MetricDef) for m in staleness_metrics.METRICS)
    assert len({m.name for m in staleness_metrics.METRICS}) == len(staleness_metrics.METRICS)
    legacy = staleness_metrics.LEGACY_KEYS
    assert legacy and all(isinstance(k, str) and isinstance(v, staleness_metrics.LegacyKey) for k, v in legacy.items())
    assert re.fullmatch(r"\d+\.\d+\.\d+", staleness_metrics.__version__)


def test_every_export_is_usable() -> None:
    """The names a user reaches for do what the README shows, together: records in, a ship out, its report,
    the padded way back, the SPEC 11 sums, a replayed stream, each policy by its name, and the errors."""
    from staleness_metrics import (
        METRICS,
        MismatchSums,
        Rollout,
        RolloutBatch,
        Sample,
        Shipment,
        ShippedRollout,
        Sink,
        StalenessConfig,
        StalenessMonitor,
        StepReport,
        Tally,
        TraceError,
        mismatch_sums,
        padded_shipment,
        read_events,
        run_events,
    )

    sink = Sink(StalenessConfig(max_staleness=1))
    sink.add({"id": "r0", "dispatch_version": 0, "samples": [{"mask": [0, 1, 1]}]})
    sink.add(Rollout(id="r1", dispatch_version=0, samples=[Sample(mask=[1, 1])]))
    shipment = sink.ship(1)
    assert isinstance(shipment, Shipment) and shipment.ids == ["r0", "r1"]
    assert all(isinstance(r, ShippedRollout) for r in shipment.rollouts)
    assert isinstance(shipment.report, StepReport) and isinstance(sink.totals, Tally)
    assert shipment.metrics["staleness/token/mean"] == 0
    assert len(METRICS) > 0

    batch = RolloutBatch.from_padded(["a", "b"], np.array([[1, 1], [1, 0]]), dispatch_version=[0, 0])
    monitor = StalenessMonitor(StalenessConfig(max_staleness=4))
    monitor.add(batch)
    back = padded_shipment(monitor.ship(1), batch)
    assert back.shipped.tolist() == [True, True] and back.mask.tolist() == [[1, 1], [1, 0]]
    monitor.close()

    sums = mismatch_sums(np.array([[1, 1]]), np.array([[-1.0, -2.0]]), np.array([[-1.0, -2.0]]))
    assert isinstance(sums, MismatchSums) and sums.covered == 2

    lines = [
        json.dumps({"type": "rollout", "rollout": {"id": "x", "dispatch_version": 0, "samples": [{"mask": [1]}]}}),
        json.dumps({"type": "ship", "step": 3}),
    ]
    ships = list(run_events(read_events(lines), Sink(StalenessConfig(max_staleness=1))))
    assert [s.ids for s in ships] == [[]] and ships[0].dropped_rollouts == ("x",)

    for name, policy in POLICIES.items():
        assert type(Sink(StalenessConfig(policy=policy)).policy).__name__ == name  # type: ignore[arg-type]
    try:
        sink.add({"id": "bad", "dispatch_version": 0, "samples": [{"mask": [2]}]})
    except TraceError as error:
        assert isinstance(error, staleness_metrics.StalenessError) and error.rollout_id == "bad"
    else:
        raise AssertionError("a mask value of 2 was accepted")


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
