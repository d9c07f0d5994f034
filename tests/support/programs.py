"""External programs the integration tests drive (prometheus, promtool, the Pushgateway, chromium).

On a developer machine without one of them its tests are skipped, saying why. Under CI (``CI=true``) the
programs are installed by ``.ci/test``, so a missing one fails the test instead: a skip there would hide
a check that never ran.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

__all__ = ["IN_CI", "missing_program", "requires_program"]

IN_CI = os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def requires_program(found: object, reason: str) -> pytest.MarkDecorator:
    """Skip the test when ``found`` is None, except under CI (where the test then fails on its own)."""
    return pytest.mark.skipif(found is None and not IN_CI, reason=reason)


def missing_program(reason: str) -> NoReturn:
    """Stop a test that needs a program that is not installed: a failure under CI, a skip elsewhere."""
    if IN_CI:
        pytest.fail(f"{reason} (CI must install it: see .ci/test)")
    pytest.skip(reason)
