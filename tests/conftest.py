"""Suite-wide settings.

Hypothesis profiles, chosen by the environment variable ``HYPOTHESIS_PROFILE`` (``dev`` when unset):

- ``ci`` (``.ci/test``): hypothesis' default example counts, derandomized so that a failure on CI is the
  same failure on a second run and on a laptop, with the reproduction blob printed;
- ``dev``: a quarter of the examples, random, for a quick run while editing.

Both have no per-example deadline and no "too slow" health check: those are wall-clock limits (200 ms per
example by default) and the CI machine is shared and noisy, so a slow example there says nothing about
the code. Every other health check stays on. Tests that set their own ``@settings`` inherit the profile
for what they leave out.

Tests run in parallel under pytest-xdist (``-n 2 --dist loadgroup``, ``.ci/test``): servers bind port 0
(or a free port, retried when taken) and write under ``tmp_path``. Tests marked ``serial`` never run at
the same time as each other: they share one xdist group, so one worker runs them in turn (the benchmark
runs, each of which wants the machine's cores to itself).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

_WALL_CLOCK = [HealthCheck.too_slow]
settings.register_profile("ci", derandomize=True, print_blob=True, deadline=None, suppress_health_check=_WALL_CLOCK)
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=_WALL_CLOCK)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_sessionstart(session: object) -> None:
    """Compile the engine's numba loops once, before any test: on a fresh machine the first compile
    takes seconds, which would otherwise land inside whichever test (or served request) comes first."""
    from staleness_metrics.engine.kernels import warm_up

    warm_up()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``serial`` share one xdist group: the ``loadgroup`` scheduler runs them on one worker,
    one after the other (without xdist the marker changes nothing)."""
    for item in items:
        if item.get_closest_marker("serial") is not None:
            item.add_marker(pytest.mark.xdist_group("serial"))
