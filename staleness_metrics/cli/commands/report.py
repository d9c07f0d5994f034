"""``staleness-metrics report``: one self-contained HTML file about a run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ...files import atomic_output
from .options import add_command, add_sink_options, check_outputs, config_from_args, failed

EPILOG = """\
examples:
  staleness-metrics report staleness-demo                # a run directory: every section, its settings
  staleness-metrics report path/to/prime-rl-run --policy episode -o report.html
  staleness-metrics report metrics.jsonl -o report.html  # logged rows only: no histogram, no what-if

See docs/replay.md.
"""


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = add_command(subparsers, run, "report", "self-contained HTML report of a run", EPILOG)
    parser.add_argument("run", type=Path, metavar="RUN")
    parser.add_argument("-o", "--output", type=Path, default=Path("report.html"), help="default: report.html")
    curve_help = "bounds of the what-if curve: A..B, N or N,M,... (default: 0..max(8, --bound))"
    parser.add_argument("--max-staleness", metavar="A..B", help=curve_help)
    bound_help = "the bound the run used (default: 8; for logged metrics, their own)"
    parser.add_argument("--bound", type=int, metavar="N", help=bound_help)
    add_sink_options(parser)
    parser.add_argument("--title", default="Staleness report", help="page title")


def run(args: argparse.Namespace) -> int:
    from ...html_report import collect, render
    from ...replay.run_dir import find_run
    from ...replay.what_if import MAX_BOUNDS, parse_bounds

    try:
        config = config_from_args(args, run_dir := find_run(args.run), max_staleness=args.bound)
        check_outputs(args.run, run_dir, ("-o", args.output))
        top = max(8, config.max_staleness)  # the curve: <= 257 bounds, up to max(8, the bound)
        bounds = parse_bounds(args.max_staleness or f"{max(0, top - MAX_BOUNDS + 1)}..{top}")
        data = collect(args.run, config, bounds)
        if data.bound is None and args.bound is not None:
            data.bound = args.bound  # logged rows that do not say which bound they ran at
        with atomic_output(args.output) as out:  # (a page cut short never replaces the last one)
            out.write(render(data, args.title).encode("utf-8"))
    except (ValueError, OSError) as error:  # ConfigError and EventError included
        return failed("report", error)
    print(f"wrote {args.output} (steps shipped: {data.steps_shipped})", file=sys.stderr)
    return 0
