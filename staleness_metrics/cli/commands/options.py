"""What the subcommands share: their parser's making, and the sink options of every command that
replays a run (SPEC 9)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ...config import POLICY_NAMES, StalenessConfig

__all__ = [
    "BOUND_SETTINGS",
    "add_bound_options",
    "add_command",
    "add_sink_options",
    "bound_settings",
    "config_from_args",
]


def add_command(
    subparsers: argparse._SubParsersAction[Any],
    run: Callable[[argparse.Namespace], int],
    name: str,
    summary: str,
    description: str,
    epilog: str,
) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``, calling ``run``; ``epilog`` is printed as written."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help=summary,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=run)
    return parser


# SPEC 14's settings, each a flag of the same name (``--floor-min-tokens``).
BOUND_SETTINGS = (
    "floor_min_tokens", "floor_max_age", "cost_window", "mismatch_budget", "adapt_every", "adapt_low", "adapt_high",
)  # fmt: skip


def add_bound_options(parser: argparse.ArgumentParser) -> None:
    """SPEC 14: the floor, the cost window, the budget and the adaptive bound (``token`` policy)."""
    defaults = StalenessConfig()
    group = parser.add_argument_group("choosing the bound (SPEC 14)")
    group.add_argument(
        "--floor-min-tokens", type=int, default=defaults.floor_min_tokens, metavar="N",
        help=f"covered tokens a lag bucket needs to give the floor or a point of the curve "
        f"(default: {defaults.floor_min_tokens})",
    )  # fmt: skip
    group.add_argument(
        "--floor-max-age", type=int, default=defaults.floor_max_age, metavar="STEPS",
        help="carry a floor measured at lag 0 this many steps at most, then bound it by the "
        f"smallest lag (default: {defaults.floor_max_age})",
    )  # fmt: skip
    group.add_argument(
        "--cost-window", type=int, default=defaults.cost_window, metavar="SHIPS",
        help=f"ships pooled into the excess curve (default: {defaults.cost_window})",
    )  # fmt: skip
    group.add_argument(
        "--mismatch-budget", type=float, default=None, metavar="NATS",
        help="excess k3 per token the bound may let train (default: the floor)",
    )  # fmt: skip
    group.add_argument(
        "--adapt-every", type=int, default=None, metavar="SHIPS",
        help="token policy: move the bound one step toward the suggestion after every SHIPS ships "
        "with a curve (default: off)",
    )  # fmt: skip
    group.add_argument(
        "--adapt-low", type=int, default=defaults.adapt_low, metavar="N",
        help=f"lowest adapted bound (default: {defaults.adapt_low})",
    )  # fmt: skip
    group.add_argument(
        "--adapt-high", type=int, default=defaults.adapt_high, metavar="N",
        help=f"highest adapted bound (default: {defaults.adapt_high})",
    )  # fmt: skip


def bound_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The SPEC 14 settings parsed by :func:`add_bound_options`, as ``StalenessConfig`` keywords."""
    return {name: getattr(args, name) for name in BOUND_SETTINGS if hasattr(args, name)}


def add_sink_options(parser: argparse.ArgumentParser) -> None:
    """Policy, xtuner and strictness options (each command adds its own ``--max-staleness``)."""
    parser.add_argument("--policy", choices=POLICY_NAMES, default="token", help="masking policy (default: token)")
    parser.add_argument("--max-token-staleness", type=int, metavar="N", help="xtuner only: token masking bound")
    parser.add_argument("--sync-interval", type=int, default=1, metavar="K", help="xtuner only (default: 1)")
    parser.add_argument("--retry-expired", action="store_true", help="xtuner only: hold groups for re-rollouts")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--strict", dest="strict", action="store_true", default=True, help="stop on invalid input")
    mode.add_argument("--lenient", dest="strict", action="store_false", help="set invalid rollouts aside")
    add_bound_options(parser)


def config_from_args(args: argparse.Namespace, max_staleness: int) -> StalenessConfig:
    return StalenessConfig(
        policy=args.policy,
        max_staleness=max_staleness,
        max_token_staleness=args.max_token_staleness,
        sync_interval=args.sync_interval,
        retry_expired=args.retry_expired,
        strict=args.strict,
        env_breakdown=getattr(args, "env_breakdown", False),
        **bound_settings(args),
    )
