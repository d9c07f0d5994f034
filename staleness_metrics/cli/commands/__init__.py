"""Subcommands of the console script: each module's ``register(subparsers)`` adds its parser, whose
``run(args) -> int`` (importing optional dependencies itself) returns the exit status."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from . import dashboards, demo, migrate, replay, report, serve, wandb_workspace, what_if

__all__ = ["COMMANDS", "Register"]

Register = Callable[["argparse._SubParsersAction[Any]"], None]

# in the order of the help's command list
_MODULES = (replay, migrate, dashboards, wandb_workspace, demo, report, what_if, serve)
COMMANDS: list[Register] = [module.register for module in _MODULES]
