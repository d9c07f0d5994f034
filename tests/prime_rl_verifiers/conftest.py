"""Tests on records built by verifiers 0.4.0's own classes: skipped where verifiers is not importable
(Python < 3.11, or an environment without the ``test`` extra)."""

from __future__ import annotations

import pytest

pytest.importorskip("verifiers", minversion="0.4.0")
pytest.importorskip("pyzstd")
