"""The environment these tests run in is the one the README names: the releases it was checked on."""

from __future__ import annotations

from importlib.metadata import version

import pytest

pytest.importorskip("verl")
pytest.importorskip("areal")
pytest.importorskip("trl")
torch = pytest.importorskip("torch")


def test_the_checked_releases_are_the_ones_installed() -> None:
    assert torch.__version__.split("+")[0] == "2.13.0"
    assert (version("verl"), version("areal"), version("trl")) == ("0.9.1", "1.0.4", "1.16.0")
