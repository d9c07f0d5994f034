"""prime-rl's logged values beside ours and beside prime-rl's rule recomputed from the records, step
by step (SPEC 9: read for comparison, never as input; docs/trainers/prime-rl.md)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ....metrics import keys
from ....metrics.metric_table import LEGACY_KEYS, env_key
from ....metrics.report import StepReport
from ..events import iter_json_lines
from .chunks import find_layout
from .legacy import shipped_counts
from .run import ReadNotes, StepRule

_MEAN_KEYS = frozenset({keys.ROLLOUT_MEAN, keys.ROLLOUT_IN_FLIGHT_MEAN, keys.ROLLOUT_IN_QUEUE_MEAN})
_MAX_KEYS = frozenset({keys.ROLLOUT_MAX, keys.ROLLOUT_IN_FLIGHT_MAX, keys.ROLLOUT_IN_QUEUE_MAX})
_CURRENT = _MEAN_KEYS | _MAX_KEYS | {keys.ROLLOUTS_DROPPED}
_RULE_FIELD = {keys.ROLLOUT_MEAN: "total", keys.ROLLOUT_MAX: "total",
               keys.ROLLOUT_IN_FLIGHT_MEAN: "in_flight", keys.ROLLOUT_IN_FLIGHT_MAX: "in_flight",
               keys.ROLLOUT_IN_QUEUE_MEAN: "in_queue",
               keys.ROLLOUT_IN_QUEUE_MAX: "in_queue"}  # fmt: skip
MISMATCH_PREFIX = "mismatch_kl/"
# (relative, absolute): float noise, and per-token log-probabilities rounded to 4 decimals
TOLERANCE = (1e-9, 1e-9)
MISMATCH_TOLERANCE = (0.05, 2e-5)

Status = Literal["match", "prime_rl_rule", "missing", "mismatch"]
Logged = dict[str, Any]  # a step's rows of metrics.jsonl, merged

# Why a logged value differs from ours (ComparisonRow.note), one reason a clause.
PER_EPISODE = "prime-rl averages over episodes, SPEC 9 over traces"
FROZEN = "prime-rl counts frozen-model episodes as staleness 0, SPEC leaves them out"
FROZEN_TOKENS = "prime-rl's mismatch_kl includes the tokens of frozen-model samples, SPEC 11 only live ones"
NO_KEY = "no SPEC key holds this statistic: prime-rl's rule recomputed from the records"
DROPPED = (
    "prime-rl's dropped counts what its own bound voided, and the records do not say why an "
    "episode never shipped: SPEC 9 drops every never-shipped episode that was stale at its arrival "
    "under the bound replayed"
)


@dataclass(frozen=True)
class ComparisonRow:
    """One logged value (``legacy_key``) beside ours (``key``, ``recomputed``) and prime-rl's rule
    recomputed from the records (``legacy_rule``); ``status`` as :func:`comparison_summary` counts
    it, ``note`` why the rules differ."""

    step: int
    legacy_key: str
    key: str
    historical: float
    recomputed: float | None
    legacy_rule: float | None
    live: int
    frozen: int
    status: Status
    note: str = ""


def read_prime_rl_metrics(run_dir: str | Path, torn: list[str] | None = None) -> dict[int, Logged]:
    """``metrics.jsonl`` rows by step, a step's rows (one per producer) merged in file order; a torn
    last line (a process mid-append) ends the file, said in ``torn``."""
    layout = find_layout(run_dir)
    path = (layout and layout.metrics) or Path(run_dir) / "metrics.jsonl"
    rows: dict[int, Logged] = {}
    if not path.is_file():
        return rows
    for _, value in iter_json_lines(path, [] if torn is None else torn):
        step = value.get("step") if isinstance(value, dict) else None
        if isinstance(step, int) and not isinstance(step, bool):
            rows.setdefault(step, {}).update(value)
    return rows


def _legacy_value(key: str, value: float | None, live: int, frozen: int) -> float | None:
    """Our value under prime-rl's rule, from counts alone (older layout: a trace per episode)."""
    if frozen == 0:
        return value
    if key in _MEAN_KEYS:
        return 0.0 if value is None or live + frozen == 0 else value * live / (live + frozen)
    return (0.0 if value is None else max(value, 0.0)) if key in _MAX_KEYS else value


def _rule_value(key: str, rule: StepRule) -> float | None:
    """prime-rl's own value of a rollout key, from the shipped episodes of the step."""
    values = getattr(rule, _RULE_FIELD[key]) if key in _RULE_FIELD else None
    return None if not values else sum(values) / len(values) if key in _MEAN_KEYS else float(max(values))


def _status(
    value: float, ours: float | None, rule: float | None, missing: bool, tolerance: tuple[float, float]
) -> Status:
    """``match`` (equal to ours), ``prime_rl_rule`` (to prime-rl's ``rule`` only; None where the
    rules agree), ``missing`` or ``mismatch``."""
    relative, absolute = tolerance
    if ours is not None and math.isclose(value, ours, rel_tol=relative, abs_tol=absolute):
        return "match"
    if rule is not None and math.isclose(value, rule, rel_tol=relative, abs_tol=absolute):
        return "prime_rl_rule"
    return "missing" if missing else "mismatch"


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _staleness_row(
    step: int, logged_key: str, value: float, ours: Mapping[str, Any], rule: StepRule | None, counts: tuple[int, int]
) -> ComparisonRow | None:
    mapping = LEGACY_KEYS.get(logged_key)
    key = mapping.new if mapping is not None else logged_key if logged_key in _CURRENT else None
    if key is None:
        return None
    mine = _number(ours.get(key))
    live, frozen = counts
    legacy = _rule_value(key, rule) if rule is not None else _legacy_value(key, mine, live, frozen)
    per_episode = rule is not None and rule.live_traces != rule.live
    reasons = [text for text, applies in ((PER_EPISODE, per_episode), (FROZEN, frozen)) if applies]
    if key == keys.ROLLOUTS_DROPPED:
        reasons = [DROPPED]
    status = _status(value, mine, legacy if reasons else None, mine is None, TOLERANCE)
    note = "; ".join(reasons)
    return ComparisonRow(step, logged_key, key, value, mine, legacy, live, frozen, status, note)


def _mismatch_row(
    step: int, logged_key: str, value: float, ours: Mapping[str, Any], rule: StepRule | None
) -> ComparisonRow | None:
    *scope_parts, stat = logged_key.removeprefix(MISMATCH_PREFIX).split("/")
    if stat not in ("mean", "std", "min", "max"):
        return None
    scope = "/".join(scope_parts) or "all"
    key = keys.MISMATCH_K3 if scope == "all" else env_key(scope, keys.MISMATCH_K3)
    if stat != "mean":
        key = ""  # no SPEC key holds the statistic
    mine = _number(ours.get(key)) if key else None
    legacy = rule.k3[scope].value(stat) if rule is not None and scope in rule.k3 else None
    live, frozen = (rule.live, rule.frozen) if rule is not None else (0, 0)
    status = _status(value, mine, legacy, mine is None and legacy is None, MISMATCH_TOLERANCE)
    note = NO_KEY if mine is None else FROZEN_TOKENS if frozen else ""
    return ComparisonRow(step, logged_key, key, value, mine, legacy, live, frozen, status, note)


def compare_prime_rl(run_dir: str | Path,
                     metrics: Sequence[StepReport] | Sequence[Mapping[str, Any]], *,
                     historical: Mapping[int, Mapping[str, Any]] | None = None,
                     notes: ReadNotes | None = None) -> list[ComparisonRow]:  # fmt: skip
    """The run's logged values (``historical``, default its ``metrics.jsonl``) beside ``metrics``
    (the replay's reports or ``--metrics-out`` rows), step by step; ``notes``: the current layout
    reader's (prime-rl's rule per step), else the rule follows from the live / frozen counts."""
    root = Path(run_dir)
    logged = historical if historical is not None else read_prime_rl_metrics(root)
    recomputed: dict[int, Mapping[str, Any]] = {}
    counts: dict[int, tuple[int, int]] = {}
    for item in metrics:
        if isinstance(item, StepReport):
            recomputed[item.step] = item.metrics
            counts[item.step] = (item.tally.rollouts_shipped, item.tally.rollouts_frozen)
        else:
            recomputed[int(item["step"])] = item
    if notes is not None:
        counts = {step: (rule.live, rule.frozen) for step, rule in notes.steps.items()}
    elif len(counts) < len(recomputed):  # --metrics-out rows: the counts of the effective files
        counts = shipped_counts(root) | counts
    rows = []
    for step in sorted(logged):
        rule = notes.steps.get(step) if notes is not None else None
        ours = recomputed.get(step, {})
        for logged_key, value in logged[step].items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if logged_key.startswith(MISMATCH_PREFIX):
                row = _mismatch_row(step, logged_key, float(value), ours, rule) if notes is not None else None
            else:
                row = _staleness_row(step, logged_key, float(value), ours, rule, counts.get(step, (0, 0)))
            if row is not None:
                rows.append(row)
    return rows


def comparison_summary(rows: Iterable[ComparisonRow]) -> dict[str, list[int]]:
    """Steps by their worst outcome: ``match`` (equal to ours, or a statistic no SPEC key holds
    equal to prime-rl's rule), ``prime_rl_rule``, ``missing``, ``mismatch``."""
    worst: dict[int, int] = {}
    order: tuple[Status, ...] = ("match", "prime_rl_rule", "missing", "mismatch")
    for row in rows:
        # a statistic no SPEC key holds, reproduced by prime-rl's rule, says nothing against ours
        reproduced = row.note == NO_KEY and row.status == "prime_rl_rule"
        worst[row.step] = max(worst.get(row.step, 0), 0 if reproduced else order.index(row.status))
    summary: dict[str, list[int]] = {name: [] for name in order}
    for step in sorted(worst):
        summary[order[worst[step]]].append(step)
    return summary


def describe_comparison(rows: Sequence[ComparisonRow]) -> list[str]:
    """A few lines for a terminal: per family of logged keys, how many steps equal ours, how many
    prime-rl's rule (and why the rules differ), and which differ otherwise."""
    lines = []
    families = (("orchestrator staleness", None), ("trainer mismatch_kl", MISMATCH_PREFIX))
    for family, prefix in families:
        mine = [r for r in rows if (prefix is not None) == r.legacy_key.startswith(MISMATCH_PREFIX)]
        if not mine:
            continue
        summary = comparison_summary(mine)
        steps = len({r.step for r in mine})
        text = f"prime-rl's logged {family}: {len(summary['match'])} of {steps} steps equal ours"
        if summary["prime_rl_rule"]:
            text += f", {len(summary['prime_rl_rule'])} equal prime-rl's own rule recomputed from the records"
        if prefix is not None:
            text += " (to within the records' 4-decimal rounding)"
        lines.append(text)
        reasons = sorted({part for r in mine if r.status != "match" and r.note for part in r.note.split("; ")})
        lines.extend(f"  why: {reason}" for reason in reasons)
        if summary["mismatch"]:
            first = next(r for r in mine if r.status == "mismatch")
            differ = summary["mismatch"]
            more = f" and {len(differ) - 12} more" if len(differ) > 12 else ""
            lines.append(
                f"  steps {', '.join(map(str, differ[:12]))}{more} differ (first: step {first.step} "
                f"{first.legacy_key} logged {first.historical:.6g}, ours {first.recomputed}, "
                f"prime-rl's rule {first.legacy_rule})"
            )
    return lines
