"""The ``staleness-metrics`` script: one parser, a module per subcommand (:mod:`.commands`)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .. import __version__
from .commands import dashboards, demo, migrate, replay, report, serve, wandb_workspace, what_if

__all__ = ["build_parser", "main"]

# in the order of the help's command list
COMMANDS = (replay, migrate, dashboards, wandb_workspace, demo, report, what_if, serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="staleness-metrics",
        description="Data freshness of asynchronous RL training: masking, metrics and exporters.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # The reader went away (`... | head`): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
