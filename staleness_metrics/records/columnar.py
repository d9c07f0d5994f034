"""Rollouts in columnar form: flat per-position arrays with sample and rollout offsets, around a
caller's arrays without a copy (the sink masks them in place), or read from ``[B, L]`` rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypedDict

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


def as_int64(values: Any, name: str, ids: Sequence[Any] | None = None) -> IntArray:
    """``values`` as int64, refusing (by rollout, else index) any no int64 holds: 2.5, True, NaN,
    2**70 (an int past records' versions' bound)."""
    array = np.asarray(values)
    array = np.asarray(array.tolist()) if array.dtype.kind == "O" else array  # (Python numbers)
    if array.dtype.kind != "i" and array.size:
        flat = array.reshape(-1)
        with np.errstate(invalid="ignore"):  # (NaN, inf and floats past int64 differ once cast)
            cast = flat.astype(np.int64) if array.dtype.kind in "uf" else None
        exact = [type(v) is int and abs(v) <= MAX_VERSION for v in flat.tolist()] if cast is None else cast == flat
        if not np.all(exact):
            at = int(np.argmin(exact))
            value = flat[at : at + 1].tolist()[0]
            beyond = f"must be in 0..{MAX_VERSION}, got {value}"  # (records' bound)
            reason = beyond if cast is None and type(value) is int else f"expected an integer, got {value!r}"
            if ids is None or array.shape != (len(ids),):
                raise FieldError(f"{name}[{at}]", reason)
            raise TraceError(ids[at] if isinstance(ids[at], str) else None, name, reason)
    return np.ascontiguousarray(array, dtype=np.int64)


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
        n_rollouts, n_samples = len(self.ids), len(self.position_offsets) - 1
        self.sample_offsets = as_int64(self.sample_offsets, "sample_offsets")
        self.position_offsets = as_int64(self.position_offsets, "position_offsets")
        self.dispatch_version = as_int64(self.dispatch_version, "dispatch_version", self.ids)
        if self.completion_version is None:
            self.completion_version = np.full(n_rollouts, -1)
        self.completion_version = as_int64(self.completion_version, "completion_version", self.ids)
        self.frozen = np.zeros(n_rollouts, dtype=bool) if self.frozen is None else self.frozen
        self.agentic = np.zeros(n_rollouts, dtype=bool) if self.agentic is None else self.agentic
        self.group_ids = [None] * n_rollouts if self.group_ids is None else self.group_ids
        self.envs = [None] * n_rollouts if self.envs is None else self.envs
        for name in ("mask", "frozen", "agentic", *PER_POSITION_FLOATS):  # (used in place)
            if not isinstance(value := getattr(self, name), np.ndarray | None):
                raise FieldTypeError(name, f"expected a numpy array, got a {type(value).__name__}")
            if name.endswith("logprobs") and value is not None and value.dtype.kind not in "biufO":
                raise FieldTypeError(name, f"expected numbers, got dtype {value.dtype}")
        for name in ("token_versions", "span_offsets", "span_versions", "span_starts"):
            if getattr(self, name) is not None:
                setattr(self, name, as_int64(getattr(self, name), name))
        if self.label_kind is None:
            kind = np.full(n_samples, LABELS_NONE, dtype=np.int8)
            if self.span_offsets is not None:
                kind[np.diff(self.span_offsets) > 0] = LABELS_SPANS
            if self.token_versions is not None:
                kind[:] = LABELS_TOKENS
            self.label_kind = kind
        for name in PER_POSITION_FLOATS:
            if getattr(self, name) is not None and name not in self.present:
                self.present[name] = np.ones(n_samples, dtype=bool)

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


def _row_vector(name: str, values: Any, rows: int, dtype: Any = None) -> npt.NDArray[Any]:
    array = as_numpy(values, name)
    if array.shape != (rows,):
        raise FieldError(name, f"expected {rows} values (one per row), got shape {array.shape}")
    return array if dtype is None else array.astype(dtype)


def _per_row(name: str, values: Any, rows: int, dtype: Any = None) -> npt.NDArray[Any] | None:
    return None if values is None else _row_vector(name, values, rows, dtype)


def _row_list(name: str, values: Sequence[Any] | None, rows: int) -> list[Any] | None:
    if values is None:
        return None
    out = list(values)
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
    length = _row_vector("lengths", lengths, rows, np.int64)
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
    frozen = _per_row("frozen", given.get("frozen"), rows, bool)
    frozen_rows = np.zeros(rows, dtype=bool) if frozen is None else frozen
    tokens = given.get("token_versions")
    labels = None if tokens is None else _matrix("token_versions", tokens, shape)
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
        agentic=_per_row("agentic", given.get("agentic"), rows, bool),
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
        return _row_vector("dispatch_version", given, rows)  # (RolloutBatch reads it as int64)
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
