"""The queue in a checkpoint (SPEC 13): the queued rollouts as the batches they arrived in, loaded
back through the add path, and what judging did to them; and the converter of formats 1 and 2."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from itertools import pairwise
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from .. import state_checks
from ..records import columnar
from ..records.columnar import PER_POSITION_FLOATS, RolloutBatch
from ..records.validation import unstorable
from ..state_checks import boolean, decode_array, fail, integer, join, keys, mapping, sequence
from .decision import NO_MASK
from .judging import judgement_of, mask_positions
from .queue import NEVER, QUEUED, RolloutQueue, RolloutRows, SampleRows, SpanRows, Table, rollouts_of
from .segments import IntArray, expand_ranges
from .spans import checked_spans

TableT = TypeVar("TableT", bound=Table)

INT64 = np.dtype(np.int64)
QUEUE_KEYS = (
    *("batches", "judged", "mask_below", "dropped"),  # the queued rollouts, and what judging did
    *("seen_ids", "groups", "group_agentic", "envs", "tokens_entered"),  # what the run has seen
)
LAYOUT_KEYS = (
    "queued", "tokens_entered", "tables", "ids", "seen_ids", "chunks", "chunk_open", "groups", "group_agentic",
    "n_groups", "envs",
)  # fmt: skip


def save_queue(queue: RolloutQueue, renumber: bool = True) -> dict[str, Any]:
    """The queue as plain data, masked positions with mask 1 (weights stay 0: none trains); its
    named groups numbered anew in order (a nameless one ends with its one rollout), unless not
    ``renumber`` (a format 1 or 2 policy state numbers them all)."""
    queue.build_staged()
    r, s, n = queue.rollouts, queue.samples, queue.spans
    rows = np.flatnonzero(r.status == QUEUED)
    batches = []
    if len(rows):
        chunk = r.chunk[rows]
        bounds = [0, *(np.flatnonzero(np.diff(chunk)) + 1).tolist(), len(rows)]
        for start, stop in pairwise(bounds):  # runs of one batch, in queue order
            mine = rows[start:stop]
            sample_rows = expand_ranges(r.sample_lo[mine], r.sample_hi[mine])
            # the spans masked in place: sampled, below their sample's threshold
            raised = sample_rows[s.mask_below[sample_rows] > NO_MASK]
            span_rows = expand_ranges(s.span_lo[raised], s.span_hi[raised])
            below = np.repeat(s.mask_below[raised], s.span_hi[raised] - s.span_lo[raised])
            masked = span_rows[(n.sampled[span_rows] > 0) & (n.version[span_rows] < below)]
            batch = queue.batches_of([int(chunk[start])])[int(chunk[start])]
            part = rollouts_of(batch, r.index[mine], _ones_over(batch.mask, n.lo[masked], n.hi[masked]))
            batches.append(encode_batch(part))
    sample_rows = expand_ranges(r.sample_lo[rows], r.sample_hi[rows])
    kept = queue.named_groups()
    groups = sorted(queue.groups.items(), key=lambda item: item[1])
    return {
        "batches": batches,
        "judged": r.judged[rows].tolist(),
        "mask_below": s.mask_below[sample_rows].tolist(),
        "dropped": s.dropped[sample_rows].tolist(),
        "seen_ids": sorted(queue.seen_ids),
        "groups": [[name, new if renumber else i] for new, (name, i) in enumerate(groups)],
        "group_agentic": queue.group_agentic[kept if renumber else slice(queue.n_groups)].tolist(),
        "envs": [name for name, _ in sorted(queue.env_index.items(), key=lambda item: item[1])],
        "tokens_entered": queue.tokens_entered,
    }


def read_registry(state: Mapping[str, Any], path: str) -> tuple[set[str], dict[str, Any]]:
    """The ids seen in ``state``, and its groups and envs as ``RolloutQueue.restore`` takes them."""
    seen_ids = set(state_checks.strings(state["seen_ids"], join(path, "seen_ids"), unique=True))
    where = join(path, "group_agentic")
    length = integer(state["n_groups"], join(path, "n_groups"), 0) if "n_groups" in state else None
    agentic = sequence(state["group_agentic"], where, length)  # (n_groups: formats 1 and 2)
    n_groups = len(agentic)
    group_agentic = np.zeros(max(16, 2 * n_groups), dtype=bool)
    group_agentic[:n_groups] = [boolean(v, join(where, i)) for i, v in enumerate(agentic)]
    groups: dict[str, int] = {}
    for i, pair in enumerate(sequence(state["groups"], join(path, "groups"))):
        where = join(join(path, "groups"), i)
        name, index = sequence(pair, where, 2)
        name = state_checks.string(name, join(where, 0))
        index = integer(index, join(where, 1), 0, n_groups - 1)
        if name in groups:
            fail(where, f"group {name!r} appears twice")
        groups[name] = index
    if len(set(groups.values())) != len(groups):
        fail(join(path, "groups"), "two group names share an index")
    envs = state_checks.strings(state["envs"], join(path, "envs"), optional=True, unique=True)
    if not envs or envs[0] is not None:
        fail(join(path, "envs"), "the first env is null (rollouts without one)")
    env_index = {name: i for i, name in enumerate(envs)}
    return seen_ids, dict(groups=groups, n_groups=n_groups, group_agentic=group_agentic, env_index=env_index)


def integers(value: Any, path: str, length: int | None, low: int, high: int) -> IntArray:
    items = sequence(value, path, length)
    if set(map(type, items)) <= {int}:  # the usual case, at C speed
        values = np.asarray(items, dtype=object if items and max(map(abs, items)) >= 2**63 else np.int64)
        if values.dtype == np.int64 and (not len(values) or (values.min() >= low and values.max() <= high)):
            return values
    for i, item in enumerate(items):  # the loop names the offending entry
        integer(item, join(path, i), low, high)
    raise AssertionError("unreachable: an entry failed its check")  # pragma: no cover


def read_queue(
    state: Mapping[str, Any], observe_added: Callable[[IntArray], None], path: str = "", step: int = 0
) -> RolloutQueue:
    """A new queue holding :func:`save_queue`'s ``state``, checked (not told to the policy)."""
    found = keys(state, path, QUEUE_KEYS)
    seen_ids, registry = read_registry(found, path)
    queue = RolloutQueue(lambda groups: None)
    queue.restore(**copy.deepcopy(registry))
    where = join(path, "batches")
    for i, encoded in enumerate(sequence(found["batches"], where)):
        batch = decode_batch(encoded, join(where, i))
        verdicts, spans = checked_spans(batch, queue.seen_ids)
        if verdicts.errors:
            fail(join(where, i), str(verdicts.errors[min(verdicts.errors)]))
        queue.add_checked(batch, spans)
    for key, ours, saved in (
        ("envs", queue.env_index, registry["env_index"]),
        ("groups", queue.groups, registry["groups"]),
    ):
        if len(ours) != len(saved):  # (an add registers what the registry lacks)
            name = next(reversed(ours))
            fail(join(path, key), f"lacks the {key[:-1]} {name!r} of a queued rollout")
    if not seen_ids.issuperset(queue.seen_ids):
        fail(join(path, "seen_ids"), f"lacks the queued id {min(queue.seen_ids - seen_ids)!r}")
    rollouts, samples = len(queue.rollouts), len(queue.samples)
    judged = integers(found["judged"], join(path, "judged"), rollouts, NEVER, step)
    mask_below = integers(found["mask_below"], join(path, "mask_below"), samples, NO_MASK, max(step, 0))
    where = join(path, "dropped")
    dropped = np.array([boolean(v, join(where, i)) for i, v in enumerate(sequence(found["dropped"], where, samples))])
    if samples and np.logical_and.reduceat(dropped, queue.rollouts.sample_lo).any():
        fail(where, "every sample of a queued rollout is dropped (a policy drops it whole)")
    raised = mask_below > NO_MASK
    if raised.any():  # masked again as the thresholds masked them
        mask_positions(queue, judgement_of(queue, np.arange(rollouts), 0), mask_below, raised)
    queue.rollouts.judged[:] = judged
    queue.samples.mask_below[:] = mask_below
    queue.samples.dropped[:] = dropped
    tokens_entered = integer(found["tokens_entered"], join(path, "tokens_entered"), 0)
    queue.restore(seen_ids=seen_ids, tokens_entered=tokens_entered, observe_added=observe_added)
    return queue


def read_layout(
    state: Mapping[str, Any], observe_added: Callable[[IntArray], None], path: str = "", step: int = 0
) -> RolloutQueue:
    """:func:`read_queue` of a format 1 or 2 ``state``: its tables checked, saved and read anew."""
    queue = RolloutQueue(observe_added)
    tables = keys(state["tables"], join(path, "tables"), ("rollouts", "samples", "spans"))
    r = decode_table(tables["rollouts"], queue.rollouts, join(path, "tables.rollouts"))
    s = decode_table(tables["samples"], queue.samples, join(path, "tables.samples"))
    n = decode_table(tables["spans"], queue.spans, join(path, "tables.spans"))
    ids = state_checks.strings(state["ids"], join(path, "ids"), unique=True)
    if len(ids) != len(r):
        fail(join(path, "ids"), f"{len(ids)} ids for {len(r)} rollout rows")
    queued = integer(state["queued"], join(path, "queued"), 0)
    if queued != len(r):
        fail(join(path, "queued"), f"{queued}, but the checkpoint holds {len(r)} queued rollouts")
    seen_ids, registry = read_registry(state, path)
    where = join(path, "chunks")
    chunks = [decode_batch(c, join(where, i)) for i, c in enumerate(sequence(state["chunks"], where))]
    sequence(state["chunk_open"], join(path, "chunk_open"), len(chunks))
    _rows_agree((r, s, n), chunks, ids, path)
    tokens_entered = integer(state["tokens_entered"], join(path, "tokens_entered"), 0)
    queue.restore(
        rollouts=r, samples=s, spans=n, ids=ids, seen_ids=seen_ids, chunks=list(chunks),
        chunk_open=np.bincount(r.chunk, minlength=len(chunks)).tolist(), queued=queued,
        tokens_entered=tokens_entered, **registry,
    )  # fmt: skip
    return read_queue(save_queue(queue, renumber=False), observe_added, path, step)


def _rows_agree(
    tables: tuple[RolloutRows, SampleRows, SpanRows], chunks: list[RolloutBatch], ids: list[str], path: str
) -> None:
    """The tables agree with their chunks as far as saving them reads."""
    r, s, n = tables
    where_r, where_s = join(path, "tables.rollouts"), join(path, "tables.samples")
    if (r.status != QUEUED).any():
        fail(join(where_r, "status"), "a checkpoint holds queued rollouts only")
    if ((r.chunk < 0) | (r.chunk >= len(chunks))).any():
        fail(join(where_r, "chunk"), f"values are chunk numbers, 0..{len(chunks) - 1}")
    _in_order(r.sample_lo, r.sample_hi, join(where_r, "sample"), len(s))
    _in_order(s.span_lo, s.span_hi, join(where_s, "span"), len(n))
    counts = r.sample_hi - r.sample_lo
    for c, batch in enumerate(chunks):
        mine = np.flatnonzero(r.chunk == c)
        k = r.index[mine]
        if ((k < 0) | (k >= batch.n_rollouts)).any():
            fail(join(where_r, "index"), f"chunk {c} holds rollouts 0..{batch.n_rollouts - 1}")
        if len(np.unique(k)) != len(k):
            fail(join(where_r, "index"), f"one rollout of chunk {c} is queued twice")
        if [batch.ids[i] for i in k.tolist()] != [ids[i] for i in mine.tolist()]:
            fail(join(path, "ids"), f"disagrees with the rollouts of chunk {c}")
        if not np.array_equal(np.diff(batch.sample_offsets)[k], counts[mine]):
            fail(join(where_r, "sample_hi"), f"disagrees with the samples of chunk {c}")
    span_chunk = np.repeat(np.repeat(r.chunk, counts), s.span_hi - s.span_lo)
    positions = np.array([batch.n_positions for batch in chunks], dtype=np.int64)[span_chunk]
    if ((n.lo < 0) | (n.hi < n.lo) | (n.hi > positions)).any():
        fail(join(path, "tables.spans.lo"), "a span reaches outside its chunk's positions")


def _in_order(lo: IntArray, hi: IntArray, where: str, end: int) -> None:
    """Ranges ``[lo, hi)`` (the columns ``{where}_lo``, ``{where}_hi``) that tile ``0..end``."""
    offsets = np.concatenate((lo[:1], hi)) if len(lo) else np.zeros(1, dtype=np.int64)
    check_offsets(offsets, f"{where}_hi", len(lo) + 1, end)
    if (lo[1:] != hi[:-1]).any():
        fail(f"{where}_lo", "each range starts where the previous one ends")


def encode_value(value: Any) -> Any:
    """One batch field (or window value) as ``{form: data}``."""
    if isinstance(value, np.ndarray):
        return {"array": state_checks.encode_array(value)}
    if isinstance(value, dict):
        return {"dict": {key: encode_value(item) for key, item in value.items()}}
    if isinstance(value, (list, tuple)):
        items = list(value)
        if items and isinstance(items[0], (dict, list)):  # echo records: a state shares nothing
            items = copy.deepcopy(items)
        return {"list": items}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # the padded layout
        return {"fields": dataclasses.asdict(value)}
    return {"value": value}


def _decode_value(encoded: Any, path: str, wanted: str) -> Any:
    """One encoded batch field of the form ``wanted`` (or ``{"value": null}``: None)."""
    found = mapping(encoded, path)
    if len(found) != 1 or next(iter(found)) not in (wanted, "value"):
        got = sorted(map(str, found))
        fail(path, f"expected {{{wanted!r}: ...}} or {{'value': null}}, got the keys {got}")
    if "value" in found:
        if found["value"] is not None:
            fail(join(path, "value"), f"expected null, got {state_checks.kind_of(found['value'])}")
        return None
    return found[wanted]


def encode_batch(batch: RolloutBatch) -> dict[str, Any]:
    encoded = {f.name: encode_value(getattr(batch, f.name)) for f in dataclasses.fields(batch)}
    if batch.token_versions is not None and batch.token_versions.dtype != INT64:  # (kept narrow)
        encoded["token_versions"]["array"]["dtype"] = INT64.str
    return encoded


_BATCH_FORMS = {
    "ids": "list", "group_ids": "list", "envs": "list", "echo": "list", "present": "dict", "padded": "fields",
}  # fmt: skip
_BATCH_INTS = ("sample_offsets", "position_offsets", "dispatch_version", "completion_version", "token_versions",
               "span_offsets", "span_versions", "span_starts")  # fmt: skip
_BATCH_OPTIONAL = {"completion_version", "frozen", "agentic", "group_ids", "envs", "token_versions", "span_offsets",
                   "span_versions", "span_starts", "label_kind", "echo", "padded", *PER_POSITION_FLOATS}  # fmt: skip


def check_offsets(values: IntArray, path: str, length: int, end: int) -> None:
    """``values`` are ``length`` offsets from 0 to ``end``, never decreasing."""
    if len(values) != length:
        fail(path, f"{len(values)} offsets where {length} are needed")
    if values[0] != 0 or values[-1] != end or (np.diff(values) < 0).any():
        fail(path, f"offsets must rise from 0 to {end}")


def decode_batch(encoded: Any, path: str = "batch") -> RolloutBatch:
    """The batch of :func:`encode_batch`, checked: every length and offset agrees."""
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
            value = columnar.PaddedLayout(
                integer(fields_["rows"], join(where, "fields.rows"), 0),
                integer(fields_["width"], join(where, "fields.width"), 0),
            )
        elif name == "echo":
            records = sequence(value, join(where, "list"))
            for i, record in enumerate(records):  # (what outputs could not write: refused)
                if (bad := unstorable(mapping(record, join(join(where, "list"), i)))) is not None:
                    fail(join(join(join(where, "list"), i), bad[0]), bad[1])
            value = copy.deepcopy(list(records))
        else:
            value = state_checks.strings(value, join(where, "list"), optional=name != "ids")
        raw[name] = value
    n_rollouts = len(raw["ids"])
    if len(raw["position_offsets"]) == 0:
        fail(join(path, "position_offsets"), "at least one offset is needed")
    n_samples, n_positions = len(raw["position_offsets"]) - 1, len(raw["mask"])
    where = join(path, "position_offsets")
    check_offsets(raw["position_offsets"], where, n_samples + 1, n_positions)
    check_offsets(raw["sample_offsets"], join(path, "sample_offsets"), n_rollouts + 1, n_samples)
    for name in columnar.PER_ROLLOUT_ARRAYS:
        if raw[name] is not None and len(raw[name]) != n_rollouts:
            fail(join(path, name), f"{len(raw[name])} entries for {n_rollouts} rollouts")
    for name in ("frozen", "agentic"):
        if raw[name] is not None and raw[name].dtype != np.bool_:
            fail(join(path, name), "expected a bool array")
    for i, (record, rid, version) in enumerate(zip(raw["echo"] or (), raw["ids"], raw["dispatch_version"])):
        if record.get("id") != rid or record.get("dispatch_version", -1) != version:  # (shown)
            fail(join(path, f"echo.list[{i}]"), "its id or dispatch_version is not the batch's")
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
    kind, given = raw["label_kind"], (not any(spans), raw["token_versions"] is not None)
    if kind is not None and (reason := columnar.label_kind_fault(kind, n_samples, *given)):
        fail(join(path, "label_kind"), reason)
    return RolloutBatch(**raw)


def _ones_over(mask: npt.NDArray[Any], lo: IntArray, hi: IntArray) -> npt.NDArray[Any]:
    """``mask`` with 1 over the disjoint ranges ``lo[i]:hi[i]`` (a copy, unless there are none)."""
    if not len(lo):
        return mask
    edges = np.zeros(len(mask) + 1, dtype=np.int8)
    np.add.at(edges, lo, 1)
    np.add.at(edges, hi, -1)
    covered = np.cumsum(edges[:-1], dtype=np.int8, out=edges[:-1])  # 0 or 1: disjoint ranges
    out: npt.NDArray[Any] = mask.copy()
    out[covered.view(np.bool_)] = 1
    return out


def decode_table(encoded: Any, like: TableT, path: str) -> TableT:
    """A table of ``like``'s type filled from ``encoded``, checked."""
    found = mapping(encoded, path)
    missing = sorted(set(like.columns) - set(found))
    extra = sorted(set(found) - set(like.columns), key=str)
    if missing or extra:
        name = (missing or extra)[0]
        fault = "lacks this column" if missing else "has no such column"
        fail(join(path, str(name)), f"the table {fault}")
    columns = {name: decode_array(found[name], join(path, name), dtype) for name, dtype in like.columns.items()}
    if len({len(values) for values in columns.values()}) > 1:
        first = len(columns[next(iter(like.columns))])
        name = next(name for name, values in columns.items() if len(values) != first)
        fail(join(path, name), f"{len(columns[name])} rows where the other columns have {first}")
    table = type(like)()
    if columns and len(next(iter(columns.values()))):
        table.append(**columns)
    return table
