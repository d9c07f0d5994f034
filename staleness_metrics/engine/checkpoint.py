"""Checkpoints of a sink (and a monitor) as plain JSON-serialisable data (SPEC 13).

A checkpoint holds everything later ships depend on: the queued rollouts (their rows in the sink's
tables and the arrays they arrived in), every id seen in the run, groups, envs, the open window, the
last step, the cumulative tallies and the policy's own state. It is built from ints, floats, strings,
booleans, None, lists and dicts only, so it goes into ``json.dump`` or a trainer's ``torch.save``.

Saving never changes the sink: it writes a compacted copy (only the queued rollouts, renumbered), so a
checkpoint may be taken after any call. Loading is all or nothing: :func:`read_sink` checks the whole
state (structure, types, dtypes, ranges, and that ids, rows, chunks, queue and counters agree) while it
builds new objects, and a digest per top-level key catches a value changed to another plausible one.
Only then is anything replaced; a bad state raises :class:`ConfigError` naming the key path and reason.

Tables and batches are written by column name, generically: a column added to a table or a field added
to :class:`~staleness_metrics.records.columnar.RolloutBatch` is saved without a change here, and a checkpoint
missing a column the sink now has is refused by name rather than loaded wrongly.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import numpy.typing as npt
import orjson

from ..config import StalenessConfig
from ..errors import ConfigError, TraceError
from ..metrics.bound import FLOOR_SOURCES, BoundTracker, env_tracker_config
from ..metrics.compute import WindowCounts
from ..metrics.mismatch import MismatchSums
from ..metrics.report import HISTOGRAM_TOP, LENGTH_BUCKETS, MetricValue, StepReport, Tally
from ..records.columnar import LABELS_SPANS, LABELS_TOKENS, PER_POSITION_FLOATS, RolloutBatch
from .decision import NO_MASK
from .segments import expand_ranges
from .spans import PART_LABELLED, PART_UNLABELLED, PART_WHOLE
from .table import Table

if TYPE_CHECKING:
    from .sink import Sink

__all__ = [
    "FORMAT",
    "JUDGING_SETTINGS",
    "check_config",
    "check_digests",
    "check_format",
    "check_metrics",
    "check_report",
    "check_tally",
    "decode_array",
    "digests_of",
    "encode_array",
    "fail",
    "load_sink",
    "read_sink",
    "report_from_dict",
    "report_to_dict",
    "save_sink",
    "tally_from_dict",
    "tally_to_dict",
]

FORMAT = 2
# Format 1 (before digests) still loads: everything is checked but the digests it does not have.
READABLE_FORMATS = (1, 2)
# The settings that decide what a policy does: a checkpoint only loads into a sink judging the same way.
# ``strict`` and ``env_breakdown`` change how input is read and reported, not the state, so they may differ.
JUDGING_SETTINGS = ("policy", "max_staleness", "max_token_staleness", "sync_interval", "retry_expired")
MAX_STEP = 2**53
QUEUED = 0  # the sink's status of a queued rollout (a checkpoint holds queued rollouts only)
NEVER = -1
INT64 = np.dtype(np.int64)


# ---------------------------------------------------------------------- checking helpers
def fail(path: str, reason: str) -> NoReturn:
    """Refuse a checkpoint, naming the key path and the reason."""
    raise ConfigError(f"checkpoint: {path or 'state'}: {reason}")


def join(path: str, key: object) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if key == "":  # rollouts without an env are counted under ""
        return f'{path}[""]'
    return f"{path}.{key}" if path else str(key)


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def mapping(value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        fail(path, f"expected an object, got {_kind(value)}")
    return value


def keys(value: object, path: str, required: Collection[str], optional: Collection[str] = ()) -> Mapping[str, Any]:
    """``value`` as a mapping holding every ``required`` key, and no key outside ``required``/``optional``."""
    found = mapping(value, path)
    for key in required:
        if key not in found:
            fail(join(path, key), "missing")
    for key in found:
        if key not in required and key not in optional:
            fail(join(path, str(key)), "unknown key")
    return found


def integer(value: object, path: str, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        fail(path, f"expected an integer, got {_kind(value)}")
    number = int(value)
    if low is not None and number < low:
        fail(path, f"{number} is below {low}")
    if high is not None and number > high:
        fail(path, f"{number} is above {high}")
    return number


def boolean(value: object, path: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        fail(path, f"expected true or false, got {_kind(value)}")
    return bool(value)


def string(value: object, path: str, optional: bool = False) -> Any:
    if not (isinstance(value, str) or (optional and value is None)):
        fail(path, f"expected a string{' or null' if optional else ''}, got {_kind(value)}")
    return value


def sequence(value: object, path: str, length: int | None = None) -> Sequence[Any]:
    if not isinstance(value, (list, tuple)):
        fail(path, f"expected a list, got {_kind(value)}")
    if length is not None and len(value) != length:
        fail(path, f"{len(value)} entries where {length} are needed")
    return value


def strings(value: object, path: str, optional: bool = False, unique: bool = False) -> list[Any]:
    items = sequence(value, path)
    bad = next((i for i, item in enumerate(items) if not (isinstance(item, str) or (optional and item is None))), None)
    if bad is not None:
        string(items[bad], join(path, bad), optional)
    out = list(items)
    if unique and len(set(out)) != len(out):
        seen: set[Any] = set()
        repeated = next(item for item in out if item in seen or seen.add(item))  # type: ignore[func-returns-value]
        fail(path, f"{repeated!r} appears twice")
    return out


# ---------------------------------------------------------------------- digests
def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    return repr(value)


def _digest(value: Any, path: str) -> str:
    """A hash of ``value``'s canonical JSON (orjson: a tenth of the standard library's time on big arrays;
    the standard library for what orjson refuses, such as integers beyond 64 bits in echoed records)."""
    try:
        text = orjson.dumps(value, default=_plain, option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    except (TypeError, orjson.JSONEncodeError):
        try:
            text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=_plain).encode()
        except (TypeError, ValueError, RecursionError) as exc:
            fail(path, f"not plain data ({exc})")
    return hashlib.blake2b(text, digest_size=16).hexdigest()


def digests_of(state: Mapping[str, Any], skip: Collection[str] = ()) -> dict[str, str]:
    """A digest of each top-level value (but ``skip``): loading checks them, so a value changed after the save
    (by hand, by a damaged file) is refused by its key even where it would look plausible."""
    return {key: _digest(value, key) for key, value in state.items() if key not in skip}


def check_digests(state: Mapping[str, Any], path: str, skip: Collection[str] = ()) -> None:
    """Refuse a format-2 state whose values differ from the digests saved with them (format 1 has none)."""
    if state["format"] == 1:
        return
    saved = keys(state["digests"], join(path, "digests"), [k for k in state if k not in skip and k != "digests"])
    for key, value in state.items():
        if key in skip or key == "digests":
            continue
        if saved[key] != _digest(value, join(path, key)):
            fail(join(path, key), "differs from the digest saved with it: the checkpoint was changed or damaged")


def check_format(state: Any, what: str, path: str = "") -> Mapping[str, Any]:
    """Refuse a checkpoint of another format version, or something that is not one."""
    if not isinstance(state, Mapping) or "format" not in state:
        raise ConfigError(f"checkpoint: {join(path, 'format')}: missing: not a {what} checkpoint (no 'format' field)")
    if isinstance(state["format"], bool) or state["format"] not in READABLE_FORMATS:
        raise ConfigError(
            f"checkpoint: {join(path, 'format')}: unknown {what} checkpoint format {state['format']!r} "
            f"(this version reads formats {', '.join(map(str, READABLE_FORMATS))})"
        )
    return state


def check_config(saved: Any, config: StalenessConfig, path: str = "config") -> None:
    """Refuse a checkpoint taken under another policy or bound, naming both sides."""
    saved = mapping(saved, path)
    differs = [name for name in JUDGING_SETTINGS if saved.get(name) != getattr(config, name)]
    if differs:
        theirs = ", ".join(f"{name}={saved.get(name)!r}" for name in differs)
        ours = ", ".join(f"{name}={getattr(config, name)!r}" for name in differs)
        fail(path, f"saved with {theirs}, but this sink has {ours}")


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


_RAW_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "fiu"}  # what list items may parse as, per target kind
_KIND_NAMES = {"b": "true/false", "i": "integer", "u": "integer", "f": "numeric"}


def decode_array(encoded: Any, path: str = "array", dtype: npt.DTypeLike | None = None) -> npt.NDArray[Any]:
    """The array of :func:`encode_array`; ``dtype`` is the one it must have (else any flat numeric one)."""
    found = keys(encoded, path, ("dtype", "data"), ("nan", "posinf", "neginf"))
    name = string(found["dtype"], join(path, "dtype"))
    try:
        target = np.dtype(name)
    except (TypeError, ValueError):
        fail(join(path, "dtype"), f"{name!r} is not a numpy dtype")
    if dtype is not None and target != np.dtype(dtype):
        fail(join(path, "dtype"), f"{name!r} where {np.dtype(dtype).str!r} is kept")
    if target.kind not in _RAW_KINDS or target.itemsize not in (1, 2, 4, 8) or target.shape:
        fail(join(path, "dtype"), f"{name!r} is not a numeric dtype")
    data = sequence(found["data"], join(path, "data"))
    try:
        raw = np.asarray(data) if len(data) else np.zeros(0, dtype=target)
    except (TypeError, ValueError, OverflowError):
        fail(join(path, "data"), f"expected a flat list of {_KIND_NAMES[target.kind]} values")
    if raw.ndim != 1 or (raw.dtype.kind not in _RAW_KINDS[target.kind] and len(raw)):
        fail(join(path, "data"), f"expected a flat list of {_KIND_NAMES[target.kind]} values")
    if target.kind in "iu" and len(raw):
        info = np.iinfo(target)
        low, high = int(raw.min()), int(raw.max())
        if low < info.min or high > info.max:
            fail(join(path, "data"), f"{low if low < info.min else high} does not fit {name!r}")
    values = raw.astype(target)
    for key, fill in (("nan", np.nan), ("posinf", np.inf), ("neginf", -np.inf)):
        if key in found:
            if target.kind != "f":
                fail(join(path, key), "only float arrays have non-finite values")
            where = sequence(found[key], join(path, key))
            positions = [integer(p, join(join(path, key), i), 0, len(values) - 1) for i, p in enumerate(where)]
            values[np.asarray(positions, dtype=np.int64)] = fill
    return values


def _encode_value(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return {"array": encode_array(value)}
    if isinstance(value, dict):
        return {"dict": {key: _encode_value(item) for key, item in value.items()}}
    if isinstance(value, (list, tuple)):
        items = list(value)
        if items and isinstance(items[0], (dict, list)):  # echo records: the state shares nothing with the sink
            items = copy.deepcopy(items)
        return {"list": items}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # the padded layout
        return {"fields": dataclasses.asdict(value)}
    return {"value": value}


def _decode_value(encoded: Any, path: str, wanted: str) -> Any:
    """One encoded batch field of the form ``wanted`` ("array", "list", "dict", "fields"), or ``{"value": null}``."""
    found = mapping(encoded, path)
    if len(found) != 1 or next(iter(found)) not in (wanted, "value"):
        fail(path, f"expected {{{wanted!r}: ...}} or {{'value': null}}, got the keys {sorted(map(str, found))}")
    if "value" in found:
        if found["value"] is not None:
            fail(join(path, "value"), f"expected null, got {_kind(found['value'])}")
        return None
    return found[wanted]


def encode_batch(batch: RolloutBatch) -> dict[str, Any]:
    """Every field of a batch, by name (arrays with their dtype)."""
    return {f.name: _encode_value(getattr(batch, f.name)) for f in dataclasses.fields(batch)}


_BATCH_FORMS = {
    "ids": "list", "group_ids": "list", "envs": "list", "echo": "list", "present": "dict", "padded": "fields",
}  # fmt: skip
_BATCH_INTS = ("sample_offsets", "position_offsets", "dispatch_version", "completion_version", "token_versions",
               "span_offsets", "span_versions", "span_starts")  # fmt: skip
_BATCH_OPTIONAL = {"completion_version", "frozen", "agentic", "group_ids", "envs", "token_versions", "span_offsets",
                   "span_versions", "span_starts", "label_kind", "echo", "padded", *PER_POSITION_FLOATS}  # fmt: skip


def _offsets(values: npt.NDArray[np.int64], path: str, length: int, end: int) -> None:
    """``values`` are ``length`` offsets from 0 to ``end``, never decreasing."""
    if len(values) != length:
        fail(path, f"{len(values)} offsets where {length} are needed")
    if values[0] != 0 or values[-1] != end or (np.diff(values) < 0).any():
        fail(path, f"offsets must rise from 0 to {end}")


def decode_batch(encoded: Any, path: str = "batch") -> RolloutBatch:
    """The batch of :func:`encode_batch`, checked: every length and offset agrees, so no write can stray."""
    names = [f.name for f in dataclasses.fields(RolloutBatch)]
    found = keys(encoded, path, names)
    raw: dict[str, Any] = {}
    for name in names:
        where = join(path, name)
        form = _BATCH_FORMS.get(name, "array")
        value = _decode_value(found[name], where, form)
        if value is None:
            if name not in _BATCH_OPTIONAL:
                fail(where, "missing (null)")
        elif form == "array":
            value = decode_array(value, join(where, "array"), INT64 if name in _BATCH_INTS else None)
        elif name == "present":
            present = mapping(value, join(where, "dict"))
            value = {}
            for key, item in present.items():
                if key not in PER_POSITION_FLOATS:
                    fail(join(join(where, "dict"), str(key)), "unknown array")
                item = _decode_value(item, join(join(where, "dict"), key), "array")
                value[key] = decode_array(item, join(join(join(where, "dict"), key), "array"), np.bool_)
        elif name == "padded":
            fields_ = keys(value, join(where, "fields"), ("rows", "width"))
            from ..records.padded import PaddedLayout

            value = PaddedLayout(
                integer(fields_["rows"], join(where, "fields.rows"), 0),
                integer(fields_["width"], join(where, "fields.width"), 0),
            )
        elif name == "echo":
            records = sequence(value, join(where, "list"))
            for i, record in enumerate(records):
                mapping(record, join(join(where, "list"), i))
            value = copy.deepcopy(list(records))
        else:
            value = strings(value, join(where, "list"), optional=name != "ids")
        raw[name] = value
    n_rollouts = len(raw["ids"])
    if len(raw["position_offsets"]) == 0:
        fail(join(path, "position_offsets"), "at least one offset is needed")
    _offsets(raw["position_offsets"], join(path, "position_offsets"), len(raw["position_offsets"]), len(raw["mask"]))
    n_samples = len(raw["position_offsets"]) - 1
    n_positions = len(raw["mask"])
    _offsets(raw["sample_offsets"], join(path, "sample_offsets"), n_rollouts + 1, n_samples)
    for name in ("dispatch_version", "completion_version", "frozen", "agentic", "group_ids", "envs", "echo"):
        if raw[name] is not None and len(raw[name]) != n_rollouts:
            fail(join(path, name), f"{len(raw[name])} entries for {n_rollouts} rollouts")
    for name in ("frozen", "agentic"):
        if raw[name] is not None and raw[name].dtype != np.bool_:
            fail(join(path, name), "expected a bool array")
    for name in ("token_versions", *PER_POSITION_FLOATS):
        if raw[name] is not None and len(raw[name]) != n_positions:
            fail(join(path, name), f"{len(raw[name])} entries for {n_positions} positions")
        if raw[name] is not None and name not in raw["present"] and name != "token_versions":
            fail(join(path, "present"), f"lacks {name!r}")
    for name, values in raw["present"].items():
        if len(values) != n_samples:
            fail(join(path, f"present.{name}"), f"{len(values)} entries for {n_samples} samples")
    spans = [raw[name] is None for name in ("span_offsets", "span_versions", "span_starts")]
    if any(spans) and not all(spans):
        fail(join(path, "span_offsets"), "span offsets, versions and starts go together")
    if not any(spans):
        n_spans = len(raw["span_versions"])
        _offsets(raw["span_offsets"], join(path, "span_offsets"), n_samples + 1, n_spans)
        if len(raw["span_starts"]) != n_spans:
            fail(join(path, "span_starts"), f"{len(raw['span_starts'])} entries for {n_spans} spans")
    kind = raw["label_kind"]
    if kind is not None:
        if kind.dtype != np.int8 or len(kind) != n_samples:
            fail(join(path, "label_kind"), f"expected {n_samples} int8 entries")
        if ((kind < 0) | (kind > LABELS_TOKENS)).any():
            fail(join(path, "label_kind"), "values are 0 (none), 1 (spans) or 2 (token versions)")
        if (kind == LABELS_SPANS).any() and raw["span_offsets"] is None:
            fail(join(path, "label_kind"), "a sample labelled by spans, in a batch without spans")
        if (kind == LABELS_TOKENS).any() and raw["token_versions"] is None:
            fail(join(path, "label_kind"), "a sample labelled per token, in a batch without token versions")
    try:
        return RolloutBatch(**raw)
    except (TypeError, ValueError) as exc:  # pragma: no cover - every field was checked above
        fail(path, str(exc))


def encode_table(table: Table) -> dict[str, Any]:
    return {name: encode_array(table[name]) for name in table.names}


def decode_table(encoded: Any, like: Table, path: str) -> Table:
    """A table with the columns (and dtypes) of ``like`` filled from ``encoded``, all of one length."""
    found = mapping(encoded, path)
    missing = sorted(set(like.names) - set(found))
    extra = sorted(set(found) - set(like.names), key=str)
    if missing or extra:
        name = (missing or extra)[0]
        fail(join(path, str(name)), f"the table {'lacks this column' if missing else 'has no such column'}")
    columns = {name: decode_array(found[name], join(path, name), like[name].dtype) for name in like.names}
    lengths = {len(values) for values in columns.values()}
    if len(lengths) > 1:
        name = next(name for name, values in columns.items() if len(values) != len(columns[like.names[0]]))
        fail(join(path, name), f"{len(columns[name])} rows where the other columns have {len(columns[like.names[0]])}")
    table = Table(**{name: like[name].dtype for name in like.names})
    if columns and len(next(iter(columns.values()))):
        table.append(**columns)
    return table


def tally_to_dict(tally: Tally) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(tally):
        value = getattr(tally, f.name)
        out[f.name] = value.tolist() if isinstance(value, np.ndarray) else value
    return out


_TALLY_ARRAY_LENGTHS = {
    "token_histogram": HISTOGRAM_TOP + 1,
    "rollout_histogram": HISTOGRAM_TOP + 1,
    "length_sampled": len(LENGTH_BUCKETS),
    "length_removed": len(LENGTH_BUCKETS),
}


def check_tally(data: Any, path: str) -> Tally:
    """A :class:`Tally` from :func:`tally_to_dict`, every counter present and non-negative."""
    names = [f.name for f in dataclasses.fields(Tally)]
    found = keys(data, path, names)
    values: dict[str, Any] = {}
    for name in names:
        where = join(path, name)
        if name in _TALLY_ARRAY_LENGTHS:
            items = sequence(found[name], where)
            if len(items) > _TALLY_ARRAY_LENGTHS[name]:
                fail(where, f"{len(items)} buckets, more than the {_TALLY_ARRAY_LENGTHS[name]} there are")
            values[name] = np.asarray([integer(v, join(where, i), 0) for i, v in enumerate(items)], dtype=np.int64)
        else:
            values[name] = integer(found[name], where, 0)
    return Tally(**values)


def tally_from_dict(data: Mapping[str, Any], path: str = "tally") -> Tally:
    return check_tally(data, path)


def _window_to_dict(window: WindowCounts) -> dict[str, Any]:
    """Every attribute of the window, generically: per-env dicts as ``[env, value]`` pairs, lists as lists."""
    out: dict[str, Any] = {}
    for name, value in vars(window).items():
        if isinstance(value, dict):
            out[name] = {"per_env": [[int(env), _encode_value(item)] for env, item in sorted(value.items())]}
        else:
            out[name] = {"list": [list(item) if isinstance(item, tuple) else item for item in value]}
    return out


def _window_from_dict(data: Any, path: str, n_envs: int) -> WindowCounts:
    window = WindowCounts()
    found = keys(data, path, list(vars(window)))
    per_env: dict[str, dict[int, Any]] = {}
    for name in ("counts", "dropped_lengths"):
        where = join(join(path, name), "per_env")
        pairs = sequence(keys(found[name], join(path, name), ("per_env",))["per_env"], where)
        per_env[name] = {}
        for i, pair in enumerate(pairs):
            env, value = sequence(pair, join(where, i), 2)
            env = integer(env, join(join(where, i), 0), 0, n_envs - 1)
            if env in per_env[name]:
                fail(join(where, i), f"env {env} appears twice")
            item = join(join(where, i), 1)
            if name == "counts":
                counts = keys(keys(value, item, ("dict",))["dict"], join(item, "dict"), WindowCounts.FIELDS)
                per_env[name][env] = {
                    field: integer(keys(counts[field], join(item, f"dict.{field}"), ("value",))["value"],
                                   join(item, f"dict.{field}.value"), 0)
                    for field in WindowCounts.FIELDS
                }  # fmt: skip
            else:
                array = decode_array(keys(value, item, ("array",))["array"], join(item, "array"), INT64)
                if len(array) != len(LENGTH_BUCKETS) or (array < 0).any():
                    fail(join(item, "array"), f"expected {len(LENGTH_BUCKETS)} non-negative counts")
                per_env[name][env] = array
    window.counts = per_env["counts"]
    window.dropped_lengths = per_env["dropped_lengths"]
    lists = {name: sequence(keys(found[name], join(path, name), ("list",))["list"], join(path, f"{name}.list"))
             for name in ("dropped_rollouts", "dropped_samples", "held")}  # fmt: skip
    window.dropped_rollouts = strings(lists["dropped_rollouts"], join(path, "dropped_rollouts.list"))
    window.held = strings(lists["held"], join(path, "held.list"))
    samples = []
    for i, pair in enumerate(lists["dropped_samples"]):
        where = join(join(path, "dropped_samples.list"), i)
        rid, local = sequence(pair, where, 2)
        samples.append((string(rid, join(where, 0)), integer(local, join(where, 1), 0)))
    window.dropped_samples = samples
    return window


# ---------------------------------------------------------------------- the sink
SINK_KEYS = (
    "format", "config", "step", "queued", "tokens_entered", "tables", "ids", "seen_ids", "chunks", "chunk_open",
    "groups", "group_agentic", "n_groups", "envs", "window", "invalid", "totals", "policy",
)  # fmt: skip


def save_sink(sink: Sink) -> dict[str, Any]:
    """The sink's state: a compacted copy (the queued rollouts only, renumbered); the sink is left as it was."""
    rollouts, samples, spans, chunks, chunk_open, ids = sink._compacted()
    envs = sorted(sink._env_index.items(), key=lambda item: item[1])
    state: dict[str, Any] = {
        "format": FORMAT,
        "config": dataclasses.asdict(sink.config),
        "step": sink._step,
        "queued": sink._queued,
        "tokens_entered": sink.tokens_entered,
        "tables": {
            "rollouts": encode_table(rollouts),
            "samples": encode_table(samples),
            "spans": encode_table(spans),
        },
        "ids": ids,
        "seen_ids": sorted(sink._seen_ids),
        "chunks": [encode_batch(batch) for batch in chunks if batch is not None],  # a queued rollout's never is
        "chunk_open": chunk_open,
        "groups": [list(item) for item in sorted(sink._groups.items(), key=lambda item: item[1])],
        "group_agentic": sink._group_agentic[: sink._n_groups].tolist(),
        "n_groups": sink._n_groups,
        "envs": [name for name, _ in envs],
        "window": _window_to_dict(sink._window),
        "invalid": [[e.rollout_id, e.field, e.reason] for e in sink._invalid],
        "totals": tally_to_dict(sink.totals),
        "policy": sink.policy.state_dict(),
        "bound": sink.bound_tracker.state_dict(),
        "bound_envs": {env: tracker.state_dict() for env, tracker in sorted(sink.env_trackers.items())},
    }
    state["digests"] = digests_of(state)
    return state


def _per_row(values: Sequence[Any], rows: npt.NDArray[np.int64]) -> list[Any]:
    return [values[i] for i in rows.tolist()]


def read_sink(sink: Sink, state: Any, path: str = "") -> tuple[dict[str, Any], Mapping[str, Any]]:
    """Check a sink state and build what it holds as new objects: the sink's attributes by name, and the policy's
    checked state. Nothing of ``sink`` is changed (its tables only lend their column dtypes)."""
    check_format(state, "sink", path)
    # "bound", "bound_envs": SPEC 14's trackers, the batch's and each env's (absent before SPEC 14)
    state = keys(state, path, SINK_KEYS, ("digests", "bound", "bound_envs"))
    if state["format"] != 1 and "digests" not in state:
        fail(join(path, "digests"), "missing")
    check_config(state["config"], sink.config, join(path, "config"))
    step = integer(state["step"], join(path, "step"), 0, MAX_STEP)
    tables = keys(state["tables"], join(path, "tables"), ("rollouts", "samples", "spans"))
    r = decode_table(tables["rollouts"], sink._rollouts, join(path, "tables.rollouts"))
    s = decode_table(tables["samples"], sink._samples, join(path, "tables.samples"))
    n = decode_table(tables["spans"], sink._spans, join(path, "tables.spans"))
    rows, where_r, where_s, where_n = (
        len(r),
        join(path, "tables.rollouts"),
        join(path, "tables.samples"),
        join(path, "tables.spans"),
    )
    ids = strings(state["ids"], join(path, "ids"), unique=True)
    if len(ids) != rows:
        fail(join(path, "ids"), f"{len(ids)} ids for {rows} rollout rows")
    queued = integer(state["queued"], join(path, "queued"), 0)
    if queued != rows:
        fail(join(path, "queued"), f"{queued}, but the checkpoint holds {rows} queued rollouts")
    seen = strings(state["seen_ids"], join(path, "seen_ids"), unique=True)
    seen_ids = set(seen)
    if not seen_ids.issuperset(ids):
        fail(join(path, "seen_ids"), f"lacks the queued id {next(i for i in ids if i not in seen_ids)!r}")

    where = join(path, "chunks")
    chunks = [decode_batch(c, join(where, i)) for i, c in enumerate(sequence(state["chunks"], where))]
    open_ = sequence(state["chunk_open"], join(path, "chunk_open"), len(chunks))
    chunk_open = [integer(v, join(join(path, "chunk_open"), i), 1) for i, v in enumerate(open_)]

    n_groups = integer(state["n_groups"], join(path, "n_groups"), 0)
    agentic = sequence(state["group_agentic"], join(path, "group_agentic"), n_groups)
    group_agentic = np.zeros(max(16, 2 * n_groups), dtype=bool)
    group_agentic[:n_groups] = [boolean(v, join(join(path, "group_agentic"), i)) for i, v in enumerate(agentic)]
    groups: dict[str, int] = {}
    for i, pair in enumerate(sequence(state["groups"], join(path, "groups"))):
        name, index = sequence(pair, join(join(path, "groups"), i), 2)
        name = string(name, join(join(join(path, "groups"), i), 0))
        index = integer(index, join(join(join(path, "groups"), i), 1), 0, n_groups - 1)
        if name in groups:
            fail(join(join(path, "groups"), i), f"group {name!r} appears twice")
        groups[name] = index
    if len(set(groups.values())) != len(groups):
        fail(join(path, "groups"), "two group names share an index")
    envs = strings(state["envs"], join(path, "envs"), optional=True, unique=True)
    if not envs or envs[0] is not None:
        fail(join(path, "envs"), "the first env is null (rollouts without one)")

    # Rollout rows: queued, each one rollout of a chunk, agreeing with what that chunk says of it.
    status = r["status"]
    if (status != QUEUED).any():
        fail(join(where_r, "status"), "a checkpoint holds queued rollouts only")
    chunk, index = r["chunk"], r["index"]
    if ((chunk < 0) | (chunk >= len(chunks))).any():
        fail(join(where_r, "chunk"), f"values are chunk numbers, 0..{len(chunks) - 1}")
    if np.bincount(chunk, minlength=len(chunks)).tolist() != chunk_open:
        fail(join(path, "chunk_open"), "does not count the queued rollouts of each chunk")
    for name, values, high in (("judged", r["judged"], step), ("group", r["group"], n_groups - 1),
                               ("env", r["env"], len(envs) - 1)):  # fmt: skip
        low = NEVER if name == "judged" else 0
        if rows and (int(values.min()) < low or int(values.max()) > high):
            fail(join(where_r, name), f"values lie in {low}..{high}")
    _offsets(np.concatenate((r["sample_lo"][:1], r["sample_hi"])) if rows else np.zeros(1, dtype=np.int64),
             join(where_r, "sample_hi"), rows + 1, len(s))  # fmt: skip
    if (r["sample_lo"][1:] != r["sample_hi"][:-1]).any():
        fail(join(where_r, "sample_lo"), "each rollout's samples start where the previous one's end")
    sample_owner = np.repeat(np.arange(rows), r["sample_hi"] - r["sample_lo"])
    if not np.array_equal(s["rollout"], sample_owner):
        fail(join(where_s, "rollout"), "does not name the rollout row each sample belongs to")
    expected_local = np.arange(len(s)) - r["sample_lo"][sample_owner]
    if not np.array_equal(s["local"], expected_local):
        fail(join(where_s, "local"), "samples are numbered 0, 1, ... within their rollout")
    sample_in_batch = np.zeros(len(s), dtype=np.int64)
    position_lo = np.zeros(len(s), dtype=np.int64)
    position_hi = np.zeros(len(s), dtype=np.int64)
    has_tokens = np.zeros(len(s), dtype=bool)
    seen_pairs: set[tuple[int, int]] = set()
    # Rows and samples grouped by chunk once (stable: in row order), not one scan of all rows per chunk.
    row_order = np.argsort(chunk, kind="stable")
    row_bounds = np.searchsorted(chunk[row_order], np.arange(len(chunks) + 1))
    sample_chunk = chunk[sample_owner]
    sample_order = np.argsort(sample_chunk, kind="stable")
    sample_bounds = np.searchsorted(sample_chunk[sample_order], np.arange(len(chunks) + 1))
    for c, batch in enumerate(chunks):
        mine = row_order[row_bounds[c] : row_bounds[c + 1]]
        k = index[mine]
        if ((k < 0) | (k >= batch.n_rollouts)).any():
            fail(join(where_r, "index"), f"chunk {c} holds rollouts 0..{batch.n_rollouts - 1}")
        if len(np.unique(k)) != len(k):
            fail(join(where_r, "index"), f"one rollout of chunk {c} is queued twice")
        seen_pairs.update(zip([c] * len(k), k.tolist()))
        assert batch.frozen is not None and batch.group_ids is not None and batch.envs is not None
        assert batch.label_kind is not None
        checks = (
            ("id", _per_row(batch.ids, k), _per_row(ids, mine)),
            ("frozen", batch.frozen[k].tolist(), r["frozen"][mine].tolist()),
            ("dispatch", batch.dispatch_version[k].tolist(), r["dispatch"][mine].tolist()),
            ("env", _per_row(batch.envs, k), [envs[e] for e in r["env"][mine].tolist()]),
            ("sample_hi", np.diff(batch.sample_offsets)[k].tolist(), (r["sample_hi"] - r["sample_lo"])[mine].tolist()),
        )
        for name, theirs, ours in checks:
            if theirs != ours:
                row = int(mine[next(i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b)])
                key = "ids" if name == "id" else f"tables.rollouts.{name}"
                fail(join(path, key), f"row {row} disagrees with rollout {int(index[row])} of chunk {c}")
        for row, name in zip(mine.tolist(), _per_row(batch.group_ids, k)):
            if name is not None and groups.get(name) != int(r["group"][row]):
                fail(join(where_r, "group"), f"row {row} is not in the group of {name!r}")
        owned = sample_order[sample_bounds[c] : sample_bounds[c + 1]]
        sample_in_batch[owned] = batch.sample_offsets[index[sample_owner[owned]]] + s["local"][owned]
        position_lo[owned] = batch.position_offsets[sample_in_batch[owned]]
        position_hi[owned] = batch.position_offsets[sample_in_batch[owned] + 1]
        has_tokens[owned] = batch.token_versions is not None
        if not np.array_equal(s["label_kind"][owned], batch.label_kind[sample_in_batch[owned]]):
            fail(join(where_s, "label_kind"), f"disagrees with chunk {c}")
        mask = batch.mask[expand_ranges(position_lo[owned], position_hi[owned])]
        if ((mask != 0) & (mask != 1)).any():
            fail(join(join(where, c), "mask"), "the mask values of queued rollouts are 0 or 1")

    # Samples and spans: spans tile each sample's rows and stay inside its positions in the batch.
    _offsets(np.concatenate((s["span_lo"][:1], s["span_hi"])) if len(s) else np.zeros(1, dtype=np.int64),
             join(where_s, "span_hi"), len(s) + 1, len(n))  # fmt: skip
    if (s["span_lo"][1:] != s["span_hi"][:-1]).any():
        fail(join(where_s, "span_lo"), "each sample's spans start where the previous one's end")
    if ((s["mask_below"] < NO_MASK) | (s["mask_below"] > max(step, 0))).any():
        fail(join(where_s, "mask_below"), f"thresholds lie in {NO_MASK}..{step}")
    if ((s["n_sampled"] < 0) | (s["n_unlabelled"] < 0) | (s["n_unlabelled"] > s["n_sampled"])).any():
        fail(join(where_s, "n_unlabelled"), "counts are 0..n_sampled")
    if (s["n_sampled"] > position_hi - position_lo).any():
        fail(join(where_s, "n_sampled"), "more sampled positions than the sample has")
    span_owner = np.repeat(np.arange(len(s)), s["span_hi"] - s["span_lo"])
    if not np.array_equal(n["sample"], span_owner):
        fail(join(where_n, "sample"), "does not name the sample row each span belongs to")
    lo, hi, part = n["lo"], n["hi"], n["part"]
    if ((lo < position_lo[span_owner]) | (hi < lo) | (hi > position_hi[span_owner])).any():
        fail(join(where_n, "lo"), "a span reaches outside its sample's positions")
    if ((n["sampled"] < 0) | (n["sampled"] > hi - lo)).any():
        fail(join(where_n, "sampled"), "more sampled positions than the span has")
    if ((part != PART_WHOLE) & (part != PART_LABELLED) & (part != PART_UNLABELLED)).any():
        fail(join(where_n, "part"), "values are 0 (whole), 1 (labelled) and 2 (unlabelled)")
    first, second = np.flatnonzero(part == PART_LABELLED), np.flatnonzero(part == PART_UNLABELLED)
    if not np.array_equal(first + 1, second) or not np.array_equal(span_owner[first], span_owner[second[: len(first)]]):
        fail(join(where_n, "part"), "a labelled part is followed by its unlabelled part, in the same sample")
    if ((part != PART_WHOLE) & ~has_tokens[span_owner]).any():
        fail(join(where_n, "part"), "a mixed span in a batch without token versions")
    if len(seen_pairs) != rows:  # pragma: no cover - follows from the per-chunk uniqueness
        fail(join(where_r, "index"), "one rollout is queued twice")

    window = _window_from_dict(state["window"], join(path, "window"), len(envs))
    invalid = []
    for i, item in enumerate(sequence(state["invalid"], join(path, "invalid"))):
        at = join(join(path, "invalid"), i)
        rid, field, reason = sequence(item, at, 3)
        invalid.append(TraceError(string(rid, at + "[0]", True), string(field, at + "[1]"), string(reason, at + "[2]")))
    totals = check_tally(state["totals"], join(path, "totals"))
    tokens_entered = integer(state["tokens_entered"], join(path, "tokens_entered"), 0)
    # Conservation: every sampled position of a live rollout that entered is shipped, dropped or queued.
    sample_live = ~r["frozen"][sample_owner] & ~s["dropped"]
    queued_tokens = int(s["n_sampled"][sample_live].sum())
    accounted = totals.tokens_sampled + totals.tokens_dropped + window.get(None, "tokens_dropped") + queued_tokens
    if tokens_entered != accounted:
        fail(join(path, "tokens_entered"), f"{tokens_entered}, but shipped, dropped and queued positions add to "
             f"{accounted}")  # fmt: skip
    policy_state = sink.policy.check_state_dict(state["policy"], join(path, "policy"))
    tracker = BoundTracker(sink.config)
    if "bound" in state:
        tracker.load_checked(tracker.check_state_dict(state["bound"], join(path, "bound")))
    env_trackers: dict[str, BoundTracker] = {}
    for env, env_state in mapping(state.get("bound_envs", {}), join(path, "bound_envs")).items():
        where = join(join(path, "bound_envs"), string(env, join(path, "bound_envs")))
        if not env:
            fail(where, "an env tracker needs an env name")
        env_trackers[env] = BoundTracker(env_tracker_config(sink.config))
        env_trackers[env].load_checked(env_trackers[env].check_state_dict(env_state, where))
    check_digests(state, path)
    attributes = {
        "_staged": [], "_staged_rollouts": 0, "_staged_positions": 0,  # first: rollouts added since are the old state's
        "_rollouts": r, "_samples": s, "_spans": n, "_step": step, "_queued": queued, "tokens_entered": tokens_entered,
        "_ids": ids, "_row_of": {rid: row for row, rid in enumerate(ids)}, "_seen_ids": seen_ids, "_chunks": chunks,
        "_chunk_open": chunk_open, "_closing": [], "_groups": groups, "_n_groups": n_groups,
        "_group_agentic": group_agentic, "_env_index": {name: i for i, name in enumerate(envs)},
        "_env_names": {i: name or "" for i, name in enumerate(envs)}, "_window": window, "_invalid": invalid,
        "totals": totals, "bound_tracker": tracker, "env_trackers": env_trackers,
    }  # fmt: skip
    return attributes, policy_state


def load_sink(sink: Sink, state: Any, path: str = "") -> None:
    """Replace the sink's state with a checkpoint's (see :func:`save_sink`): all of it, or nothing when the
    checkpoint is refused."""
    attributes, policy_state = read_sink(sink, state, path)
    for name, value in attributes.items():
        setattr(sink, name, value)
    sink.policy.load_state_dict(policy_state)
    sink.sync_bound()


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
    """A metrics dict: numbers by key, and SPEC 14's floor source (a string)."""
    return _metrics(data, path)


def _metrics(data: Any, path: str) -> dict[str, MetricValue]:
    out: dict[str, MetricValue] = {}
    for key, value in mapping(data, path).items():
        if str(key).endswith("/floor_source"):  # SPEC 14's one string value
            if value not in FLOOR_SOURCES:
                fail(join(path, str(key)), f"expected one of {', '.join(FLOOR_SOURCES)}, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(join(path, str(key)), f"expected a number, got {_kind(value)}")
        out[string(key, path)] = value
    return out


def check_report(data: Any, path: str) -> StepReport:
    """A :class:`StepReport` from :func:`report_to_dict`, checked."""
    found = keys(
        data,
        path,
        ("step", "max_staleness", "metrics", "tally", "env_metrics", "env_tally", "mismatch"),
        ("env_mismatch",),  # absent from reports saved before it existed
    )
    env_mismatch = mapping(found.get("env_mismatch", {}), join(path, "env_mismatch"))
    env_metrics = mapping(found["env_metrics"], join(path, "env_metrics"))
    env_tally = mapping(found["env_tally"], join(path, "env_tally"))
    return StepReport(
        step=integer(found["step"], join(path, "step"), 1, MAX_STEP),
        max_staleness=integer(found["max_staleness"], join(path, "max_staleness"), 0),
        metrics=_metrics(found["metrics"], join(path, "metrics")),
        tally=check_tally(found["tally"], join(path, "tally")),
        env_metrics={
            string(env, join(path, "env_metrics")): _metrics(values, join(join(path, "env_metrics"), env))
            for env, values in env_metrics.items()
        },
        env_tally={
            string(env, join(path, "env_tally")): check_tally(tally, join(join(path, "env_tally"), env))
            for env, tally in env_tally.items()
        },
        mismatch=None if found["mismatch"] is None else check_mismatch(found["mismatch"], join(path, "mismatch")),
        env_mismatch={
            string(env, join(path, "env_mismatch")): check_mismatch(sums, join(join(path, "env_mismatch"), env))
            for env, sums in env_mismatch.items()
        },
    )


def report_from_dict(data: Mapping[str, Any], path: str = "report") -> StepReport:
    return check_report(data, path)
