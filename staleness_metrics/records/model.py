"""Rollout records (SPEC 3) as dicts / JSON: type checks (what JSON can get wrong) and packing into
a :class:`RolloutBatch`; the value rules are checked on the columnar form by :mod:`.validation`."""

from __future__ import annotations

import array as _array_module
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from itertools import accumulate, chain
from typing import Any

import numpy as np
import numpy.typing as npt

from ..compiled import UNSIGNED_OF_SIZE
from ..errors import TraceError
from .columnar import LABELS_NONE, LABELS_SPANS, LABELS_TOKENS, PER_POSITION_FLOATS, WEIGHT_FIELDS, RolloutBatch
from .columnar import MAX_VERSION as MAX_VERSION
from .validation import INT64_MAX, INT64_MIN, check_text, printable_id, span_fault


def _plain(values: Any) -> Any:
    """Lists of Python scalars from sequences or numpy arrays."""
    if values is None:
        return None
    if isinstance(values, np.ndarray):
        return values.tolist()
    return [_plain(v) if isinstance(v, (list, tuple, np.ndarray)) else v for v in values]


@dataclass(frozen=True)
class Sample:
    """A training sample as a typed object (the same fields as the SPEC 3 record)."""

    mask: Sequence[int] | npt.NDArray[Any]
    weight_versions: Sequence[Sequence[int]] | None = None
    token_versions: Sequence[int] | npt.NDArray[Any] | None = None
    rl_weights: Sequence[float] | npt.NDArray[Any] | None = None
    ce_weights: Sequence[float] | npt.NDArray[Any] | None = None
    ref_kl_weights: Sequence[float] | npt.NDArray[Any] | None = None
    logprobs: Sequence[float | None] | npt.NDArray[Any] | None = None
    trainer_logprobs: Sequence[float | None] | npt.NDArray[Any] | None = None

    def to_record(self) -> dict[str, Any]:
        values = {name: getattr(self, name) for name in _SAMPLE_FIELDS}  # the mask first, always
        return {name: _plain(v) for name, v in values.items() if v is not None or name == "mask"}


@dataclass(frozen=True)
class Rollout:
    """A rollout as a typed object; :meth:`Sink.add` validates it exactly like a dict record."""

    id: str
    samples: Sequence[Sample]
    dispatch_version: int | None = None
    completion_version: int | None = None
    group_id: str | None = None
    env: str | None = None
    source: str = "live"
    agentic: bool = False

    def to_record(self) -> dict[str, Any]:
        samples = [s.to_record() if isinstance(s, Sample) else s for s in self.samples]  # or dicts
        record: dict[str, Any] = {"id": self.id, "samples": samples}
        for name in ("dispatch_version", "completion_version", "group_id", "env"):
            if getattr(self, name) is not None:
                record[name] = getattr(self, name)
        if self.source != "live":
            record["source"] = self.source
        if self.agentic is not False:  # (any other value is checked, as in a dict record)
            record["agentic"] = self.agentic
        return record


# a record's fields, in the order to_record writes them
_SAMPLE_FIELDS = tuple(f.name for f in fields(Sample))
_ROLLOUT_FIELDS = frozenset(f.name for f in fields(Rollout))


@dataclass
class ParsedSample:
    mask: npt.NDArray[np.int8]
    spans: npt.NDArray[np.signedinteger[Any]] | None = None  # (k, 2): version, start
    token_versions: npt.NDArray[np.signedinteger[Any]] | None = None  # int64, or as parsed
    weights: dict[str, npt.NDArray[np.float64]] = field(default_factory=dict)
    logprobs: npt.NDArray[np.float64] | None = None  # NaN where missing, as trainer_logprobs
    trainer_logprobs: npt.NDArray[np.float64] | None = None
    # the arrays the parse made (no caller shares them): pack(adopt=True) keeps them uncopied
    fresh: set[str] = field(default_factory=set)


@dataclass
class ParsedRollout:
    id: str
    dispatch_version: int
    completion_version: int
    frozen: bool
    agentic: bool
    group_id: str | None
    env: str | None
    samples: list[ParsedSample]
    echo: dict[str, Any]


@dataclass(frozen=True)
class UnparsedRollout:
    """A record :func:`parse_rollout` refused: its error, and its env (counted per env)."""

    error: TraceError
    env: str | None


INT64_BOUND = 2.0**63  # floats at or beyond it do not fit int64 (the checked path reads them)
COMPACT_MASK_MIN_POSITIONS = 1 << 20  # a packed batch of this many positions keeps its mask as int8
# signed dtypes a sample's token versions may keep from the parse
_NARROW_VERSIONS = (np.dtype(np.int8), np.dtype(np.int16), np.dtype(np.int32))
# a missing sample's fill (else 0.0): a missing rl weight counts as 1, a trainer log-prob as missing
_FILLS = {"rl_weights": 1.0, "trainer_logprobs": np.nan}
_NONE_PRESENT: npt.NDArray[np.bool_] = np.zeros(0, dtype=bool)  # a column no sample has


def versions_beyond(values: npt.NDArray[Any]) -> bool:
    return bool(values.size) and (int(values.max()) > MAX_VERSION or int(values.min()) < -MAX_VERSION)


def floats_beyond(values: npt.NDArray[Any]) -> bool:
    """Whether some value is NaN or of magnitude 2**63 or more (the checked path reads them)."""
    return bool(values.size and not (values.max() < INT64_BOUND and values.min() > -INT64_BOUND))


def mask_beyond(values: npt.NDArray[Any]) -> bool:
    """Whether some value of an integer mask is not 0 or 1 (as unsigned, a negative is huge)."""
    return bool(values.size and values.view(UNSIGNED_OF_SIZE[values.itemsize]).max() > 1)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _array(rid: str, name: str, value: object, kinds: str, expected: str, booleans: bool = True) -> npt.NDArray[Any]:
    """A JSON list as a 1-d array of a dtype kind in ``kinds``, no element coerced."""
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in kinds.replace("b", ""):
        return value  # already exact (the service turns long lists into arrays as it reads them)
    if not isinstance(value, list):
        raise TraceError(rid, name, f"expected {expected}, got {type(value).__name__}")
    try:
        array = np.array(value)
    except (ValueError, OverflowError):
        array = np.array(value, dtype=object)
    if (
        array.dtype.kind in "uOf"
        and array.size
        and (array.dtype == object or not -INT64_BOUND <= array.min() <= array.max() < INT64_BOUND)
    ):  # an integer beyond signed 64 bits: no store keeps it, and a weight would be rounded
        for i, v in enumerate(value):
            if _is_int(v) and not INT64_MIN <= v <= INT64_MAX:
                raise TraceError(rid, f"{name}[{i}]", f"integer {v} is outside the signed 64-bit range")
    if array.ndim != 1 or (array.size and array.dtype.kind not in kinds):
        for i, v in enumerate(value):  # error path only: find the element to name
            number = _is_int(v) or (isinstance(v, float) and "f" in kinds)
            if not (number or (isinstance(v, bool) and "b" in kinds)):
                raise TraceError(rid, f"{name}[{i}]", f"expected {expected}, got {v!r}")
        raise TraceError(rid, name, f"expected {expected}")
    if booleans and "b" not in kinds and array.dtype.kind != "b" and bool in map(type, value):
        # numpy reads True as 1: a boolean where a number belongs would be silently coerced
        position = next(i for i, v in enumerate(value) if isinstance(v, bool))
        raise TraceError(rid, f"{name}[{position}]", f"expected {expected}, got {value[position]!r}")
    return array


def _fast(value: object, code: str) -> npt.NDArray[Any] | None:
    """A list read at C speed as int64 (``"q"``, booleans too) or float64 (``"d"``), else None."""
    if type(value) is not list:
        return None
    try:
        return np.frombuffer(_array_module.array(code, value), dtype=code)  # int64 or float64
    except (TypeError, OverflowError):
        return None


def _int_list(rid: str, name: str, value: object, booleans: bool = True) -> npt.NDArray[np.signedinteger[Any]]:
    """Versions as int64, or as the narrower signed dtype the service read them in."""
    fast = None if booleans else _fast(value, "q")
    array = fast if fast is not None else _array(rid, name, value, "iu", "a list of integers", booleans)
    if versions_beyond(array):
        raise TraceError(rid, name, f"values must be within -{MAX_VERSION}..{MAX_VERSION}")
    return array if array.dtype in _NARROW_VERSIONS else array.astype(np.int64, copy=False)


def float_list(rid: str, name: str, value: object, booleans: bool = True) -> npt.NDArray[np.float64]:
    """Numbers; log-probs may be null too (read as NaN: SPEC 11's uncovered, not an error)."""
    if not booleans and (fast := _fast(value, "d")) is not None and not floats_beyond(fast):
        return fast
    if not name.endswith("logprobs"):
        array = _array(rid, name, value, "iuf", "a list of numbers", booleans)
        return array.astype(np.float64, copy=False)
    if isinstance(value, list) and None in value:  # (NaN in place: a fault keeps its index)
        value = [math.nan if v is None else v for v in value]
    return _array(rid, name, value, "iuf", "a list of numbers or nulls").astype(np.float64)


def _mask(rid: str, name: str, value: object) -> npt.NDArray[np.int8]:
    fast = _fast(value, "q")  # booleans are allowed here: 0/1 either way
    array = fast if fast is not None else _array(rid, name, value, "biu", "a list of 0/1 or booleans")
    if array.dtype.kind != "b" and mask_beyond(array):
        bad = int(np.flatnonzero((array != 0) & (array != 1))[0])
        reason = f"expected 0, 1 or a boolean, got {array[bad].item()!r}"
        raise TraceError(rid, f"{name}[{bad}]", reason)
    return array.astype(np.int8, copy=False)


def _only_ints(pairs: list[Any]) -> bool:
    """Whether every item of every pair is an int (not a bool), at C level."""
    try:
        return set(map(type, chain.from_iterable(pairs))) == {int}
    except TypeError:  # a pair that is not a list: the loop names it
        return False


def _check_pair_range(rid: str, name: str, index: int, pair: list[int]) -> None:
    if not all(-MAX_VERSION <= v <= MAX_VERSION for v in pair):
        reason = f"values must be within -{MAX_VERSION}..{MAX_VERSION}, got {pair!r}"
        raise TraceError(rid, f"{name}[{index}]", reason)


def _spans(rid: str, name: str, value: object, booleans: bool = True) -> npt.NDArray[np.signedinteger[Any]]:
    if isinstance(value, np.ndarray) and value.shape[1:] == (2,) and value.dtype.kind == "i":
        # pairs the service read into an array (int32 where all fit): kept, widened by pack
        if versions_beyond(value):
            for i, pair in enumerate(value.tolist()):
                _check_pair_range(rid, name, i, pair)
        return value if value.dtype in (np.int32, np.int64) else value.astype(np.int64)
    if not isinstance(value, list):
        raise TraceError(rid, name, f"expected a list of [version, start] pairs, got {type(value).__name__}")
    # no boolean hides among the integers: all at once
    if value and (not booleans or _only_ints(value)):
        try:
            pairs = np.array(value)
        except (ValueError, OverflowError):
            pass
        else:
            if pairs.shape[1:] == (2,) and pairs.dtype.kind == "i" and not versions_beyond(pairs):
                return pairs.astype(np.int64, copy=False)
    for i, pair in enumerate(value):  # one check per span, not per token
        if not (isinstance(pair, list) and len(pair) == 2 and all(_is_int(v) for v in pair)):
            raise TraceError(rid, f"{name}[{i}]", f"expected a [version, start] pair of integers, got {pair!r}")
        _check_pair_range(rid, name, i, pair)
    return np.array(value, dtype=np.int64).reshape(-1, 2)


def _parse_sample(rid: str, index: int, raw: object, booleans: bool = True) -> ParsedSample:
    where = f"samples[{index}]"
    if not isinstance(raw, Mapping):
        raise TraceError(rid, where, f"expected an object, got {type(raw).__name__}")
    if unknown := sorted(set(raw).difference(_SAMPLE_FIELDS)):
        raise TraceError(rid, f"{where}.{unknown[0]}", "unknown field")
    if "mask" not in raw:
        raise TraceError(rid, f"{where}.mask", "required field is missing")
    sample = ParsedSample(mask=_mask(rid, f"{where}.mask", raw["mask"]))
    if raw.get("weight_versions") is not None and raw.get("token_versions") is not None:
        raise TraceError(rid, f"{where}.token_versions", "both weight_versions and token_versions are given")
    if raw.get("weight_versions") is not None:
        sample.spans = _spans(rid, f"{where}.weight_versions", raw["weight_versions"], booleans)
    if raw.get("token_versions") is not None:
        sample.token_versions = _int_list(rid, f"{where}.token_versions", raw["token_versions"], booleans)
    per_position: dict[str, npt.NDArray[Any]] = {
        name: float_list(rid, f"{where}.{name}", raw[name], booleans)
        for name in PER_POSITION_FLOATS
        if raw.get(name) is not None
    }
    sample.weights = {name: per_position[name] for name in WEIGHT_FIELDS if name in per_position}
    sample.logprobs = per_position.get("logprobs")
    sample.trainer_logprobs = per_position.get("trainer_logprobs")
    if sample.token_versions is not None:
        per_position["token_versions"] = sample.token_versions
    n = len(sample.mask)
    for name, values in per_position.items():
        given = raw.get(name)
        if not (isinstance(given, np.ndarray) and np.may_share_memory(values, given)):
            sample.fresh.add(name)
        if len(values) != n:
            raise TraceError(rid, f"{where}.{name}", f"length {len(values)} differs from the mask's {n}")
    if sample.spans is not None and len(sample.spans) > n:
        # refused before the batch builds span tables (which could cost gigabytes)
        fault = span_fault(sample.spans, n)
        if fault is not None:
            span, reason = fault
            raise TraceError(rid, f"{where}.weight_versions[{span}]", reason)
    return sample


def check_head(raw: dict[str, Any]) -> ParsedRollout:
    """A record's fields but ``samples`` checked, as a rollout of no samples yet echoing them."""
    rid = raw.get("id")
    if not isinstance(rid, str) or not rid:
        raise TraceError(printable_id(rid), "id", "required non-empty string")
    check_text(rid, "id", rid)  # a store, an exporter or a JSON answer could not write it
    if unknown := sorted(set(raw) - _ROLLOUT_FIELDS):
        raise TraceError(rid, unknown[0], "unknown field")
    for name in ("group_id", "env"):
        if raw.get(name) is not None:
            if not isinstance(raw[name], str):
                raise TraceError(rid, name, f"expected a string, got {raw[name]!r}")
            check_text(rid, name, raw[name])
    if raw.get("env") == "":  # an empty env would make a "staleness/env//..." key
        raise TraceError(rid, "env", "must be a non-empty string when present")
    source = raw.get("source", "live")
    if source not in ("live", "frozen"):
        raise TraceError(rid, "source", f"expected 'live' or 'frozen', got {source!r}")
    agentic = raw.get("agentic", False)
    if not isinstance(agentic, bool):
        raise TraceError(rid, "agentic", f"expected a boolean, got {agentic!r}")
    dispatch = raw.get("dispatch_version")
    if dispatch is None and source == "live":
        raise TraceError(rid, "dispatch_version", "required on a live rollout")
    dispatch = _version(rid, "dispatch_version", dispatch)
    completion = _version(rid, "completion_version", raw.get("completion_version"))
    group_id, env = raw.get("group_id"), raw.get("env")
    return ParsedRollout(rid, dispatch, completion, source == "frozen", agentic, group_id, env, [], raw)


def _version(rid: str, name: str, value: object) -> int:
    if value is None:
        return -1
    if not _is_int(value):
        raise TraceError(rid, name, f"expected an integer, got {value!r}")
    if not 0 <= value <= MAX_VERSION:  # type: ignore[operator]
        raise TraceError(rid, name, f"must be in 0..{MAX_VERSION}, got {value}")
    return value  # type: ignore[return-value]


def parse_rollout(raw: object, *, booleans: bool = True) -> ParsedRollout:
    """Type-check one record or raise TraceError (``booleans=False``: no true/false in its JSON)."""
    if not isinstance(raw, Mapping):
        raise TraceError(None, "rollout", f"expected an object, got {type(raw).__name__}")
    rollout = check_head({k: v for k, v in raw.items() if k != "samples"})
    samples = raw.get("samples")
    if not isinstance(samples, list):
        raise TraceError(rollout.id, "samples", "required list of samples")
    if not samples:
        raise TraceError(rollout.id, "samples", "must hold at least one sample")
    rollout.samples = [_parse_sample(rollout.id, i, s, booleans) for i, s in enumerate(samples)]
    return rollout


def parse_or_error(raw: object, *, booleans: bool = True) -> ParsedRollout | UnparsedRollout:
    """:func:`parse_rollout`, a refused record returned as an :class:`UnparsedRollout` (one given
    stays one: an adapter's refused row is set aside through the monitor's own ``add``)."""
    if isinstance(raw, UnparsedRollout):
        return raw
    try:
        return parse_rollout(raw, booleans=booleans)
    except TraceError as error:
        env = raw.get("env") if isinstance(raw, Mapping) else None
        return UnparsedRollout(error, env if isinstance(env, str) else None)


def pack(rollouts: Iterable[ParsedRollout], *, adopt: bool = False) -> RolloutBatch:
    """Parsed rollouts as one batch; ``adopt``: a one-sample column the parse made is not copied."""
    rollouts = list(rollouts)
    samples = [s for r in rollouts for s in r.samples]
    lengths = [len(s.mask) for s in samples]
    position_offsets = np.array([0, *accumulate(lengths)], dtype=np.int64)
    total = int(position_offsets[-1])
    sample_offsets = np.array([0, *accumulate(len(r.samples) for r in rollouts)], dtype=np.int64)

    # float64 like the weights (the quick check of small adds); a large batch keeps its int8
    mask_dtype = np.int8 if total >= COMPACT_MASK_MIN_POSITIONS else np.float64
    mask = _flat([s.mask for s in samples], mask_dtype)
    label_kind = np.full(len(samples), LABELS_NONE, dtype=np.int8)
    label_kind[[s.token_versions is not None for s in samples]] = LABELS_TOKENS
    label_kind[[s.spans is not None for s in samples]] = LABELS_SPANS

    # one sample's arrays the parse made: taken uncopied when ``adopt``
    fresh = samples[0].fresh if adopt and len(samples) == 1 else set()
    floats: dict[str, Any] = {}
    present: dict[str, npt.NDArray[np.bool_]] = {}
    for name in PER_POSITION_FLOATS:
        weight = name in WEIGHT_FIELDS
        given = [s.weights.get(name) if weight else getattr(s, name) for s in samples]
        fill = _FILLS.get(name, 0.0)
        floats[name], flags = _column(given, lengths, fill, np.float64, name in fresh)
        if floats[name] is not None:
            present[name] = flags
    # int64, or in a large batch the narrowest signed dtype the parse gave (no int64 copy)
    given_versions = [s.token_versions for s in samples]
    versions_dtype: Any = np.int64
    if mask_dtype is np.int8:
        labelled = [v for v in given_versions if v is not None]
        if labelled and all(v.dtype in _NARROW_VERSIONS for v in labelled):
            versions_dtype = np.result_type(*labelled, np.int8)  # -1 (the fill) fits every one
    adopt_versions = "token_versions" in fresh
    token_versions, _ = _column(given_versions, lengths, -1, versions_dtype, adopt_versions)
    span_counts = [0 if s.spans is None else len(s.spans) for s in samples]
    span_table = [s.spans for s in samples if s.spans is not None and len(s.spans)]
    none: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
    # each column straight from the pairs' columns (never a joined (k, 2) copy besides them)
    span_versions = np.concatenate([t[:, 0] for t in span_table], dtype=np.int64) if span_table else none
    span_starts = np.concatenate([t[:, 1] for t in span_table], dtype=np.int64) if span_table else none
    narrow = token_versions is not None and token_versions.dtype in _NARROW_VERSIONS
    batch = RolloutBatch(
        ids=[r.id for r in rollouts],
        sample_offsets=sample_offsets,
        position_offsets=position_offsets,
        mask=mask,
        dispatch_version=np.array([r.dispatch_version for r in rollouts], dtype=np.int64),
        completion_version=np.array([r.completion_version for r in rollouts], dtype=np.int64),
        frozen=np.array([r.frozen for r in rollouts], dtype=bool),
        agentic=np.array([r.agentic for r in rollouts], dtype=bool),
        group_ids=[r.group_id for r in rollouts],
        envs=[r.env for r in rollouts],
        **floats,
        token_versions=None if narrow else token_versions,
        span_offsets=np.array([0, *accumulate(span_counts)], dtype=np.int64),
        span_versions=span_versions,
        span_starts=span_starts,
        label_kind=label_kind,
        present=present,
        echo=[r.echo for r in rollouts],
    )
    if narrow:  # set after the constructor, which makes a caller's versions int64
        batch.token_versions = token_versions  # type: ignore[assignment]
    return batch


def _column(
    values: list[npt.NDArray[Any] | None], lengths: list[int], fill: float, dtype: type, adopt: bool
) -> tuple[npt.NDArray[Any] | None, npt.NDArray[np.bool_]]:
    """A per-position column (None: filled) and which samples gave it; wrong lengths are kept."""
    given = [v for v in values if v is not None]
    if not given:
        return None, _NONE_PRESENT
    if len(given) == len(values):
        present = np.ones(len(values), dtype=bool)
        only = given[0]
        return (only if adopt and only.dtype == dtype and only.ndim == 1 else _flat(given, dtype)), present
    present = np.array([v is not None for v in values], dtype=bool)
    if all(len(v) == n for v, n in zip(values, lengths) if v is not None):
        # the usual case: the given parts in place, the fill elsewhere (no array per missing part)
        out: npt.NDArray[Any] = np.full(sum(lengths), fill, dtype=dtype)
        for v, start, n in zip(values, accumulate(lengths, initial=0), lengths):
            if v is not None:
                out[start : start + n] = v
        return out, present
    parts = [v if v is not None else np.full(n, fill) for v, n in zip(values, lengths)]
    return _flat(parts, np.float64), present


def _flat(values: list[npt.NDArray[Any]], dtype: type) -> npt.NDArray[Any]:
    return np.concatenate(values, dtype=dtype, casting="unsafe") if values else np.zeros(0, dtype=dtype)
