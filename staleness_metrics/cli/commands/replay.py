"""``staleness-metrics replay``: run the sink over a recorded event stream (SPEC 9)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ...engine.shipment import Shipment
from ...engine.sink import Sink
from ...metrics.report import StepReport
from ...records import jsonio
from ...records.columnar import WEIGHT_FIELDS
from ...replay.sources import is_event_file
from ...replay.stream import Event, parse_event, read_event_path, run_events
from .options import add_command, add_sink_options, check_outputs, config_from_args, failed, output_file

if TYPE_CHECKING:
    from ...config import StalenessConfig
    from ...replay.run_dir import RunDirectory
    from ...replay.sources import PrimeRlRead

PROGRESS_MIN_BYTES = 16 << 20
READ_BUFFER = 1 << 20  # a long sample's line is tens of KB: 8 KB (the default) reads it in pieces

EPILOG = """\
examples:
  staleness-metrics replay events.jsonl --metrics-out metrics.jsonl
  staleness-metrics replay path/to/prime-rl-run --lenient  # its monitors/file/traces (current layout)

See docs/replay.md (exit status, compressed streams).
"""


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    summary = "run the sink over a recorded event stream"
    parser = add_command(subparsers, run, "replay", summary, EPILOG)
    add = parser.add_argument
    add("events", type=Path, metavar="EVENTS.jsonl|RUN_DIR")
    add("--max-staleness", type=int, metavar="N", help="the bound (default: 8)")
    add_sink_options(parser)
    breakdown = "add staleness/env/<env>/... keys"
    add("--env-breakdown", action="store_const", const=True, help=breakdown)
    add("--metrics-out", type=Path, metavar="FILE", help="one metrics line per ship")
    add("--batches-out", type=Path, metavar="FILE", help="one shipped-batch line per ship")
    progress_help = "progress bar (default: on a terminal, for inputs over 16 MiB)"
    add("--progress", action=argparse.BooleanOptionalAction, help=progress_help)


def open_events(
    path: Path, progress: bool | None, config: StalenessConfig, run: RunDirectory | None = None
) -> tuple[Iterator[Event], contextlib.ExitStack, PrimeRlRead | None]:
    """Events of a stream, run directory (``run``) or adapters' run; a prime-rl run's reader."""
    from ...replay.sources import detect_and_read, is_current_layout, read_run_events

    stack = contextlib.ExitStack()
    if run is not None and run.trainer_logprobs is not None:  # its records joined to them
        return run.events_with_costs(), stack, None
    path, max_staleness = path if run is None else run.events, config.max_staleness
    if is_event_file(path):
        # read ahead: the outputs are written when the whole stream has been replayed
        events = read_event_path(path, parse=True, read_ahead=True, opener=lambda p: _open(p, progress))
        stack.callback(events.close)  # closes the file even when the replay stops early
        return events, stack, None
    if path.is_dir() and is_current_layout(path):
        read = read_run_events(path, max_staleness=max_staleness, strict=config.strict)
        return iter(read), stack, read
    raws = detect_and_read(path, max_staleness=max_staleness)
    return (parse_event(number, raw) for number, raw in enumerate(raws, start=1)), stack, None


def _prime_rl_lines(path: Path, read: PrimeRlRead | None, reports: list[StepReport]) -> list[str]:
    """What a prime-rl run's reader left out or set aside, and its logged values against ours."""
    from ...replay.sources import compare_prime_rl, is_prime_rl_run, read_prime_rl_metrics
    from ...replay.sources.prime_rl.compare import describe_comparison

    if not (path.is_dir() and is_prime_rl_run(path)):
        return []
    lines: list[str] = []
    if read is not None:
        if read.notes.left_out():
            lines.append(f"left out (SPEC 9): {read.notes.left_out()}")
        if read.notes.damage.total:
            lines.append(f"set aside as damaged (--lenient): {read.notes.damage.summary()}")
    logged = read_prime_rl_metrics(path, lines)  # (a torn last line is said in `lines`)
    rows = compare_prime_rl(path, reports, historical=logged, notes=read.notes if read else None)
    return lines + describe_comparison(rows)


def _open(path: Path, progress: bool | None) -> contextlib.AbstractContextManager[IO[bytes]]:
    if progress is None:
        progress = sys.stderr.isatty() and path.stat().st_size > PROGRESS_MIN_BYTES
    if progress:
        with contextlib.suppress(ImportError):  # rich is optional: no bar without it
            import rich.console
            import rich.progress

            stderr = rich.console.Console(stderr=True)  # isatty() chose: stdout is the user's
            return rich.progress.open(path, "rb", description="replay", console=stderr)
    return path.open("rb", buffering=READ_BUFFER)


def batches_line_bytes(shipment: Shipment) -> bytes:
    """The ``--batches-out`` line of a ship, its 0/1 weights written by one compiled pass."""
    line = shipment.batches_line(arrays=True)
    samples = [sample for r in line["shipped"] for sample in r["samples"]]
    held = [(sample, name) for sample in samples for name in WEIGHT_FIELDS if name in sample]
    texts = jsonio.zero_one_floats([sample[name] for sample, name in held])
    for (sample, name), text in zip(held, texts or ()):
        sample[name] = text
    return jsonio.dumps_line(line)


def run(args: argparse.Namespace) -> int:
    from ...replay.run_dir import find_run

    if not args.events.exists():
        return failed("replay", f"{args.events}: no such file or directory")
    try:
        run_dir = find_run(args.events)
        config = config_from_args(args, run_dir, max_staleness=args.max_staleness)
        outputs = ("--metrics-out", args.metrics_out), ("--batches-out", args.batches_out)
        check_outputs(args.events, run_dir, *outputs)
    except (ValueError, OSError) as error:  # ConfigError included
        return failed("replay", error)
    sink = Sink(config, env_reports=config.env_breakdown)
    ships, reports = 0, list[StepReport]()
    prime_rl = args.events.is_dir() and run_dir is None
    try:
        events, stack, read = open_events(args.events, args.progress, config, run_dir)
        with stack, output_file(args.metrics_out) as rows, output_file(args.batches_out) as batches:
            for shipment in run_events(events, sink, read_ahead=True):
                ships += 1
                if prime_rl:
                    reports.append(shipment.report)
                if rows is not None:
                    rows.write(jsonio.dumps_line(shipment.report.row()))
                if batches is not None:
                    batches.write(batches_line_bytes(shipment))
            said = _prime_rl_lines(args.events, read, reports) if prime_rl else []  # (may stop it)
    except (ValueError, OSError) as error:  # EventError included
        return failed("replay", error)
    t = sink.totals
    print(f"replayed {ships} ships: {t.rollouts_shipped} rollouts shipped, "
          f"{t.rollouts_dropped} dropped, {t.tokens_masked}/{t.tokens_sampled} sampled tokens "
          f"masked, {t.rollouts_invalid} invalid set aside",
          *said, sep="\n", file=sys.stderr)  # fmt: skip
    return 0
