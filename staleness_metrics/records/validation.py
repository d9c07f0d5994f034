"""Value rules of SPEC 3, vectorised on the columnar form (Python only names offenders), and the
quick check of a small add in one compiled pass: "plain" or "not sure"."""

from __future__ import annotations

import itertools
import math
from collections.abc import Container, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..compiled import CompiledLoop
from ..errors import FieldError, TraceError
from . import columnar
from .columnar import LABELS_NONE, LABELS_SPANS, LABELS_TOKENS, PER_POSITION_FLOATS, RolloutBatch

IntArray = npt.NDArray[np.int64]

# what a JSON store keeps exactly (orjson writes 254 levels; a record is never deeper than 5)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STORED_DEPTH = 128
_GROUP_TYPES = frozenset({str, type(None)})  # what a group id may be


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate in ``text`` (which UTF-8 cannot encode), else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


def surrogate_reason(text: str, at: int) -> str:
    return f"not valid Unicode: lone surrogate U+{ord(text[at]):04X} at character {at}"


def check_text(rollout_id: str | None, field: str, text: str) -> None:
    """Raise :class:`TraceError` naming ``field`` when ``text`` holds a lone surrogate."""
    if (at := lone_surrogate(text)) is not None:
        raise TraceError(printable_id(rollout_id), field, surrogate_reason(text, at))


def printable_id(rollout_id: object) -> str | None:
    """``rollout_id`` with any lone surrogate escaped, so an error naming it can be encoded."""
    text = None if rollout_id is None else str(rollout_id)  # (an id of no string: named as one)
    if text is None or lone_surrogate(text) is None:
        return text
    return text.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")


_PLAIN_SCALARS = frozenset({int, float, bool, type(None)})


def _first_big_int(values: list[Any]) -> int | None:
    """Index of the first integer outside signed 64 bits in a list of scalars, else None."""
    kinds = set(map(type, values))
    if int not in kinds:
        return None
    if kinds <= {int, bool} and min(values) >= INT64_MIN and max(values) <= INT64_MAX:
        return None
    for index, value in enumerate(values):
        if type(value) is int and not INT64_MIN <= value <= INT64_MAX:
            return index
    return None


def unstorable(value: Any) -> tuple[str, str] | None:
    """``(field, reason)`` of the first part of a value a JSON store cannot keep exactly."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, where, level = stack.pop()
        kind = type(item)
        if kind is str and (at := lone_surrogate(item)) is not None:
            return where or "value", surrogate_reason(item, at)
        if kind is int and not INT64_MIN <= item <= INT64_MAX:
            return where or "value", "integer outside the signed 64-bit range"
        if isinstance(item, (dict, list, tuple)) and level >= MAX_STORED_DEPTH:
            return where or "value", f"nested deeper than {MAX_STORED_DEPTH} levels"
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                name = f"{where}.{key}" if where else str(key)
                if type(key) is str and lone_surrogate(key) is not None:
                    return printable_id(name) or name, surrogate_reason(key, lone_surrogate(key) or 0)
                children.append((child, name, level + 1))
            stack.extend(reversed(children))  # first field first, as the library reads them
        elif isinstance(item, (list, tuple)):  # a per-position list: no per-item Python code
            if set(map(type, item)) <= _PLAIN_SCALARS:
                if (big := _first_big_int(list(item))) is not None:
                    return f"{where}[{big}]", "integer outside the signed 64-bit range"
                continue
            stack.extend((item[i], f"{where}[{i}]", level + 1) for i in range(len(item) - 1, -1, -1))
    return None


class Verdicts:
    """The first error found for each invalid rollout of a batch (rollout index -> error)."""

    def __init__(self, batch: RolloutBatch) -> None:
        self.batch = batch
        self.errors: dict[int, TraceError] = {}
        self._sample_rollout = np.searchsorted(batch.sample_offsets, np.arange(batch.n_samples), "right") - 1

    def rollout(self, index: int, field: str, reason: str) -> None:
        if index not in self.errors:
            self.errors[index] = TraceError(printable_id(self.batch.ids[index]), field, reason)

    def sample(self, sample: int, field: str, reason: str) -> None:
        rollout = int(self._sample_rollout[sample])
        local = sample - int(self.batch.sample_offsets[rollout])
        self.rollout(rollout, f"samples[{local}].{field}", reason)

    def positions(self, positions: Iterable[int], field: str, describe: str) -> None:
        """Report offending flat positions (the first one per rollout)."""
        offsets = self.batch.position_offsets
        for position in positions:
            sample = int(np.searchsorted(offsets, position, "right") - 1)
            self.sample(sample, field, f"position {position - int(offsets[sample])}: {describe}")

    @property
    def invalid(self) -> npt.NDArray[np.bool_]:
        flags = np.zeros(self.batch.n_rollouts, dtype=bool)
        flags[list(self.errors)] = True
        return flags


def _check_shapes(batch: RolloutBatch) -> None:
    """Structural consistency of the arrays themselves: a caller bug, not a bad rollout (each is
    1-d: ``RolloutBatch`` checks it)."""
    n_positions = batch.n_positions
    for name, offsets, total in (
        ("position_offsets", batch.position_offsets, n_positions),
        ("sample_offsets", batch.sample_offsets, batch.n_samples),
    ):
        if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != total or np.any(np.diff(offsets) < 0):
            raise FieldError(name, f"must start at 0, never decrease and end at {total}")
    if len(batch.sample_offsets) != batch.n_rollouts + 1:
        raise FieldError("sample_offsets", "must have one entry per rollout plus one")
    for name in (n for n in columnar.PER_ROLLOUT_ARRAYS if getattr(batch, n) is not None):
        if len(getattr(batch, name)) != batch.n_rollouts:
            raise FieldError(name, "must have one entry per rollout")
    for name in (*PER_POSITION_FLOATS, "token_versions"):
        values = getattr(batch, name)
        if values is not None and len(values) != n_positions:
            raise FieldError(name, f"must have one entry per position ({n_positions})")
    if batch.span_offsets is not None:
        assert batch.span_versions is not None and batch.span_starts is not None
        if len(batch.span_offsets) != batch.n_samples + 1 or batch.span_offsets[-1] != len(batch.span_versions):
            raise FieldError("span_offsets", "must have one entry per sample plus one and end at the span count")


def _ascii(text: object) -> bool:
    """None, or an ASCII string (CPython knows it without reading the string)."""
    return text is None or (type(text) is str and text.isascii())


def _plain_envs(envs: Sequence[Any]) -> bool:
    """Whether every env is None or a non-empty string, judged on the distinct values."""
    if len(envs) == 1:
        return envs[0] is None or (type(envs[0]) is str and envs[0] != "")
    try:
        distinct = set(envs)
    except TypeError:  # an unhashable env: the loop names it
        return False
    return all(env is None or (type(env) is str and env) for env in distinct)


def _strings_joined(texts: Sequence[Any]) -> str:
    """The strings of ``texts`` joined, in one C-level join when every item is a string."""
    try:
        return "".join(texts)
    except TypeError:
        if texts.count(None) == len(texts):
            return ""
        return "".join([text for text in texts if isinstance(text, str)])


def check_batch(batch: RolloutBatch, *, token_values: bool = True) -> Verdicts:
    """SPEC 3 rules on ids, versions and spans; returns the invalid rollouts (engine.spans checks
    position values, token versions too without ``token_values``; :func:`mark_duplicates` last)."""
    _check_shapes(batch)
    verdicts = Verdicts(batch)
    field, reason = batch.unmaskable() or ("", "")
    for index in range(batch.n_rollouts) if field else ():
        verdicts.rollout(index, field, reason)

    # set operations first; the loops that name offenders run only when there are some
    ids, group_ids, envs = batch.ids, batch.group_ids or (), batch.envs or ()
    if not (_plain_ids(ids, group_ids) and _plain_envs(envs)):
        for index, (rid, group, env) in enumerate(zip(ids, group_ids, envs, strict=True)):
            if not isinstance(rid, str) or not rid:
                verdicts.rollout(index, "id", "required non-empty string")
            elif group is not None and not isinstance(group, str):
                verdicts.rollout(index, "group_id", f"expected a string, got {group!r}")
            elif env is not None and (not isinstance(env, str) or not env):
                verdicts.rollout(index, "env", f"must be a non-empty string when present, got {env!r}")
    for index in np.flatnonzero(np.diff(batch.sample_offsets) == 0).tolist():
        verdicts.rollout(index, "samples", "must hold at least one sample")
    for name, texts in (("id", ids), ("group_id", group_ids), ("env", envs)):
        if lone_surrogate(_strings_joined(texts)) is not None:
            for index, text in enumerate(texts):
                if isinstance(text, str) and (at := lone_surrogate(text)) is not None:
                    verdicts.rollout(index, name, surrogate_reason(text, at))

    live = ~np.asarray(batch.frozen, dtype=bool)
    d, c = batch.dispatch_version, batch.completion_version
    assert c is not None
    for wrong, name, reason in (
        (live & (d < 0), "dispatch_version", "must be >= 0 on a live rollout, got {d}"),
        (~live & (d < -1), "dispatch_version", "must be >= 0, got {d}"),
        (c < -1, "completion_version", "must be >= 0, got {c}"),
        ((c >= 0) & (d >= 0) & (c < d), "completion_version", "{c} is below dispatch_version {d}"),
    ):
        for index in np.flatnonzero(wrong).tolist():
            verdicts.rollout(index, name, reason.format(d=d[index], c=c[index]))

    kind, given = batch.label_kind, (batch.span_offsets is not None, batch.token_versions is not None)
    assert kind is not None
    if fault := columnar.label_kind_fault(kind, batch.n_samples, *given):
        raise FieldError("label_kind", fault)
    if batch.token_versions is not None and token_values:
        tokens = batch.token_versions
        if tokens.min(initial=0) < -1:  # one read in the common case; the rest only on bad input
            sample_has_tokens = np.repeat(kind == LABELS_TOKENS, np.diff(batch.position_offsets))
            bad = np.flatnonzero(sample_has_tokens & (tokens < -1))
            # the first of each sample: bounds the Python work on bad input
            samples = np.searchsorted(batch.position_offsets, bad, "right") - 1
            first = bad[np.unique(samples, return_index=True)[1]]
            verdicts.positions(first, "token_versions", "versions are >= 0 or -1")
    if batch.span_offsets is not None:
        _check_spans(batch, verdicts)
    return verdicts


_SPAN_PIECE = 1 << 18  # spans checked at once: a few MB of temporaries whatever the count


def _span_reason(rule: int, versions: IntArray, starts: IntArray, span: int, length: Any) -> str:
    if rule == 0:
        return f"version {versions[span]} is negative (only -1 marks unlabelled)"
    return f"start {starts[span]} is outside 0..{length - 1}" if rule == 1 else "span starts must strictly increase"


def _first_of_each(span_sample: IntArray, spans: IntArray) -> list[int]:
    """The first of ``spans`` (ascending) in each sample."""
    if spans.size == 0:
        return []
    _, first = np.unique(span_sample[spans], return_index=True)
    return [int(span) for span in spans[first]]


def _span_faults(
    offsets: IntArray, versions: IntArray, starts: IntArray, sample_lengths: IntArray
) -> tuple[list[int], list[int], list[int]]:
    """Per span rule (version >= -1, start inside, increasing), each sample's first offender."""
    found: tuple[list[int], list[int], list[int]] = ([], [], [])
    for a in range(0, len(versions), _SPAN_PIECE):
        b = min(a + _SPAN_PIECE, len(versions))
        # the span before the piece: its start is compared with the piece's first
        lo = max(a - 1, 0)
        window_sample = np.searchsorted(offsets, np.arange(lo, b), "right") - 1
        span_sample = window_sample[a - lo :]
        found[0].extend(a + s for s in _first_of_each(span_sample, np.flatnonzero(versions[a:b] < -1)))
        outside = (starts[a:b] < 0) | (starts[a:b] >= sample_lengths[span_sample])
        found[1].extend(a + s for s in _first_of_each(span_sample, np.flatnonzero(outside)))
        same_sample = window_sample[1:] == window_sample[:-1]
        falling = np.flatnonzero(same_sample & (starts[lo + 1 : b] <= starts[lo : b - 1])) + (lo + 1 - a)
        found[2].extend(a + s for s in _first_of_each(span_sample, falling))
    return found


def _check_spans(batch: RolloutBatch, verdicts: Verdicts) -> None:
    """The span rules; offenders reported rule by rule, each in span order."""
    assert batch.span_offsets is not None and batch.span_versions is not None and batch.span_starts is not None
    offsets, versions, starts = batch.span_offsets, batch.span_versions, batch.span_starts
    sample_lengths = np.diff(batch.position_offsets)
    found = _span_faults(offsets, versions, starts, sample_lengths)
    every = [*found[0], *found[1], *found[2]]
    span_sample_of = np.searchsorted(offsets, np.array(every, dtype=np.int64), "right") - 1
    sample_of = dict(zip(every, span_sample_of.tolist(), strict=True))
    for rule, spans in enumerate(found):
        for span in spans:
            sample = sample_of[span]
            reason = _span_reason(rule, versions, starts, span, sample_lengths[sample])
            verdicts.sample(sample, f"weight_versions[{span - offsets[sample]}]", reason)


def span_fault(pairs: npt.NDArray[np.signedinteger[Any]], length: int) -> tuple[int, str] | None:
    """``(span, reason)`` of the first fault :func:`check_batch` finds in one sample's pairs."""
    versions, starts = pairs[:, 0], pairs[:, 1]
    bounds = np.array([0, len(pairs)], dtype=np.int64)
    found = _span_faults(bounds, versions, starts, np.array([length], dtype=np.int64))
    for rule, spans in enumerate(found):
        if spans:
            return spans[0], _span_reason(rule, versions, starts, spans[0], length)
    return None


def _plain_ids(ids: Sequence[Any], groups: Sequence[Any]) -> bool:
    """Whether every id is a non-empty string, every group id a string or None (False: not sure)."""
    if len(ids) == 1:  # (the usual single add: no sets)
        return type(ids[0]) is str and ids[0] != "" and type(groups[0]) in _GROUP_TYPES
    return set(map(type, ids)) == {str} and "" not in ids and set(map(type, groups)) <= _GROUP_TYPES


def mark_duplicates(verdicts: Verdicts, known_ids: Container[str]) -> None:
    """Each rollout otherwise valid whose id is known or a valid one's before it: invalid. Checked
    last, so a rollout refused for another reason leaves its id free, as when each is added alone."""
    ids = verdicts.batch.ids
    if not verdicts.errors and _ids_new(ids, known_ids):
        return
    seen: set[str] = set()
    for index, rid in enumerate(ids):
        if index not in verdicts.errors:  # (an id that is no string is one of them)
            if rid in known_ids or rid in seen:
                verdicts.rollout(index, "id", "duplicate id: a rollout with this id was already added")
            seen.add(rid)


def _ids_new(ids: Sequence[str], known: Container[str]) -> bool:
    """Whether the ids are distinct and none is known (False too when ``known`` is no set)."""
    if not isinstance(known, (set, frozenset)):
        return False
    return ids[0] not in known if len(ids) == 1 else len(set(ids)) == len(ids) and known.isdisjoint(ids)


def plainly_valid(batch: RolloutBatch, known_ids: Container[str] = frozenset(), *, positions: bool = True) -> bool:
    """Whether the exact checks find nothing (False: not sure); ``positions``: theirs too."""
    ids, mask, group_ids, envs = batch.ids, batch.mask, batch.group_ids, batch.envs
    frozen, agentic = batch.frozen, batch.agentic
    n_rollouts, n_positions = len(ids), len(mask)
    if n_rollouts == 0 or n_positions == 0:
        return False  # nothing to gain; the exact path says what an empty batch means
    if (  # (each array is 1-d: RolloutBatch checks it)
        batch.label_kind is None
        or batch.completion_version is None
        or frozen is None
        or agentic is None
        or group_ids is None
        or envs is None
        or not n_rollouts == len(frozen) == len(agentic) == len(group_ids) == len(envs)
    ):
        return False  # (the other arrays' lengths and shapes: plain_values_of)
    for values in (batch.rl_weights, batch.ce_weights, batch.ref_kl_weights, batch.logprobs,
                   batch.trainer_logprobs, batch.token_versions):  # fmt: skip
        if values is not None and (len(values) != n_positions or values.ndim != 1):
            return False
    if not _plain_ids(ids, group_ids) or not _ids_new(ids, known_ids):
        return False
    if not (n_rollouts == 1 and _ascii(ids[0]) and _ascii(group_ids[0]) and _ascii(envs[0])) and (
        lone_surrogate("".join(map(str, itertools.chain(ids, group_ids, envs)))) is not None
    ):
        return False  # (one encode for all: a lone surrogate stays one when strings are joined)
    return _plain_envs(envs) and (not positions or plain_values_of(batch))


def plain_values_of(batch: RolloutBatch) -> bool:
    """Whether a batch :func:`plainly_valid` passed holds position values the exact checks take."""
    mask, tokens = batch.mask, batch.token_versions
    weights = (batch.rl_weights, batch.ce_weights, batch.ref_kl_weights)
    kind, has_spans = batch.label_kind, batch.span_offsets is not None
    assert kind is not None and batch.completion_version is not None  # (plainly_valid checked them)
    labels = 1 << LABELS_NONE | has_spans << LABELS_SPANS | (tokens is not None) << LABELS_TOKENS
    rows = BatchRows(len(batch.ids), batch.sample_offsets, batch.position_offsets, batch.dispatch_version,
                     batch.completion_version, kind, labels)  # fmt: skip
    return plain_values(rows, mask, weights, tokens) and (not has_spans or _plain_spans(batch))


def _plain_spans(batch: RolloutBatch) -> bool:
    """Whether the spans obey :func:`_check_spans`' rules (and have the shapes it needs)."""
    offsets, versions, starts = batch.span_offsets, batch.span_versions, batch.span_starts
    if offsets is None or versions is None or starts is None or len(starts) != len(versions):
        return False
    if len(offsets) != batch.n_samples + 1 or int(offsets[0]) != 0 or int(offsets[-1]) != len(versions):
        return False
    if len(versions) == 0:
        return not bool((offsets[1:] != 0).any())
    if (offsets[1:] < offsets[:-1]).any() or int(versions.min()) < -1 or int(starts.min()) < 0:
        return False
    counts = offsets[1:] - offsets[:-1]
    span_end = np.repeat(batch.position_offsets[1:] - batch.position_offsets[:-1], counts)
    if bool((starts >= span_end).any()):
        return False
    first = np.zeros(len(starts), dtype=bool)
    first[offsets[:-1][counts > 0]] = True
    return not bool((~first[1:] & (starts[1:] <= starts[:-1])).any())


def _finite(values: npt.NDArray[Any]) -> bool:  # pragma: no cover - compiled
    bad = False
    for x in values:
        bad |= not math.isfinite(x)
    return not bad


@CompiledLoop(callees={"_finite": (_finite, {})})
def _plain_values(
    n_rollouts: int,
    offsets: tuple[IntArray, IntArray, IntArray, IntArray],
    label_kind: npt.NDArray[np.int8],
    labels: int,
    values: tuple[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]],
    tokens: IntArray,
) -> bool:  # pragma: no cover - compiled
    # (plain tuples, not named tuples: numba types them as fast as flat arguments)
    mask, rl, ce, ref_kl = values
    sample_offsets, position_offsets, dispatch, completion = offsets
    n, n_samples = len(mask), len(position_offsets) - 1
    if n_samples < 0 or len(sample_offsets) != n_rollouts + 1 or len(dispatch) != n_rollouts:
        return False  # (the lengths every read below relies on)
    if len(completion) != n_rollouts or len(label_kind) != n_samples:
        return False
    covered = sample_offsets[n_rollouts] == n_samples and position_offsets[n_samples] == n
    if sample_offsets[0] != 0 or position_offsets[0] != 0 or not covered:
        return False
    for i in range(n_rollouts):  # a sample at least; versions as check_batch wants them
        d, c = dispatch[i], completion[i]
        if sample_offsets[i + 1] <= sample_offsets[i] or d < 0 or c < -1 or 0 <= c < d:
            return False  # (frozen ones too: -1 falls to the exact path)
    for j in range(n_samples):
        kind = label_kind[j]
        if position_offsets[j + 1] < position_offsets[j] or kind < 0 or kind > 2 or not (labels >> kind) & 1:
            return False
    bad = False
    for x in mask:
        bad |= (x != 0) & (x != 1)  # NaN too
    for t in tokens:
        bad |= t < -1
    return not bad and _finite(rl) and _finite(ce) and _finite(ref_kl)


_NO_TOKENS = np.zeros(0, dtype=np.int64)
_INT8 = np.dtype(np.int8)
# the mask dtypes the compiled pass reads (numba reads no float16)
_PLAIN_PADDING = {np.dtype(dtype): np.zeros(0, dtype=dtype) for dtype in (np.float32, np.float64)}


class BatchRows(NamedTuple):
    """A batch's rollout and sample rows (``labels``: bit ``k`` set if label kind ``k`` may be)."""

    n_rollouts: int
    sample_offsets: IntArray
    position_offsets: IntArray
    dispatch: IntArray
    completion: IntArray
    label_kind: npt.NDArray[np.int8]
    labels: int


Weights = tuple[npt.NDArray[Any] | None, npt.NDArray[Any] | None, npt.NDArray[Any] | None]


def plain_values(
    rows: BatchRows,
    mask: npt.NDArray[Any],
    weights: Weights,
    tokens: IntArray | None,
) -> bool:
    """Whether the values pass the exact checks (False: not sure)."""
    dtype = mask.dtype
    empty = _PLAIN_PADDING.get(dtype)
    n_rollouts, sample_offsets, position_offsets, dispatch, completion, label_kind, labels = rows
    if empty is None or mask.ndim != 1 or not mask.flags.carray or label_kind.dtype != _INT8:
        return False
    if not sample_offsets.ndim == position_offsets.ndim == dispatch.ndim == completion.ndim == label_kind.ndim == 1:
        return False  # (other shapes: the exact checks name them)
    rl, ce, ref_kl = [empty if v is None else v for v in weights]
    for values in (rl, ce, ref_kl):
        if values is not empty and (values.dtype != dtype or values.ndim != 1 or not values.flags.carray):
            return False
    loop = _plain_values.loaded()  # (the compiled loop itself once it is loaded)
    result: bool = loop(
        n_rollouts, (sample_offsets, position_offsets, dispatch, completion), label_kind, labels,
        (mask, rl, ce, ref_kl), _NO_TOKENS if tokens is None else tokens,
    )  # fmt: skip
    return result
