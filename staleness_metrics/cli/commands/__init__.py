"""Subcommands of the console script: each module's ``register(subparsers)`` adds its parser, whose
``run(args) -> int`` (importing optional dependencies itself) returns the exit status."""

from __future__ import annotations

__all__: list[str] = []
