"""Runs the ``serve`` subcommand through its own ``register``/``run``, as the console script does.

``python -m tests.server.launch serve --port 0 ...`` (from the project root).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from staleness_metrics.cli.commands import serve
from staleness_metrics.server import runs


def main(argv: Sequence[str] | None = None) -> int:
    # Durability tests take snapshots every few writes, so that one lands after every kind of write.
    every = os.environ.get("STALENESS_TEST_SNAPSHOT_EVERY")
    if every:
        runs.SNAPSHOT_EVERY = int(every)
    parser = argparse.ArgumentParser(prog="staleness-metrics")
    serve.register(parser.add_subparsers(required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
