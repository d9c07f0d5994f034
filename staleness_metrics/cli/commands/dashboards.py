"""``staleness-metrics dashboards``: write or check the generated dashboards, rules and panels."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .options import add_command, failed

EPILOG = """\
examples:
  staleness-metrics dashboards                 # regenerate under the current directory
  staleness-metrics dashboards --check         # exit 1 if a committed file is out of date (CI)
  staleness-metrics dashboards --out /tmp/gen  # write a fresh copy elsewhere

The files it writes are listed in docs/replay.md (its command table).
"""


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    summary = "write the generated Grafana dashboards, Prometheus rules and W&B panel spec"
    parser = add_command(subparsers, run, "dashboards", summary, EPILOG)
    out_help = "project root the files are written under (default: the current directory)"
    parser.add_argument("--out", type=Path, default=Path("."), metavar="DIR", help=out_help)
    check_help = "write nothing; exit 1 and list the files that are missing or out of date"
    parser.add_argument("--check", action="store_true", help=check_help)


def run(args: argparse.Namespace) -> int:
    root: Path = args.out
    try:
        from ...dashboards import stale_files, write_files

        stale = stale_files(root) if args.check else []
        changed = [] if args.check else write_files(root)
    except ImportError as exc:
        install = "pip install 'staleness-metrics[cli]'"
        return failed("dashboards", f"needs {exc.name or exc}: {install}")
    except OSError as exc:
        return failed("dashboards", exc)
    if stale:
        fix = "regenerate with `staleness-metrics dashboards`"
        print(f"{len(stale)} generated file(s) out of date under {root}; {fix}:", file=sys.stderr)
        print(*(f"  {path}" for path in stale), sep="\n", file=sys.stderr)
        return 1
    for path in changed:
        print(f"wrote {root / path}")
    if not changed:
        print(f"generated files under {root} are up to date")
    return 0
