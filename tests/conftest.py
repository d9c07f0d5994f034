"""Suite-wide settings.

Hypothesis: no per-example deadline and no "too slow" health check. Both are wall-clock limits (200 ms
per example by default), and the CI machine is shared and noisy: a slow example there says nothing about
the code. Tests that set their own ``@settings`` inherit these defaults for what they leave out.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile("no-wall-clock", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("no-wall-clock")


def pytest_sessionstart(session: object) -> None:
    """Compile the engine's numba loops once, before any test: on a fresh machine the first compile
    takes seconds, which would otherwise land inside whichever test (or served request) comes first."""
    from staleness_metrics.kernels import warm_up

    warm_up()
