"""Sink options shared by every command that replays a run (SPEC 9)."""

from __future__ import annotations

import argparse

from ..config import POLICY_NAMES, StalenessConfig

__all__ = ["add_sink_options", "config_from_args"]


def add_sink_options(parser: argparse.ArgumentParser) -> None:
    """Policy, xtuner and strictness options (each command adds its own ``--max-staleness``)."""
    parser.add_argument("--policy", choices=POLICY_NAMES, default="token", help="masking policy (default: token)")
    parser.add_argument("--max-token-staleness", type=int, metavar="N", help="xtuner only: token masking bound")
    parser.add_argument("--sync-interval", type=int, default=1, metavar="K", help="xtuner only (default: 1)")
    parser.add_argument("--retry-expired", action="store_true", help="xtuner only: hold groups for re-rollouts")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--strict", dest="strict", action="store_true", default=True, help="stop on invalid input")
    mode.add_argument("--lenient", dest="strict", action="store_false", help="set invalid rollouts aside")


def config_from_args(args: argparse.Namespace, max_staleness: int) -> StalenessConfig:
    return StalenessConfig(
        policy=args.policy,
        max_staleness=max_staleness,
        max_token_staleness=args.max_token_staleness,
        sync_interval=args.sync_interval,
        retry_expired=args.retry_expired,
        strict=args.strict,
        env_breakdown=getattr(args, "env_breakdown", False),
    )
