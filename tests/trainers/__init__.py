"""Tests on the trainers' own packages (verl, AReaL, TRL), run in the environment `.ci/trainers-env` builds.

In any other environment every module here skips itself (``pytest.importorskip``).
"""
