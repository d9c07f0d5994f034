"""Checkpoints of a sink (and a monitor) as plain JSON-serialisable data (SPEC 13), checked into new
objects on loading (all or nothing, naming the key path of a fault)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import state_checks
from ..config import StalenessConfig
from ..errors import TraceError
from ..metrics.bound import BoundTracker, env_tracker_config
from ..metrics.buckets import FLOOR_SOURCES, HISTOGRAM_TOP, LENGTH_BUCKETS
from ..metrics.compute import WindowCounts
from ..metrics.mismatch import MismatchSums
from ..metrics.report import TOP_FIELDS, MetricValue, StepReport, Tally
from ..state_checks import decode_array, fail, integer, join, keys, mapping, sequence, string
from .policies import Policy
from .queue import RolloutQueue
from .queue_state import INT64, LAYOUT_KEYS, encode_value, integers, read_layout, read_queue, save_queue

# A checkpoint loads into a sink judging the same way only (``strict``, ``env_breakdown`` aside)
JUDGING_SETTINGS = ("policy", "max_staleness", "max_token_staleness", "sync_interval",
                    "retry_expired")  # fmt: skip
MAX_STEP = 2**53


def check_config(saved: Any, config: StalenessConfig, path: str = "config") -> None:
    """Refuse a checkpoint taken under another policy or bound, naming both sides."""
    saved = mapping(saved, path)
    differs = [name for name in JUDGING_SETTINGS if saved.get(name) != getattr(config, name)]
    if differs:
        theirs = ", ".join(f"{name}={saved.get(name)!r}" for name in differs)
        ours = ", ".join(f"{name}={getattr(config, name)!r}" for name in differs)
        fail(path, f"saved with {theirs}, but this sink has {ours}")


def tally_to_dict(tally: Tally) -> dict[str, Any]:
    values = {f.name: getattr(tally, f.name) for f in dataclasses.fields(tally)}
    return {name: v.tolist() if isinstance(v, np.ndarray) else v for name, v in values.items()}


_TALLY_ARRAY_LENGTHS = {
    "token_histogram": HISTOGRAM_TOP + 1,
    "rollout_histogram": HISTOGRAM_TOP + 1,
    "length_sampled": len(LENGTH_BUCKETS),
    "length_removed": len(LENGTH_BUCKETS),
}


def check_tally(data: Any, path: str) -> Tally:
    """A :class:`Tally` from :func:`tally_to_dict`, every counter present and non-negative; saved
    before the exact staleness of the histograms' last index, what it holds stays at that index."""
    names = [f.name for f in dataclasses.fields(Tally)]
    found = keys(data, path, [name for name in names if name not in TOP_FIELDS], TOP_FIELDS)
    values: dict[str, Any] = {}
    for name in names:
        where = join(path, name)
        if name in _TALLY_ARRAY_LENGTHS:
            items = sequence(found[name], where)
            if len(items) > (top := _TALLY_ARRAY_LENGTHS[name]):
                fail(where, f"{len(items)} buckets, more than the {top} there are")
            values[name] = integers(items, where, None, 0, 2**63 - 1)
        elif name in found:
            values[name] = integer(found[name], where, 0)
        else:  # saved before them: what the last index holds stays at it (its extremes: that index)
            counts = values[name.split("_")[0] + "_histogram"]
            folded = "_top_" in name and len(counts) > HISTOGRAM_TOP and counts[-1]
            values[name] = HISTOGRAM_TOP if folded else 0
    return Tally(**values)


def _window_to_dict(window: WindowCounts) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in vars(window).items():
        if isinstance(value, dict):
            out[name] = {"per_env": [[int(env), encode_value(item)] for env, item in sorted(value.items())]}
        else:
            out[name] = {"list": [list(item) if isinstance(item, tuple) else item for item in value]}
    return out


def _window_from_dict(data: Any, path: str, n_envs: int) -> WindowCounts:
    window = WindowCounts()
    found = keys(data, path, list(vars(window)))
    for name in ("counts", "dropped_lengths"):
        where = join(join(path, name), "per_env")
        pairs = sequence(keys(found[name], join(path, name), ("per_env",))["per_env"], where)
        per_env: dict[int, Any] = {}
        for i, pair in enumerate(pairs):
            env, value = sequence(pair, join(where, i), 2)
            env = integer(env, join(join(where, i), 0), 0, n_envs - 1)
            if env in per_env:
                fail(join(where, i), f"env {env} appears twice")
            item = join(join(where, i), 1)
            if name == "counts":
                counts = keys(keys(value, item, ("dict",))["dict"], join(item, "dict"), WindowCounts.FIELDS)
                per_env[env] = {
                    field: integer(keys(counts[field], join(item, f"dict.{field}"), ("value",))["value"],
                                   join(item, f"dict.{field}.value"), 0)
                    for field in WindowCounts.FIELDS
                }  # fmt: skip
            else:
                array = decode_array(keys(value, item, ("array",))["array"], join(item, "array"), INT64)
                if len(array) != len(LENGTH_BUCKETS) or (array < 0).any():
                    fail(join(item, "array"), f"expected {len(LENGTH_BUCKETS)} non-negative counts")
                per_env[env] = array
        setattr(window, name, per_env)
    lists = {name: sequence(keys(found[name], join(path, name), ("list",))["list"], join(path, f"{name}.list"))
             for name in ("dropped_rollouts", "dropped_samples", "held")}  # fmt: skip
    window.dropped_rollouts = state_checks.strings(lists["dropped_rollouts"], join(path, "dropped_rollouts.list"))
    window.held = state_checks.strings(lists["held"], join(path, "held.list"))
    samples = []
    for i, pair in enumerate(lists["dropped_samples"]):
        where = join(join(path, "dropped_samples.list"), i)
        rid, local = sequence(pair, where, 2)
        samples.append((string(rid, join(where, 0)), integer(local, join(where, 1), 0)))
    window.dropped_samples = samples
    return window


SINK_KEYS = ("format", "config", "step", "queue", "window", "invalid", "totals", "policy")
LAYOUT_SINK_KEYS = (*SINK_KEYS[:3], *LAYOUT_KEYS, *SINK_KEYS[4:])  # formats 1, 2
# the digests (not in format 1), SPEC 14's trackers (absent before it), where an adaptive bound last moved
OPTIONAL_SINK_KEYS = ("digests", "bound", "bound_envs", "bound_moved_at")


@dataclass(frozen=True)
class SinkState:
    """What a sink's checkpoint holds (:func:`read_sink` builds it as new objects)."""

    step: int
    queue: RolloutQueue
    window: WindowCounts
    invalid: tuple[TraceError, ...]
    totals: Tally
    policy_state: Mapping[str, Any]
    bound_tracker: BoundTracker
    env_trackers: Mapping[str, BoundTracker]
    bound_moved_at: int = 0


def save_sink(config: StalenessConfig, parts: SinkState) -> dict[str, Any]:
    """The state of a sink of ``config`` from its parts (its queue's staged rows built)."""
    state: dict[str, Any] = {
        "format": state_checks.FORMAT,
        "config": {**dataclasses.asdict(config), "mismatch_band": list(config.mismatch_band)},
        "step": parts.step,
        "queue": save_queue(parts.queue),
        "window": _window_to_dict(parts.window),
        "invalid": [[e.rollout_id, e.field, e.reason] for e in parts.invalid],
        "totals": tally_to_dict(parts.totals),
        "policy": parts.policy_state,
        "bound": parts.bound_tracker.state_dict(),
        "bound_envs": {env: tracker.state_dict() for env, tracker in sorted(parts.env_trackers.items())},
    }
    if parts.bound_moved_at:
        state["bound_moved_at"] = parts.bound_moved_at
    state["digests"] = state_checks.digests_of(state)
    return state


def read_sink(state: Any, path: str = "", *, config: StalenessConfig, policy: Policy) -> SinkState:
    """A sink state checked, what it holds built as new objects for a sink of ``config``."""
    state_checks.check_format(state, "sink", path)
    old = state["format"] in (1, 2)  # the queue's tables and batches
    state = keys(state, path, LAYOUT_SINK_KEYS if old else SINK_KEYS, OPTIONAL_SINK_KEYS)
    if state["format"] != 1 and "digests" not in state:
        fail(join(path, "digests"), "missing")
    check_config(state["config"], config, join(path, "config"))
    step = integer(state["step"], join(path, "step"), 0, MAX_STEP)
    if old:
        restored = read_layout(state, policy.observe_added, path, step)
    else:
        where = join(path, "queue")
        restored = read_queue(mapping(state["queue"], where), policy.observe_added, where, step)
    window = _window_from_dict(state["window"], join(path, "window"), len(restored.env_names))
    invalid = []
    for i, item in enumerate(sequence(state["invalid"], join(path, "invalid"))):
        at = join(join(path, "invalid"), i)
        rid, field, reason = sequence(item, at, 3)
        invalid.append(TraceError(string(rid, at + "[0]", True), string(field, at + "[1]"), string(reason, at + "[2]")))
    totals = check_tally(state["totals"], join(path, "totals"))
    # Conservation: every sampled position of a live rollout that entered left or is queued
    dropped = totals.tokens_dropped + window.totals(None)["tokens_dropped"]
    accounted = totals.tokens_sampled + dropped + restored.tokens_queued
    if restored.tokens_entered != accounted:
        fail(join(path, "tokens_entered"), f"{restored.tokens_entered}, but shipped, dropped and queued positions "
             f"add to {accounted}")  # fmt: skip
    policy_state = policy.check_state_dict(state["policy"], join(path, "policy"))
    tracker = BoundTracker(config)
    if "bound" in state:
        tracker.load_checked(tracker.check_state_dict(state["bound"], join(path, "bound")))
    env_trackers: dict[str, BoundTracker] = {}
    for env, env_state in mapping(state.get("bound_envs", {}), join(path, "bound_envs")).items():
        where = join(join(path, "bound_envs"), string(env, join(path, "bound_envs")))
        if not env:
            fail(where, "an env tracker needs an env name")
        env_trackers[env] = BoundTracker(env_tracker_config(config))
        env_trackers[env].load_checked(env_trackers[env].check_state_dict(env_state, where))
    moved_at = integer(state.get("bound_moved_at", 0), join(path, "bound_moved_at"), 0, step)
    state_checks.check_digests(state, path)
    return SinkState(step, restored, window, tuple(invalid), totals, policy_state, tracker, env_trackers, moved_at)


def report_to_dict(report: StepReport) -> dict[str, Any]:
    return {
        "step": report.step,
        "max_staleness": report.max_staleness,
        "metrics": dict(report.metrics),
        "tally": tally_to_dict(report.tally),
        "env_metrics": {env: dict(values) for env, values in report.env_metrics.items()},
        "env_tally": {env: tally_to_dict(tally) for env, tally in report.env_tally.items()},
        "mismatch": None if report.mismatch is None else report.mismatch.to_dict(),
        "env_mismatch": {env: sums.to_dict() for env, sums in report.env_mismatch.items()},
    }


def check_mismatch(data: Any, path: str) -> MismatchSums:
    try:
        return MismatchSums.from_dict(data)
    except ValueError as exc:
        fail(path, str(exc))


def check_metrics(data: Any, path: str) -> dict[str, MetricValue]:
    """A metrics dict: numbers by key, and SPEC 14's floor source."""
    out: dict[str, MetricValue] = {}
    for key, value in mapping(data, path).items():
        if str(key).endswith("/floor_source"):  # SPEC 14's one string value
            if value not in FLOOR_SOURCES:
                sources = ", ".join(FLOOR_SOURCES)
                fail(join(path, str(key)), f"expected one of {sources}, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(join(path, str(key)), f"expected a number, got {state_checks.kind_of(value)}")
        out[string(key, path)] = value
    return out


def check_report(data: Any, path: str) -> StepReport:
    required = ("step", "max_staleness", "metrics", "tally", "env_metrics", "env_tally", "mismatch")
    found = keys(data, path, required, ("env_mismatch",))  # (absent from reports saved before it)
    per_env_keys = ("env_mismatch", "env_metrics", "env_tally")
    envs = {key: mapping(found.get(key, {}), join(path, key)) for key in per_env_keys}

    def per_env(key: str, check: Callable[[Any, str], Any]) -> dict[str, Any]:
        at = join(path, key)
        return {string(env, at): check(value, join(at, env)) for env, value in envs[key].items()}

    return StepReport(
        step=integer(found["step"], join(path, "step"), 1, MAX_STEP),
        max_staleness=integer(found["max_staleness"], join(path, "max_staleness"), 0),
        metrics=check_metrics(found["metrics"], join(path, "metrics")),
        tally=check_tally(found["tally"], join(path, "tally")),
        env_metrics=per_env("env_metrics", check_metrics),
        env_tally=per_env("env_tally", check_tally),
        mismatch=None if found["mismatch"] is None else check_mismatch(found["mismatch"], join(path, "mismatch")),
        env_mismatch=per_env("env_mismatch", check_mismatch),
    )
