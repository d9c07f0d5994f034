"""``staleness-metrics demo``: a simulated asynchronous RL run, live, with every exporter."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from ...config import POLICY_NAMES
from ...errors import ConfigError
from .options import add_bound_options, add_command, config_from_args, failed

EPILOG = """\
examples:
  staleness-metrics demo                                  # 60 steps, about 15 s
  staleness-metrics demo --steps 200 --max-staleness 4    # a tighter bound: more masking
  staleness-metrics demo --speed 0 --prometheus-port 0    # as fast as possible, any free port

See docs/getting-started.md.
"""


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    summary = "simulated async RL pipeline driving the real monitor and exporters"
    parser = add_command(subparsers, run, "demo", summary, EPILOG)
    add = parser.add_argument
    add("--steps", type=int, default=60, metavar="N", help="train steps, then stop (default: 60)")
    speed_help = "steps per second, a finite number; 0 = as fast as possible (default: 4)"
    add("--speed", type=float, default=4.0, metavar="S", help=speed_help)
    add("--policy", choices=POLICY_NAMES, default="token", help="masking policy (default: token)")
    add("--max-staleness", type=int, default=8, metavar="N", help="the bound (default: 8)")
    add("--max-token-staleness", type=int, metavar="N", help="xtuner only: token masking bound")
    add("--sync-interval", type=int, default=1, metavar="K", help="xtuner only (default: 1)")
    add("--seed", type=int, default=0, help="simulation seed, >= 0 (default: 0)")
    add_bound_options(parser)
    parser.set_defaults(retry_expired=False, strict=True, env_breakdown=True)  # no option for them
    port_help = "metrics endpoint on 127.0.0.1 (default: 9487; 0 picks a free port)"
    add("--prometheus-port", type=int, default=9487, metavar="P", help=port_help)
    add("--metrics-out", type=Path, metavar="FILE", help="default: OUT_DIR/metrics.jsonl")
    add("--out-dir", type=Path, default=Path("staleness-demo"), help="default: ./staleness-demo")
    add("--no-wandb", dest="wandb", action="store_false", help="no offline W&B run")
    live_help = "live table below the step lines (default: on a terminal)"
    add("--live", action=argparse.BooleanOptionalAction, help=live_help)


def run(args: argparse.Namespace) -> int:
    try:  # Ctrl-C during the imports too: 130, quietly, as the demo stops on one
        from ...demo import DemoOptions, run_demo

        if args.steps < 1:
            raise ConfigError(f"steps: must be >= 1, got {args.steps}")
        if not 0 <= args.speed < float("inf"):  # NaN neither
            raise ConfigError(f"speed: must be a finite number >= 0, got {args.speed}")
        if args.seed < 0:
            raise ConfigError(f"seed: must be >= 0, got {args.seed}")
        if not 0 <= args.prometheus_port <= 65535:
            raise ConfigError(f"prometheus-port: must be 0..65535, got {args.prometheus_port}")
        config = config_from_args(args, max_staleness=args.max_staleness)
        # every option but the config's is a field of the same name
        names = [field.name for field in dataclasses.fields(DemoOptions) if field.name != "config"]
        return run_demo(DemoOptions(config=config, **{name: getattr(args, name) for name in names}))
    except (ConfigError, OSError) as error:  # OSError: an output that cannot be written, or in use
        return failed("demo", error)
    except KeyboardInterrupt:
        return 130
