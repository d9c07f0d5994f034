"""Subcommands of the console script.

Each module exposes ``register(subparsers)``, which adds its parser with
``set_defaults(func=run)``; ``run(args) -> int`` returns the exit status. Imports of optional
dependencies happen inside ``run``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from . import dashboards, demo, migrate, replay, report, serve, wandb_workspace, what_if

__all__ = ["COMMANDS", "Register"]

Register = Callable[["argparse._SubParsersAction[Any]"], None]

COMMANDS: list[Register] = [
    replay.register,
    migrate.register,
    dashboards.register,
    wandb_workspace.register,
    demo.register,
    report.register,
    what_if.register,
    serve.register,
]
