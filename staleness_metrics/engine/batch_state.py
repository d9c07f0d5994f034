"""The plain-data form of the batches rollouts arrived in (and of the old formats' tables), field by
field with their dtypes, read back checked (SPEC 13). Generic by name: a new field is saved without
a change here, and a state lacking one is refused by name."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from ..records.columnar import (
    LABELS_SPANS,
    LABELS_TOKENS,
    PER_POSITION_FLOATS,
    PER_ROLLOUT_ARRAYS,
    PaddedLayout,
    RolloutBatch,
)
from ..state_checks import (
    decode_array,
    encode_array,
    fail,
    integer,
    join,
    keys,
    kind_of,
    mapping,
    sequence,
    strings,
)
from .segments import expand_ranges
from .table import Table

TableT = TypeVar("TableT", bound=Table)

__all__ = [
    "check_offsets",
    "decode_batch",
    "decode_table",
    "encode_batch",
    "encode_value",
]

INT64 = np.dtype(np.int64)


def encode_value(value: Any) -> Any:
    """One batch field (or window value) as ``{form: data}``: an array with its dtype, a
    dict, a list, fields."""
    if isinstance(value, np.ndarray):
        return {"array": encode_array(value)}
    if isinstance(value, dict):
        return {"dict": {key: encode_value(item) for key, item in value.items()}}
    if isinstance(value, (list, tuple)):
        items = list(value)
        # echo records: the state shares nothing with the sink
        if items and isinstance(items[0], (dict, list)):
            items = copy.deepcopy(items)
        return {"list": items}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # the padded layout
        return {"fields": dataclasses.asdict(value)}
    return {"value": value}


def _decode_value(encoded: Any, path: str, wanted: str) -> Any:
    """One encoded batch field of the form ``wanted`` ("array", "list", "dict", "fields"),
    or ``{"value": null}``."""
    found = mapping(encoded, path)
    if len(found) != 1 or next(iter(found)) not in (wanted, "value"):
        got = sorted(map(str, found))
        fail(path, f"expected {{{wanted!r}: ...}} or {{'value': null}}, got the keys {got}")
    if "value" in found:
        if found["value"] is not None:
            fail(join(path, "value"), f"expected null, got {kind_of(found['value'])}")
        return None
    return found[wanted]


def encode_batch(batch: RolloutBatch) -> dict[str, Any]:
    """Every field of a batch, by name (arrays with their dtype)."""
    encoded = {f.name: encode_value(getattr(batch, f.name)) for f in dataclasses.fields(batch)}
    if batch.token_versions is not None and batch.token_versions.dtype != INT64:
        # versions a long batch kept narrow (records.model.pack): a state holds int64
        encoded["token_versions"]["array"]["dtype"] = INT64.str
    return encoded


_BATCH_FORMS = {
    "ids": "list", "group_ids": "list", "envs": "list", "echo": "list", "present": "dict", "padded": "fields",
}  # fmt: skip
_BATCH_INTS = ("sample_offsets", "position_offsets", "dispatch_version", "completion_version", "token_versions",
               "span_offsets", "span_versions", "span_starts")  # fmt: skip
_BATCH_OPTIONAL = {"completion_version", "frozen", "agentic", "group_ids", "envs", "token_versions", "span_offsets",
                   "span_versions", "span_starts", "label_kind", "echo", "padded", *PER_POSITION_FLOATS}  # fmt: skip


def check_offsets(values: npt.NDArray[np.int64], path: str, length: int, end: int) -> None:
    """``values`` are ``length`` offsets from 0 to ``end``, never decreasing."""
    if len(values) != length:
        fail(path, f"{len(values)} offsets where {length} are needed")
    if values[0] != 0 or values[-1] != end or (np.diff(values) < 0).any():
        fail(path, f"offsets must rise from 0 to {end}")


def decode_batch(encoded: Any, path: str = "batch") -> RolloutBatch:
    """The batch of :func:`encode_batch`, checked: every length and offset agrees,
    so no write can stray."""
    names = [f.name for f in dataclasses.fields(RolloutBatch)]
    # an optional field may be absent (added since the state was saved: None, as an add without it)
    found = keys(encoded, path, [n for n in names if n not in _BATCH_OPTIONAL], _BATCH_OPTIONAL)
    raw: dict[str, Any] = {}
    for name in names:
        where = join(path, name)
        form = _BATCH_FORMS.get(name, "array")
        value = _decode_value(found[name], where, form) if name in found else None
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
    n_samples, n_positions = len(raw["position_offsets"]) - 1, len(raw["mask"])
    where = join(path, "position_offsets")
    check_offsets(raw["position_offsets"], where, n_samples + 1, n_positions)
    check_offsets(raw["sample_offsets"], join(path, "sample_offsets"), n_rollouts + 1, n_samples)
    for name in PER_ROLLOUT_ARRAYS:
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
        check_offsets(raw["span_offsets"], join(path, "span_offsets"), n_samples + 1, n_spans)
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
            reason = "a sample labelled per token, in a batch without token versions"
            fail(join(path, "label_kind"), reason)
    try:
        return RolloutBatch(**raw)
    except (TypeError, ValueError) as exc:  # pragma: no cover - every field was checked above
        fail(path, str(exc))


def queued_part(
    batch: RolloutBatch,
    rollouts: npt.NDArray[np.int64],
    sampled: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]],
) -> RolloutBatch:
    """The rollouts ``rollouts`` of ``batch`` (in that order) as a new batch, with the mask back to 1
    over the position ranges ``sampled`` (masked in place since they arrived). Its arrays are views
    of ``batch``'s where the rollouts are a run of it and no range is set back, else copies."""
    samples = expand_ranges(batch.sample_offsets[rollouts], batch.sample_offsets[rollouts + 1])
    positions = _items_of(batch.position_offsets, samples)
    part = copy.copy(batch)  # (checked and converted already: no __post_init__ again)
    part.mask = _ones_over(batch.mask, *sampled)[positions]
    part.ids = [batch.ids[i] for i in rollouts.tolist()]
    part.sample_offsets = _offsets(batch.sample_offsets, rollouts)
    part.position_offsets = _offsets(batch.position_offsets, samples)
    for name in PER_ROLLOUT_ARRAYS:
        if (values := getattr(batch, name)) is not None:
            setattr(part, name, values[rollouts] if isinstance(values, np.ndarray) else
                    [values[i] for i in rollouts.tolist()])  # fmt: skip
    for name in (*PER_POSITION_FLOATS, "token_versions"):
        if (values := getattr(batch, name)) is not None:
            setattr(part, name, values[positions])
    if batch.label_kind is not None:
        part.label_kind = batch.label_kind[samples]
    if batch.span_offsets is not None and batch.span_versions is not None and batch.span_starts is not None:
        spans = _items_of(batch.span_offsets, samples)
        part.span_offsets = _offsets(batch.span_offsets, samples)
        part.span_versions, part.span_starts = batch.span_versions[spans], batch.span_starts[spans]
    part.present = {name: flags[samples] for name, flags in batch.present.items()}
    if batch.padded is not None and not np.array_equal(rollouts, np.arange(batch.n_rollouts)):
        part.padded = None  # (the rows of a padded batch are kept only when all of it is)
    return part


def _items_of(offsets: npt.NDArray[np.int64], groups: npt.NDArray[np.int64]) -> slice | npt.NDArray[Any]:
    """What indexes the items ``offsets[g]:offsets[g + 1]`` of each of ``groups``, one after the other:
    a slice (a view) when the groups are a run, a flag per item when they ascend, else the items'
    indices."""
    if not len(groups):
        return slice(0, 0)
    first, last = int(groups[0]), int(groups[-1])
    if last - first + 1 == len(groups) and (np.diff(groups) == 1).all():
        return slice(int(offsets[first]), int(offsets[last + 1]))
    if (np.diff(groups) > 0).all():
        chosen = np.zeros(len(offsets) - 1, dtype=bool)
        chosen[groups] = True
        return np.repeat(chosen, np.diff(offsets))
    return expand_ranges(offsets[groups], offsets[groups + 1])


def _ones_over(mask: npt.NDArray[Any], lo: npt.NDArray[np.int64], hi: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
    """``mask`` with 1 over the disjoint ranges ``lo[i]:hi[i]`` (a copy, unless there are none)."""
    if not len(lo):
        return mask
    edges = np.zeros(len(mask) + 1, dtype=np.int8)
    np.add.at(edges, lo, 1)
    np.add.at(edges, hi, -1)
    covered = np.cumsum(edges[:-1], dtype=np.int8, out=edges[:-1])  # 0 or 1: the ranges are disjoint
    out: npt.NDArray[Any] = mask.copy()
    out[covered.view(np.bool_)] = 1
    return out


def _offsets(offsets: npt.NDArray[np.int64], items: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Offsets of the ranges ``offsets[i]:offsets[i + 1]`` of ``items``, one after the other."""
    return np.concatenate(([0], np.cumsum(offsets[items + 1] - offsets[items]))).astype(np.int64)


def decode_table(encoded: Any, like: TableT, path: str) -> TableT:
    """A table of ``like``'s type (its columns and dtypes) filled from
    ``encoded``, all of one length."""
    found = mapping(encoded, path)
    missing = sorted(set(like.names) - set(found))
    extra = sorted(set(found) - set(like.names), key=str)
    if missing or extra:
        name = (missing or extra)[0]
        fault = "lacks this column" if missing else "has no such column"
        fail(join(path, str(name)), f"the table {fault}")
    columns = {name: decode_array(found[name], join(path, name), dtype) for name, dtype in like.columns.items()}
    lengths = {len(values) for values in columns.values()}
    if len(lengths) > 1:
        first = len(columns[like.names[0]])
        name = next(name for name, values in columns.items() if len(values) != first)
        fail(join(path, name), f"{len(columns[name])} rows where the other columns have {first}")
    table = type(like)()
    if columns and len(next(iter(columns.values()))):
        table.append(**columns)
    return table
