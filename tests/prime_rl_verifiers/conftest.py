"""Tests on records built by verifiers 0.4.0's own classes (the ``test`` extra has it from Python 3.11 on):
left out of collection where verifiers or pyzstd is not installed. ``.ci/test`` checks they are."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("verifiers") is None or importlib.util.find_spec("pyzstd") is None:
    collect_ignore_glob = ["test_*.py"]
