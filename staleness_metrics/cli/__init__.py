"""The ``staleness-metrics`` console script (:mod:`.main`) and its subcommands
(:mod:`.commands`)."""

from __future__ import annotations

from .main import build_parser, main

__all__ = ["build_parser", "main"]
