"""A W&B workspace with a "Staleness" section: the Grafana views over the table's W&B keys
(:func:`workspace_spec` is the plain data; :func:`build_workspace` needs ``wandb_workspaces``)."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from .promql import table_row

SECTION = "Staleness"
API_KEY_ENV = "WANDB_API_KEY"


class MissingApiKey(RuntimeError):
    """Saving a workspace needs a W&B API key."""


@dataclass(frozen=True)
class PanelSpec:
    """One panel: a line plot of W&B keys (or of the keys matching ``metric_regex``)."""

    title: str
    keys: tuple[str, ...] = ()
    metric_regex: str | None = None
    stacked: bool = False
    range_y: tuple[float | None, float | None] = (None, None)
    kind: str = "line"  # "line" or "scalar" (the run's largest value of keys[0])
    notes: str = field(default="", compare=False)


def wandb_key(name: str) -> str:
    key = table_row(name).wandb_key
    if key is None:
        raise KeyError(f"metric {name!r} is not logged to W&B")
    return key


def per_env_regex(name: str) -> str:
    """Matches the per-env keys of a row (``staleness/env/<env>/token/mean``)."""
    head, _, tail = wandb_key(name).partition("/")
    return f"^{re.escape(head)}/env/.+/{re.escape(tail)}$"


def per_bucket_regex(name: str) -> str:
    """Matches every bucket's key of a templated row (its placeholder a wildcard)."""
    row = table_row(name)
    if row.dimension is None:
        raise KeyError(f"metric {name!r} has no bucket dimension")
    head, _, tail = wandb_key(name).partition(row.dimension.placeholder)
    return f"^{re.escape(head)}[^/]+{re.escape(tail)}$"


SHARE = (0.0, 1.0)  # range_y of a share


def _keys(*names: str) -> tuple[str, ...]:
    return tuple(wandb_key(n) for n in names)


def _by_bucket(title: str, name: str, range_y: tuple[float, float] | None = None) -> PanelSpec:
    return PanelSpec(title, metric_regex=per_bucket_regex(name), range_y=range_y or (None, None))


def panels() -> list[PanelSpec]:
    """The Staleness section, in display order."""
    return [
        PanelSpec("Token staleness mean vs bound", _keys("token_mean", "max_staleness")),
        PanelSpec("Token staleness quantiles", _keys("token_p50", "token_p90", "token_p99")),
        # a wandb.Histogram per step: W&B draws it as a distribution over time
        PanelSpec("Token staleness distribution", _keys("token_staleness")),
        PanelSpec("Masked tokens", _keys("token_masked"), range_y=SHARE),
        PanelSpec(
            "Rollout staleness mean and max vs bound",
            _keys("rollout_mean", "rollout_max", "max_staleness"),
        ),
        PanelSpec(
            "In-flight vs in-queue staleness (mean)",
            _keys("rollout_in_flight_mean", "rollout_in_queue_mean"),
            stacked=True,
            notes="Per rollout in flight + in queue = rollout staleness, so the stack is the rollout mean.",
        ),
        PanelSpec(
            "In-flight vs in-queue staleness (max)",
            _keys("rollout_in_flight_max", "rollout_in_queue_max"),
        ),
        PanelSpec(
            "Rollout staleness: oldest vs newest token",
            _keys("rollout_mean", "rollout_newest_mean", "rollout_max", "rollout_newest_max"),
            notes="Oldest token: prime-rl's headline (staleness/rollout/*); newest token: verl's trajectory staleness.",
        ),
        PanelSpec("Dropped per step", _keys("rollouts_dropped", "samples_dropped")),
        PanelSpec("Held rollouts", _keys("rollouts_held")),
        PanelSpec(
            "Unlabelled tokens",
            _keys("token_unlabelled"),
            range_y=SHARE,
            notes="Label coverage is 1 minus this share.",
        ),
        PanelSpec("Largest rollout staleness", _keys("rollout_max"), kind="scalar"),
        PanelSpec("Token staleness mean per env", metric_regex=per_env_regex("token_mean")),
        PanelSpec("Masked tokens per env", metric_regex=per_env_regex("token_masked"), range_y=SHARE),
        # SPEC 11 and 12: what staleness costs, and the length bias of masking
        PanelSpec(
            "Excess k3 of stale tokens",
            _keys("mismatch_excess_k3", "mismatch_k3"),
            notes="Mean k3 of tokens at lag >= 1 minus the floor (SPEC 14), and the mean k3 over every token.",
        ),
        PanelSpec(
            "Excess k3 over the floor by lag",
            metric_regex=per_bucket_regex("mismatch_excess_k3_by_lag"),
            notes=(
                "What staleness costs at each lag: the mismatch above the engines' numeric floor "
                "(SPEC 14: measured at lag 0, carried from an earlier ship, or the smallest lag's)."
            ),
        ),
        _by_bucket("Mismatch k3 by lag", "mismatch_k3_by_lag"),
        _by_bucket("Effective sample size by lag", "mismatch_ess_by_lag", SHARE),
        _by_bucket("Out-of-band share by lag", "mismatch_out_of_band_by_lag", SHARE),
        PanelSpec("Mismatch coverage", _keys("mismatch_coverage"), range_y=SHARE),
        PanelSpec("Largest excess k3", _keys("mismatch_excess_k3"), kind="scalar"),
        PanelSpec(
            "Trained vs sampled mean length",
            _keys("length_sampled_mean", "length_trained_mean"),
            notes="Masked positions and dropped samples count as 0 in the trained mean.",
        ),
        _by_bucket("Removed share by length bucket", "length_removed_share", SHARE),
    ]


def workspace_spec(x_axis: str) -> dict[str, Any]:
    """The section as plain JSON data (what ``dashboards/wandb-workspace.json`` holds)."""
    return {"section": SECTION, "x_axis": x_axis, "panels": [asdict(p) for p in panels()]}


def build_workspace(entity: str, project: str, *, x_axis: str, name: str = "RL staleness") -> Any:
    """The ``wandb_workspaces`` Workspace (built offline; nothing is sent)."""
    import wandb_workspaces.workspaces as ws
    from wandb_workspaces.reports.v2.interface import LinePlot, ScalarChart

    built: list[Any] = [
        ScalarChart(title=spec.title, metric=spec.keys[0], groupby_aggfunc="max")
        if spec.kind == "scalar"
        else LinePlot(
            title=spec.title,
            x=x_axis,
            y=list(spec.keys),
            metric_regex=spec.metric_regex,
            plot_type="stacked-area" if spec.stacked else "line",
            range_y=spec.range_y,
        )
        for spec in panels()
    ]
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name,
        sections=[ws.Section(name=SECTION, panels=built, is_open=True)],
        settings=ws.WorkspaceSettings(x_axis=x_axis),
    )


def save(entity: str, project: str, *, x_axis: str, name: str = "RL staleness") -> str:
    """Builds and saves the workspace to W&B; returns its URL. Needs ``WANDB_API_KEY``."""
    if not os.environ.get(API_KEY_ENV):
        raise MissingApiKey(
            f"saving a W&B workspace needs an API key: set {API_KEY_ENV} "
            "(create one at https://wandb.ai/authorize) and run again"
        )
    return str(build_workspace(entity, project, x_axis=x_axis, name=name).save().url)
