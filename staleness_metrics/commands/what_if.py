"""``staleness-metrics what-if``: the same run replayed at a range of bounds."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError, EventError
from .options import add_sink_options, config_from_args

__all__ = ["register", "run"]

EPILOG = """\
examples:
  staleness-metrics what-if events.jsonl --max-staleness 0..8
  staleness-metrics what-if path/to/prime-rl-run --policy episode --max-staleness 0..8 --json
  staleness-metrics what-if xtuner-states.jsonl --policy xtuner --max-token-staleness 1 --max-staleness 0..4

Per bound: masked = masked / sampled tokens of the shipped batches over the run; tokens kept =
sampled tokens that train (sampled - masked); kept share = kept / (shipped + dropped sampled tokens);
dropped rollouts and samples; live rollouts shipped; held = held rollouts summed over ships.
"""


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "what-if",
        help="masked / dropped / kept for each bound",
        description="Replay a run (event stream, prime-rl run directory or xtuner states) at every "
        "max_staleness of a range and show what would have been masked, dropped and kept.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("events", type=Path, metavar="EVENTS")
    parser.add_argument(
        "--max-staleness",
        default="0..8",
        metavar="A..B",
        help="bounds to try: A..B, N or N,M,... (default: 0..8)",
    )
    add_sink_options(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..what_if import format_table, parse_bounds, to_json, what_if

    try:
        bounds = parse_bounds(args.max_staleness)
        config = config_from_args(args, bounds[0] if bounds else 0)
        rows = what_if(args.events, bounds, config)
    except EventError as error:
        print(str(error), file=sys.stderr)
        return 2
    except (ConfigError, ValueError, OSError) as error:
        print(f"staleness-metrics what-if: {error}", file=sys.stderr)
        return 2
    print(to_json(rows) if args.json else format_table(rows))
    return 0
