"""Subcommands of the console script: each module's ``register(subparsers)`` adds its parser, whose
``run(args) -> int`` (importing optional dependencies itself) returns the exit status."""

from __future__ import annotations

from . import dashboards, demo, migrate, replay, report, serve, wandb_workspace, what_if

__all__ = ["COMMANDS"]

# in the order of the help's command list
COMMANDS = (replay, migrate, dashboards, wandb_workspace, demo, report, what_if, serve)
