"""Rollouts in columnar form: flat per-position arrays with sample and rollout offsets, around a
caller's arrays without a copy (the sink masks them in place), or read from ``[B, L]`` rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypedDict

import numpy as np
import numpy.typing as npt

from ..errors import FieldError, FieldTypeError, TraceError

if TYPE_CHECKING:
    from typing_extensions import Unpack

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.floating[Any]]

WEIGHT_FIELDS = ("rl_weights", "ce_weights", "ref_kl_weights")
PER_POSITION_FLOATS = (*WEIGHT_FIELDS, "logprobs", "trainer_logprobs")
# The optional arrays of one value per rollout.
PER_ROLLOUT_ARRAYS = ("dispatch_version", "completion_version", "frozen", "agentic", "group_ids", "envs", "echo")

LABELS_NONE, LABELS_SPANS, LABELS_TOKENS = 0, 1, 2  # how a sample labelled its positions
MAX_VERSION = 2**53  # versions and positions far beyond any run, and exact in every JSON reader
_BEYOND = f"must be in 0..{MAX_VERSION}"  # (records' bound on versions)


def as_int64(values: Any, name: str, ids: Sequence[Any] | None = None) -> IntArray:
    """``values`` (1-d) as int64, refusing (by rollout, else index) any no int64 holds: 2.5, True,
    NaN, 2**70; with ``ids`` (rollouts' versions), any past records' bound too."""
    array = as_numpy(values, name)
    array = np.asarray(array.tolist()) if array.dtype.kind == "O" else array  # (Python numbers)
    if array.ndim != 1:
        raise FieldError(name, "must be a 1-d array")
    if array.dtype.kind != "i" and array.size:
        with np.errstate(invalid="ignore"):  # (NaN, inf and floats past int64 differ once cast)
            cast = array.astype(np.int64) if array.dtype.kind in "uf" else None
        exact = [type(v) is int and abs(v) <= MAX_VERSION for v in array.tolist()] if cast is None else cast == array
        if not np.all(exact):
            at = int(np.argmin(exact))
            huge = cast is None and type(array[at : at + 1].tolist()[0]) is int
            _refuse(name, array, at, ids, _BEYOND if huge else "expected an integer")
    out = np.ascontiguousarray(array, dtype=np.int64)
    if ids is not None and (past := np.flatnonzero(out > MAX_VERSION)).size:
        _refuse(name, out, int(past[0]), ids, _BEYOND)
    return out


def as_flags(values: npt.NDArray[Any], name: str, ids: Sequence[Any]) -> BoolArray:
    """Per-rollout flags: bools or the integers 0 and 1 (no truthiness: "False", NaN, 2 refused)."""
    if values.dtype.kind not in "biu":
        raise FieldError(name, f"expected bools (or 0 and 1), got dtype {values.dtype}")
    if (wrong := (values != 0) & (values != 1)).any():
        _refuse(name, values, int(np.argmax(wrong)), ids, "expected a bool, 0 or 1")
    return values.astype(bool, copy=False)


def _refuse(name: str, values: npt.NDArray[Any], at: int, ids: Sequence[Any] | None, what: str) -> NoReturn:
    """Refuse ``values[at]`` (``what`` it must be), naming its rollout if values are per rollout."""
    reason = f"{what}, got {values[at : at + 1].tolist()[0]!r}"
    if ids is None or len(ids) != len(values):
        raise FieldError(f"{name}[{at}]", reason)
    raise TraceError(ids[at] if isinstance(ids[at], str) else None, name, reason)


def label_kind_fault(kind: npt.NDArray[Any], n_samples: int, *given: bool) -> str | None:
    """Why ``kind`` cannot be ``n_samples`` samples' label kinds (``given``: spans, tokens)."""
    if kind.dtype.kind not in "iu" or kind.shape != (n_samples,):
        return f"expected one integer per sample ({n_samples}), got {kind.dtype} {kind.shape}"
    if ((kind < LABELS_NONE) | (kind > LABELS_TOKENS)).any():
        return "values are 0 (none), 1 (spans) or 2 (token versions)"
    for has, label, what in zip(given, (LABELS_SPANS, LABELS_TOKENS), ("spans", "token versions")):
        if not has and (kind == label).any():
            return f"a sample labelled by {what}, in a batch without {what}"
    return None


@dataclass
class RolloutBatch:
    """Rollouts in columnar form.

    Per rollout: ``ids``, ``dispatch_version`` (-1 where a frozen rollout has none),
    ``completion_version`` (-1: the newest sampled version), ``frozen``, ``agentic``, ``group_ids``,
    ``envs``; ``sample_offsets`` (R + 1) into the samples, ``position_offsets`` (S + 1) into the
    flat positions: ``mask`` (1 = sampled by the policy), the optional weights, ``logprobs`` and
    ``trainer_logprobs`` (NaN = missing), ``token_versions`` (-1 = unlabelled). Or version spans:
    ``span_offsets`` (S + 1) into ``span_versions`` / ``span_starts`` (relative to their sample).
    ``label_kind`` says per sample which (0 none, 1 spans, 2 token_versions; by default from what
    is given); ``present`` whether a sample carried each float array (a missing ``rl_weights``
    counts as 1.0, missing ce / ref-KL weights as 0). Arrays are masked in place."""

    ids: Sequence[str]
    sample_offsets: IntArray
    position_offsets: IntArray
    mask: FloatArray
    dispatch_version: IntArray
    completion_version: IntArray | None = None
    frozen: BoolArray | None = None
    agentic: BoolArray | None = None
    group_ids: Sequence[str | None] | None = None
    envs: Sequence[str | None] | None = None
    rl_weights: FloatArray | None = None
    ce_weights: FloatArray | None = None
    ref_kl_weights: FloatArray | None = None
    logprobs: FloatArray | None = None
    trainer_logprobs: FloatArray | None = None  # NaN where missing (SPEC 11: not an error)
    token_versions: IntArray | None = None
    span_offsets: IntArray | None = None
    span_versions: IntArray | None = None
    span_starts: IntArray | None = None
    label_kind: npt.NDArray[np.int8] | None = None
    present: dict[str, BoolArray] = field(default_factory=dict)
    echo: list[dict[str, Any]] | None = None  # records' fields for shipped output (else columns)
    padded: PaddedLayout | None = field(default=None, repr=False)  # from_padded's [B, L] rows

    def __post_init__(self) -> None:
        self.ids = _listed(self.ids)  # (numpy strings as str; the checks name an id no string)
        for name in ("sample_offsets", "position_offsets", "token_versions", "span_offsets",
                     "span_versions", "span_starts", "label_kind"):  # fmt: skip
            if getattr(self, name) is not None:
                setattr(self, name, as_int64(getattr(self, name), name))
        n_rollouts, n_samples = len(self.ids), max(len(self.position_offsets) - 1, 0)
        for name, fill in (("completion_version", -1), ("frozen", False), ("agentic", False)):
            if getattr(self, name) is None:  # (the newest sampled version; live; not agentic)
                setattr(self, name, np.full(n_rollouts, fill))
        self.dispatch_version = as_int64(self.dispatch_version, "dispatch_version", self.ids)
        self.completion_version = as_int64(self.completion_version, "completion_version", self.ids)
        self.group_ids = [None] * n_rollouts if self.group_ids is None else _listed(self.group_ids)
        self.envs = [None] * n_rollouts if self.envs is None else _listed(self.envs)
        for name in ("mask", "frozen", "agentic", *PER_POSITION_FLOATS):  # (used in place)
            if (value := getattr(self, name)) is None and name != "mask":
                continue
            if not isinstance(value, np.ndarray) or np.ma.isMA(value):  # (np.ma: its mask unread)
                raise FieldTypeError(name, f"expected a numpy array, got a {type(value).__name__}")
            if value.ndim != 1:
                raise FieldError(name, "must be a 1-d array")
            if value.dtype.kind == "V" or (name.endswith("logprobs") and value.dtype.kind not in "biufO"):
                raise FieldTypeError(name, f"expected numbers, got dtype {value.dtype}")
            if name in ("frozen", "agentic"):
                setattr(self, name, as_flags(value, name, self.ids))
        tokens = self.token_versions is not None
        if self.label_kind is None:
            self.label_kind = np.full(n_samples, LABELS_TOKENS if tokens else LABELS_NONE, np.int8)
            if not tokens and self.span_offsets is not None and len(self.span_offsets) == n_samples + 1:
                self.label_kind[np.diff(self.span_offsets) > 0] = LABELS_SPANS
        elif reason := label_kind_fault(self.label_kind, n_samples):  # (pack sets its tokens later)
            raise FieldError("label_kind", reason)
        self.label_kind = self.label_kind.astype(np.int8, copy=False)
        for name in PER_POSITION_FLOATS:
            if getattr(self, name) is not None and name not in self.present:
                self.present[name] = np.ones(n_samples, dtype=bool)
        for name, flags in self.present.items():
            if np.shape(flags) != (n_samples,):
                raise FieldError(f"present.{name}", f"expected one entry per sample ({n_samples})")

    @classmethod
    def from_padded(cls, ids: Sequence[str], mask: Any, **columns: Unpack[PaddedColumns]) -> RolloutBatch:
        """One rollout of one sample per row of ``[B, L]`` arrays (numpy or any array-like).

        - ``mask``: the loss / response mask, 1 (or True) on positions sampled by the policy.
        - ``token_versions`` ``[B, L]`` (any negative: unlabelled), or ``dispatch_version`` ``[B]``
          (by default the oldest label of the row's valid positions; a live row with neither
          raises ``TraceError``).
        - ``lengths`` ``[B]`` with ``padding_side`` (``"right"`` or ``"left"``), or
          ``attention_mask`` ``[B, L]``: which positions hold tokens (by default all). Labels on
          padding are ignored; a padding position with mask 1 (or a ce / ref-KL weight) raises
          ``TraceError``.
        - ``rl_weights``, ``ce_weights``, ``ref_kl_weights``, ``logprobs``, ``trainer_logprobs``
          ``[B, L]``; ``completion_version``, ``group_ids``, ``envs``, ``frozen``, ``agentic`` per row.

        C-contiguous mask and weight arrays are masked in place by the sink;
        :func:`~staleness_metrics.engine.shipment.padded_shipment` reads them back either way."""
        return cls(**padded_columns(ids, mask, **columns))

    def unmaskable(self) -> tuple[str, str] | None:
        """``(field, reason)`` of the first array the sink cannot mask in place, else None."""
        for name in ("mask", *(n for n in WEIGHT_FIELDS if getattr(self, n) is not None)):
            values = getattr(self, name)
            if values.dtype.kind not in "biuf" or values.dtype.itemsize > 8:
                return name, f"unsupported dtype {values.dtype}"
            if not values.flags.writeable:
                return name, "read-only: the sink masks it in place"
        return None

    @property
    def n_rollouts(self) -> int:
        return len(self.ids)

    @property
    def n_samples(self) -> int:
        return len(self.position_offsets) - 1

    @property
    def n_positions(self) -> int:
        return len(self.mask)


@dataclass(frozen=True)
class PaddedLayout:
    """How a batch built by :meth:`RolloutBatch.from_padded` maps back to its ``[B, L]`` rows."""

    rows: int
    width: int


class PaddedColumns(TypedDict, total=False):
    """The keyword arguments of :meth:`RolloutBatch.from_padded` (each optional)."""

    dispatch_version: Any
    token_versions: Any
    completion_version: Any
    lengths: Any
    attention_mask: Any
    padding_side: Literal["right", "left"]
    rl_weights: Any
    ce_weights: Any
    ref_kl_weights: Any
    logprobs: Any
    trainer_logprobs: Any
    group_ids: Sequence[str | None] | None
    envs: Sequence[str | None] | None
    frozen: Any
    agentic: Any


def as_numpy(values: Any, name: str | None = None) -> npt.NDArray[Any]:
    """An array-like (the field ``name``) as numpy: a tensor detached on the CPU (a CPU one's own
    memory), bfloat16 read as float32 (numpy has none)."""
    if hasattr(values, "detach"):
        if getattr(values, "is_meta", False):
            raise FieldTypeError(name, "a tensor on the meta device holds no values")
        values = values.detach().cpu()
        values = values.float() if str(values.dtype) == "torch.bfloat16" else values
    return np.asarray(values)


def _matrix(name: str, values: Any, shape: tuple[int, int] | None) -> npt.NDArray[Any]:
    array = as_numpy(values, name)
    if array.ndim != 2:
        raise FieldError(name, f"expected a [B, L] array, got shape {array.shape}")
    if shape is not None and array.shape != shape:
        raise FieldError(name, f"shape {array.shape} differs from the mask's {shape}")
    return array


def _per_row(name: str, values: Any, rows: int) -> npt.NDArray[Any] | None:
    if values is None:
        return None
    array = as_numpy(values, name)
    if array.shape != (rows,):
        raise FieldError(name, f"expected {rows} values (one per row), got shape {array.shape}")
    return array


def _listed(values: Any) -> Any:
    """A numpy column as a list of Python objects (``str``, not ``np.str_``); else ``values``."""
    return values.tolist() if isinstance(values, np.ndarray) else values


def _row_list(name: str, values: Sequence[Any] | None, rows: int) -> list[Any] | None:
    if values is None:
        return None
    out = list(_listed(values))
    if len(out) != rows:
        raise FieldError(name, f"expected {rows} values (one per row), got {len(out)}")
    return out


def _valid(shape: tuple[int, int], columns: dict[str, Any]) -> BoolArray | None:
    """``[B, L]``: which positions hold tokens; None when every position holds one."""
    rows, width = shape
    lengths, attention_mask = columns.get("lengths"), columns.get("attention_mask")
    if lengths is not None and attention_mask is not None:
        raise FieldError("lengths", "give either lengths or attention_mask, not both")
    if attention_mask is not None:
        return _matrix("attention_mask", attention_mask, shape) != 0  # type: ignore[no-any-return]
    if lengths is None:
        return None
    length = as_int64(_per_row("lengths", lengths, rows), "lengths")
    if ((length < 0) | (length > width)).any():
        raise FieldError("lengths", f"every length must lie in 0..{width}")
    side = columns.get("padding_side", "right")
    if side == "right":
        return np.arange(width)[None, :] < length[:, None]  # type: ignore[no-any-return]
    if side == "left":
        return np.arange(width)[None, :] >= (width - length)[:, None]  # type: ignore[no-any-return]
    raise FieldError("padding_side", f"expected 'right' or 'left', got {side!r}")


def _label_spans(labels: npt.NDArray[Any], valid: BoolArray | None) -> tuple[IntArray, IntArray, IntArray]:
    """``[B, L]`` labels as spans (offsets, versions, starts), -1 for unlabelled and padding."""
    if labels.dtype.kind not in "iu":
        raise FieldError("token_versions", f"expected integers, got {labels.dtype}")
    rows, width = labels.shape
    if width == 0:
        empty = np.zeros(0, dtype=np.int64)
        return np.zeros(rows + 1, dtype=np.int64), empty, empty
    keys = np.arange(rows, dtype=np.int64) * width
    if width > 1:
        change = labels[:, 1:] != labels[:, :-1]
        if valid is not None:
            change |= valid[:, 1:] != valid[:, :-1]
        at = np.flatnonzero(change)
        keys = np.sort(np.concatenate((keys, (at // (width - 1)) * width + at % (width - 1) + 1)))
    row, column = keys // width, keys % width
    versions = np.maximum(labels[row, column].astype(np.int64), -1)
    if valid is not None:
        versions = np.where(valid[row, column], versions, -1)
    offsets = np.concatenate(([0], np.cumsum(np.bincount(row, minlength=rows)))).astype(np.int64)
    return offsets, versions, column


def padded_columns(ids: Sequence[str], mask: Any, **columns: Unpack[PaddedColumns]) -> dict[str, Any]:
    """:meth:`RolloutBatch.from_padded`'s constructor arguments (flat views where it can)."""
    unknown = sorted(set(columns) - PaddedColumns.__optional_keys__)
    if unknown:
        raise TypeError(f"padded_columns() got an unexpected keyword argument {unknown[0]!r}")
    mask_2d = _matrix("mask", mask, None)
    rows, width = shape = (int(mask_2d.shape[0]), int(mask_2d.shape[1]))
    id_list = _row_list("ids", ids, rows) or []
    given: dict[str, Any] = dict(columns)
    valid = _valid(shape, given)
    arrays = {n: _matrix(n, given[n], shape) for n in PER_POSITION_FLOATS if given.get(n) is not None}
    if valid is not None:
        for name in ("mask", *(n for n in ("ce_weights", "ref_kl_weights") if n in arrays)):
            bad = np.flatnonzero(((~valid) & (arrays.get(name, mask_2d) != 0)).any(axis=1))
            if len(bad):
                reason = "nonzero on a padding position"
                raise TraceError(id_list[int(bad[0])], f"samples[0].{name}", reason)
    frozen = _per_row("frozen", given.get("frozen"), rows)
    frozen_rows = np.zeros(rows, bool) if frozen is None else as_flags(frozen, "frozen", id_list)
    tokens = given.get("token_versions")
    labels = None if tokens is None else _matrix("token_versions", tokens, shape)
    if labels is not None and labels.dtype.kind == "u":  # (uint64 past int64: refused, not wrapped)
        labels = as_int64(labels.reshape(-1), "token_versions").reshape(shape)
    spans = None if labels is None else _label_spans(labels, valid)
    offsets = np.arange(rows + 1, dtype=np.int64)
    return dict(
        ids=id_list,
        sample_offsets=offsets,
        position_offsets=offsets * width,
        mask=mask_2d.reshape(-1),
        dispatch_version=_dispatch(given.get("dispatch_version"), spans, frozen_rows, id_list),
        completion_version=_per_row("completion_version", given.get("completion_version"), rows),
        frozen=frozen_rows,
        agentic=_per_row("agentic", given.get("agentic"), rows),  # (RolloutBatch reads the flags)
        group_ids=_row_list("group_ids", given.get("group_ids"), rows),
        envs=_row_list("envs", given.get("envs"), rows),
        span_offsets=None if spans is None else spans[0],
        span_versions=None if spans is None else spans[1],
        span_starts=None if spans is None else spans[2],
        **{n: arrays[n].reshape(-1) if n in arrays else None for n in PER_POSITION_FLOATS},
        padded=PaddedLayout(rows, width),
    )


def _dispatch(
    given: Any, spans: tuple[IntArray, IntArray, IntArray] | None, frozen: BoolArray, ids: list[str]
) -> IntArray:
    """Per row the dispatch version given, else its oldest label (-1 for a frozen row)."""
    rows = len(frozen)
    if given is not None:
        return as_int64(_per_row("dispatch_version", given, rows), "dispatch_version", ids)
    if spans is None:
        if not frozen.all():  # (argmin: the first row not frozen)
            reason = "required: give dispatch_version or token_versions"
            raise TraceError(ids[int(np.argmin(frozen))], "dispatch_version", reason)
        return np.full(rows, -1, dtype=np.int64)
    span_offsets, span_versions, _ = spans
    big = np.iinfo(np.int64).max
    oldest = np.full(rows, big, dtype=np.int64)
    has = np.diff(span_offsets) > 0
    if len(span_versions):
        labelled = np.where(span_versions >= 0, span_versions, big)
        oldest[has] = np.minimum.reduceat(labelled, span_offsets[:-1][has])
    missing = (oldest == big) & ~frozen
    if missing.any():
        reason = "no version label on the row and no dispatch_version given"
        raise TraceError(ids[int(np.argmax(missing))], "dispatch_version", reason)
    return np.where(oldest == big, -1, oldest)
