"""Checkpoints of a sink (and a monitor) as plain JSON-serialisable data (SPEC 13).

A checkpoint holds everything later ships depend on: the queued rollouts (their rows in the sink's
tables and the arrays they arrived in), every id seen in the run, groups, envs, the open window, the
last step, the cumulative tallies and the policy's own state. It is built from ints, floats, strings,
booleans, None, lists and dicts only, so it goes into ``json.dump`` or a trainer's ``torch.save``.

Tables and batches are written by column name, generically: a column added to a table or a field added
to :class:`~staleness_metrics.columnar.RolloutBatch` is saved without a change here, and a checkpoint
missing a column the sink now has is refused by name rather than loaded wrongly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .columnar import RolloutBatch
from .config import StalenessConfig
from .errors import ConfigError, TraceError
from .metrics import WindowCounts
from .mismatch import MismatchSums
from .report import StepReport, Tally
from .table import Table

if TYPE_CHECKING:
    from .sink import Sink

__all__ = [
    "FORMAT",
    "JUDGING_SETTINGS",
    "check_config",
    "check_format",
    "decode_array",
    "encode_array",
    "load_sink",
    "report_from_dict",
    "report_to_dict",
    "save_sink",
    "tally_from_dict",
    "tally_to_dict",
]

FORMAT = 1
# The settings that decide what a policy does: a checkpoint only loads into a sink judging the same way.
# ``strict`` and ``env_breakdown`` change how input is read and reported, not the state, so they may differ.
JUDGING_SETTINGS = ("policy", "max_staleness", "max_token_staleness", "sync_interval", "retry_expired")


def check_format(state: Mapping[str, Any], what: str) -> None:
    """Refuse a checkpoint of another format version, or something that is not one."""
    if not isinstance(state, Mapping) or "format" not in state:
        raise ConfigError(f"checkpoint: not a {what} checkpoint (no 'format' field)")
    if state["format"] != FORMAT:
        raise ConfigError(
            f"checkpoint: unknown {what} checkpoint format {state['format']!r} (this version reads format {FORMAT})"
        )


def check_config(saved: Mapping[str, Any], config: StalenessConfig) -> None:
    """Refuse a checkpoint taken under another policy or bound, naming both sides."""
    differs = [name for name in JUDGING_SETTINGS if saved.get(name) != getattr(config, name)]
    if differs:
        theirs = ", ".join(f"{name}={saved.get(name)!r}" for name in differs)
        ours = ", ".join(f"{name}={getattr(config, name)!r}" for name in differs)
        raise ConfigError(f"checkpoint: saved with {theirs}, but this sink has {ours}")


# ---------------------------------------------------------------------- values
def encode_array(values: npt.NDArray[Any]) -> dict[str, Any]:
    """An array as ``{"dtype", "data"}``, exactly. JSON has no NaN or infinity: non-finite floats (NaN means
    "missing" in ``trainer_logprobs``) are written as 0 with their positions listed beside."""
    out: dict[str, Any] = {"dtype": values.dtype.str}
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        for name, where in (
            ("nan", np.isnan(values)),
            ("posinf", np.isposinf(values)),
            ("neginf", np.isneginf(values)),
        ):
            if where.any():
                out[name] = np.flatnonzero(where).tolist()
        values = np.where(np.isfinite(values), values, 0)
    out["data"] = values.tolist()
    return out


def decode_array(encoded: Mapping[str, Any]) -> npt.NDArray[Any]:
    values = np.asarray(encoded["data"], dtype=np.dtype(encoded["dtype"]))
    for name, fill in (("nan", np.nan), ("posinf", np.inf), ("neginf", -np.inf)):
        if name in encoded:
            values[np.asarray(encoded[name], dtype=np.int64)] = fill
    return values


def _encode_value(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return {"array": encode_array(value)}
    if isinstance(value, dict):
        return {"dict": {key: _encode_value(item) for key, item in value.items()}}
    if isinstance(value, (list, tuple)):
        return {"list": list(value)}
    return {"value": value}


def _decode_value(encoded: Mapping[str, Any]) -> Any:
    if "array" in encoded:
        return decode_array(encoded["array"])
    if "dict" in encoded:
        return {key: _decode_value(item) for key, item in encoded["dict"].items()}
    if "list" in encoded:
        return list(encoded["list"])
    return encoded["value"]


def encode_batch(batch: RolloutBatch) -> dict[str, Any]:
    """Every field of a batch, by name (arrays with their dtype)."""
    return {f.name: _encode_value(getattr(batch, f.name)) for f in dataclasses.fields(batch)}


def decode_batch(encoded: Mapping[str, Any]) -> RolloutBatch:
    known = {f.name for f in dataclasses.fields(RolloutBatch)}
    unknown = sorted(set(encoded) - known)
    if unknown:
        raise ConfigError(f"checkpoint: rollout batch field {unknown[0]!r} is unknown to this version")
    return RolloutBatch(**{name: _decode_value(value) for name, value in encoded.items()})


def encode_table(table: Table) -> dict[str, Any]:
    return {name: encode_array(table[name]) for name in table.names}


def decode_table(encoded: Mapping[str, Any], like: Table, what: str) -> Table:
    """A table with the columns of ``like`` filled from ``encoded``; a column missing either way is an error."""
    missing = sorted(set(like.names) - set(encoded))
    extra = sorted(set(encoded) - set(like.names))
    if missing or extra:
        name = (missing or extra)[0]
        side = "lacks" if missing else "has an unknown"
        raise ConfigError(f"checkpoint: the {what} table {side} column {name!r}")
    table = Table(**{name: like[name].dtype for name in like.names})
    columns = {name: decode_array(encoded[name]) for name in like.names}
    if columns and len(next(iter(columns.values()))):
        table.append(**columns)
    return table


def tally_to_dict(tally: Tally) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(tally):
        value = getattr(tally, f.name)
        out[f.name] = value.tolist() if isinstance(value, np.ndarray) else value
    return out


def tally_from_dict(data: Mapping[str, Any]) -> Tally:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Tally):
        if f.name not in data:
            continue  # a counter added later starts at zero
        value = data[f.name]
        values[f.name] = np.asarray(value, dtype=np.int64) if isinstance(value, list) else value
    return Tally(**values)


def _window_to_dict(window: WindowCounts) -> dict[str, Any]:
    """Every attribute of the window, generically: per-env dicts as ``[env, value]`` pairs, lists as lists."""
    out: dict[str, Any] = {}
    for name, value in vars(window).items():
        if isinstance(value, dict):
            out[name] = {"per_env": [[int(env), _encode_value(item)] for env, item in sorted(value.items())]}
        else:
            out[name] = {"list": [list(item) if isinstance(item, tuple) else item for item in value]}
    return out


def _window_from_dict(data: Mapping[str, Any]) -> WindowCounts:
    window = WindowCounts()
    expected = set(vars(window))
    if set(data) != expected:
        name = sorted(set(data) ^ expected)[0]
        raise ConfigError(f"checkpoint: the window's {name!r} is {'unknown' if name in data else 'missing'}")
    for name, encoded in data.items():
        if "per_env" in encoded:
            setattr(window, name, {int(env): _decode_value(item) for env, item in encoded["per_env"]})
        else:
            items = encoded["list"]
            setattr(window, name, [tuple(item) if isinstance(item, list) else item for item in items])
    return window


# ---------------------------------------------------------------------- the sink
def save_sink(sink: Sink) -> dict[str, Any]:
    """The sink's state (it forgets what already left first: that changes no later answer)."""
    sink._compact()
    chunks = sink._chunks
    envs = sorted(sink._env_index.items(), key=lambda item: item[1])
    return {
        "format": FORMAT,
        "config": dataclasses.asdict(sink.config),
        "step": sink._step,
        "queued": sink._queued,
        "tokens_entered": sink.tokens_entered,
        "tables": {
            "rollouts": encode_table(sink._rollouts),
            "samples": encode_table(sink._samples),
            "spans": encode_table(sink._spans),
        },
        "ids": list(sink._ids),
        "seen_ids": sorted(sink._seen_ids),
        "chunks": [None if batch is None else encode_batch(batch) for batch in chunks],
        "chunk_open": list(sink._chunk_open),
        "groups": sorted(sink._groups.items(), key=lambda item: item[1]),
        "group_agentic": sink._group_agentic[: sink._n_groups].tolist(),
        "n_groups": sink._n_groups,
        "envs": [name for name, _ in envs],
        "window": _window_to_dict(sink._window),
        "invalid": [[e.rollout_id, e.field, e.reason] for e in sink._invalid],
        "totals": tally_to_dict(sink.totals),
        "policy": sink.policy.state_dict(),
    }


def load_sink(sink: Sink, state: Mapping[str, Any]) -> None:
    """Replace the sink's state with a checkpoint's (see :func:`save_sink`)."""
    check_format(state, "sink")
    check_config(state["config"], sink.config)
    tables = state["tables"]
    rollouts = decode_table(tables["rollouts"], sink._rollouts, "rollouts")
    samples = decode_table(tables["samples"], sink._samples, "samples")
    spans = decode_table(tables["spans"], sink._spans, "spans")
    sink._rollouts, sink._samples, sink._spans = rollouts, samples, spans
    sink._step = int(state["step"])
    sink._queued = int(state["queued"])
    sink.tokens_entered = int(state["tokens_entered"])
    sink._ids = [str(rid) for rid in state["ids"]]
    sink._row_of = {rid: row for row, rid in enumerate(sink._ids)}
    sink._seen_ids = set(state["seen_ids"])
    sink._chunks = [None if c is None else decode_batch(c) for c in state["chunks"]]
    sink._chunk_open = [int(n) for n in state["chunk_open"]]
    sink._closing = [
        c for c, (batch, n) in enumerate(zip(sink._chunks, sink._chunk_open)) if n == 0 and batch is not None
    ]
    sink._groups = {str(name): int(index) for name, index in state["groups"]}
    sink._n_groups = int(state["n_groups"])
    agentic = np.zeros(max(16, 2 * sink._n_groups), dtype=bool)
    agentic[: sink._n_groups] = np.asarray(state["group_agentic"], dtype=bool)
    sink._group_agentic = agentic
    names: list[str | None] = list(state["envs"])
    sink._env_index = {name: index for index, name in enumerate(names)}
    sink._env_names = {index: name or "" for index, name in enumerate(names)}
    sink._window = _window_from_dict(state["window"])
    sink._invalid = [TraceError(rid, field, reason) for rid, field, reason in state["invalid"]]
    sink.totals = tally_from_dict(state["totals"])
    sink.policy.load_state_dict(state["policy"])


def report_to_dict(report: StepReport) -> dict[str, Any]:
    return {
        "step": report.step,
        "max_staleness": report.max_staleness,
        "metrics": dict(report.metrics),
        "tally": tally_to_dict(report.tally),
        "env_metrics": {env: dict(values) for env, values in report.env_metrics.items()},
        "env_tally": {env: tally_to_dict(tally) for env, tally in report.env_tally.items()},
        "mismatch": None if report.mismatch is None else report.mismatch.to_dict(),
    }


def report_from_dict(data: Mapping[str, Any]) -> StepReport:
    return StepReport(
        step=int(data["step"]),
        max_staleness=int(data["max_staleness"]),
        metrics=dict(data["metrics"]),
        tally=tally_from_dict(data["tally"]),
        env_metrics={env: dict(values) for env, values in data["env_metrics"].items()},
        env_tally={env: tally_from_dict(tally) for env, tally in data["env_tally"].items()},
        mismatch=None if data.get("mismatch") is None else MismatchSums.from_dict(data["mismatch"]),
    )
