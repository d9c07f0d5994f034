"""``staleness-metrics what-if``: the same run replayed at a range of bounds."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from .options import add_command, add_sink_options, config_from_args, failed

EPILOG = """\
examples:
  staleness-metrics what-if events.jsonl --max-staleness 0..8
  staleness-metrics what-if path/to/prime-rl-run --policy episode --max-staleness 0..8 --json
  staleness-metrics what-if staleness-demo      # a run directory: its settings, the cost columns

The columns: docs/replay.md and docs/run-inputs.md.
"""


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    summary = "masked / dropped / kept for each bound"
    parser = add_command(subparsers, run, "what-if", summary, EPILOG)
    parser.add_argument("events", type=Path, metavar="EVENTS", help="an event stream, run directory or run input")
    bounds_help = "bounds to try: A..B, N or N,M,... (default: 0..8)"
    parser.add_argument("--max-staleness", default="0..8", metavar="A..B", help=bounds_help)
    add_sink_options(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


def run(args: argparse.Namespace) -> int:
    from ...replay.run_dir import find_run
    from ...replay.what_if import format_table, parse_bounds, to_json, what_if_with_curve

    try:
        bounds = parse_bounds(args.max_staleness)
        if args.adapt_every is not None:  # (a moving bound judges the other rows; the run's too)
            raise ConfigError("--adapt-every: what-if replays each bound fixed (replay and demo adapt)")
        run_dir = find_run(args.events)
        run_dir = run_dir and replace(run_dir, config={**run_dir.config, "adapt_every": None})
        config = config_from_args(args, run_dir, max_staleness=bounds[0] if bounds else 0)
        result = what_if_with_curve(run_dir.root if run_dir else args.events, bounds, config)
    except (ValueError, OSError) as error:  # ConfigError and EventError included
        return failed("what-if", error)
    print(to_json(result.rows) if args.json else format_table(result.rows, result.curve))
    return 0
