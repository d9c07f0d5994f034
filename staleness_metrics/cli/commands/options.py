"""What the subcommands share: their parser's making, and the sink options of the replaying ones."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ...config import POLICY_NAMES, RENAMED_SETTINGS, StalenessConfig
from ...errors import ConfigError, EventError
from ...files import atomic_output

if TYPE_CHECKING:
    from ...replay.run_dir import RunDirectory


def add_command(
    subparsers: argparse._SubParsersAction[Any],
    run: Callable[[argparse.Namespace], int],
    name: str,
    summary: str,
    epilog: str,
) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``, calling ``run``; ``epilog`` is printed as written."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help=summary,
        description=summary[0].upper() + summary[1:] + ".",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=run)
    return parser


def failed(command: str, error: Exception | str, code: int = 2) -> int:
    """Say on stderr why ``command`` stops (an ``EventError`` names its line itself); ``code``."""
    shown = str(error) if isinstance(error, EventError) else f"staleness-metrics {command}: {error}"
    print(shown, file=sys.stderr)
    return code


# SPEC 14's settings, each a flag of the same name (``--floor-min-tokens``): type, metavar, help
# and what the default means when it is None (docs/bound.md says more)
_BOUND_OPTIONS: dict[str, tuple[type, str, str, str | None]] = {
    "floor_min_tokens": (int, "N", "covered tokens a lag bucket needs to count", None),
    "floor_max_age": (int, "STEPS", "steps a floor measured at lag 0 is carried at most", None),
    "cost_window": (int, "SHIPS", "ships pooled into the excess curve", None),
    "mismatch_budget": (float, "NATS", "excess k3 per token the bound may let train", "the floor"),
    "adapt_every": (int, "SHIPS", "token policy: adapt the bound after every SHIPS ships", "off"),
    "adapt_low": (int, "N", "lowest adapted bound", None),
    "adapt_high": (int, "N", "highest adapted bound", None),
}


class _RenamedFlag(argparse.Action):
    """SPEC 7: a renamed setting's flag, refused by its new name (not "unrecognized arguments")."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        parser.error(f"{self.option_strings[0]}: renamed to {self.const}")


def add_bound_options(parser: argparse.ArgumentParser) -> None:
    """SPEC 14: the floor, the cost window, the budget and the adaptive bound (``token`` policy);
    the renamed settings' flags, refused."""
    hide = argparse.SUPPRESS  # the renamed settings' flags: in no help, nor the namespace
    for old, new in RENAMED_SETTINGS.items():  # (migrate's legacy.RENAMED_SETTING_FLAGS too)
        flag, to = ("--" + name.replace("_", "-") for name in (old, new))
        parser.add_argument(flag, action=_RenamedFlag, nargs="?", const=to, dest=hide, help=hide)
    defaults = StalenessConfig()
    group = parser.add_argument_group("choosing the bound (SPEC 14)")
    for name, (kind, metavar, text, unset) in _BOUND_OPTIONS.items():
        default = getattr(defaults, name)
        shown = default if default is not None else unset
        flag = "--" + name.replace("_", "-")
        group.add_argument(flag, type=kind, metavar=metavar, help=f"{text} (default: {shown})")


def add_sink_options(parser: argparse.ArgumentParser) -> None:
    """Policy, xtuner and strictness options (each command adds its own ``--max-staleness``); one
    left out is None, so that a run directory's own setting applies (:func:`config_from_args`)."""
    add = parser.add_argument
    add("--policy", choices=POLICY_NAMES, help="masking policy (default: token)")
    add("--max-token-staleness", type=int, metavar="N", help="xtuner only: token masking bound")
    add("--sync-interval", type=int, metavar="K", help="xtuner only (default: 1)")
    held = "xtuner only: hold groups for re-rollouts"
    add("--retry-expired", action="store_const", const=True, help=held)
    mode = parser.add_mutually_exclusive_group()
    strict: dict[str, Any] = {"dest": "strict", "action": "store_const"}
    mode.add_argument("--strict", const=True, help="stop on invalid input", **strict)
    mode.add_argument("--lenient", const=False, help="set invalid rollouts aside", **strict)
    add_bound_options(parser)


_SINK_OPTIONS = (
    *("policy", "max_token_staleness", "sync_interval", "retry_expired", "strict", "env_breakdown"),
    *_BOUND_OPTIONS,
)


def config_from_args(args: argparse.Namespace, run: RunDirectory | None = None, **more: Any) -> StalenessConfig:
    """The settings the command line gives (``more`` too) over ``run``'s own, else the defaults:
    an option it leaves out (None) is not one, and one it gives wins even at its default value."""
    options = {name: getattr(args, name, None) for name in _SINK_OPTIONS} | more
    given: dict[str, Any] = {name: value for name, value in options.items() if value is not None}
    try:
        return run.staleness_config(**given) if run is not None else StalenessConfig(**given)
    except ConfigError as error:  # named by its flag (report's bound is --bound)
        if error.field not in given:
            raise
        name = "bound" if error.field == "max_staleness" and "bound" in args else str(error.field)
        raise ConfigError(f"--{name.replace('_', '-')}: {error.reason}") from None


def check_outputs(source: Path, run: RunDirectory | None, *flags: tuple[str, Path | None]) -> None:
    """Before any replay: a ``ConfigError`` naming the flag of an output that is a folder, whose
    folder is missing, or that is an input (``source``, ``run``'s files and run.json, any file of
    a prime-rl run folder) or another output."""
    from ...replay.run_dir import RUN_FILE

    files = [source, *(vars(run).values() if run else ()), run and run.root / RUN_FILE]
    inputs = [file for file in files if isinstance(file, Path)]
    taken = {Path(os.path.realpath(path)): f"would write over the input {path}" for path in inputs}
    # a prime-rl run folder: its readers read files all over it (metrics, traces, their index)
    folder = Path(os.path.realpath(source)) if run is None and source.is_dir() else None
    for flag, path in flags:
        if path is None or (path.exists() and not path.is_file() and not path.is_dir()):
            continue  # (a device or a FIFO: written in place)
        target = Path(os.path.realpath(path))
        inside = f"would write into the input folder {source}" if folder in target.parents else None
        problem = taken.get(target, inside) if target.parent.is_dir() else "its folder does not exist"
        if problem := "is a folder" if path.is_dir() else problem:
            raise ConfigError(f"{flag} {path}: {problem}")
        taken[target] = f"would write over {flag} {path}"


def output_file(path: Path | None) -> contextlib.AbstractContextManager[IO[bytes] | None]:
    """:func:`~staleness_metrics.files.atomic_output` of ``path``; nothing when it is None."""
    return contextlib.nullcontext() if path is None else atomic_output(path)
