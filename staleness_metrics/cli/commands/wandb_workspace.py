"""``staleness-metrics wandb-workspace``: save the "Staleness" W&B workspace to a project."""

from __future__ import annotations

import argparse
from typing import Any

from .options import add_command, failed

EPILOG = """\
example:
  WANDB_API_KEY=... staleness-metrics wandb-workspace --entity my-team --project async-rl

The panels are the ones in dashboards/wandb-workspace.json.
"""


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    summary = "save a W&B workspace with a Staleness section to a project (needs WANDB_API_KEY)"
    parser = add_command(subparsers, run, "wandb-workspace", summary, EPILOG)
    parser.add_argument("--entity", required=True, help="W&B entity (user or team)")
    parser.add_argument("--project", required=True, help="W&B project")
    parser.add_argument("--name", default="RL staleness", help="name of the saved view (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from ...dashboards import WANDB_X_AXIS
    from ...dashboards.wandb_panels import MissingApiKey, save

    try:
        url = save(args.entity, args.project, x_axis=WANDB_X_AXIS, name=args.name)
    except MissingApiKey as exc:
        return failed("wandb-workspace", exc)
    except ImportError as exc:
        extra = "install the W&B extra (pip install 'staleness-metrics[wandb]')"
        return failed("wandb-workspace", f"{exc.name or exc}: {extra}")
    print(f"saved W&B workspace: {url}")
    return 0
