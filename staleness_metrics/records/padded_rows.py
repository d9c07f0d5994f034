"""Padded ``[B, L]`` batches, the shape every trainer holds, read into the columns of a
:class:`~staleness_metrics.records.columnar.RolloutBatch` (:mod:`.padded` is the public face).

One row is one rollout of one sample spanning the whole row: padding carries mask 0, so decisions
and metrics equal those of the record of its valid positions. The flat arrays are the caller's
``[B, L]`` arrays reshaped (views when C-contiguous), masked in place. Per-token versions become
version spans by one comparison of neighbouring labels: no ``[B, L]`` copy is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import numpy as np
import numpy.typing as npt

from ..errors import FieldError, TraceError

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["PaddedColumns", "PaddedLayout", "padded_columns"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

_FIELD = "samples[0].{}"  # every row is the one sample of its rollout


@dataclass(frozen=True)
class PaddedLayout:
    """How a batch built by :func:`from_padded` maps back to its ``[B, L]`` rows."""

    rows: int
    width: int


def _matrix(name: str, values: Any, shape: tuple[int, int] | None) -> npt.NDArray[Any]:
    array = np.asarray(values)
    if array.ndim != 2:
        raise FieldError(name, f"expected a [B, L] array, got shape {array.shape}")
    if shape is not None and array.shape != shape:
        raise FieldError(name, f"shape {array.shape} differs from the mask's {shape}")
    return array


def _row_vector(name: str, values: Any, rows: int) -> npt.NDArray[Any]:
    array = np.asarray(values)
    if array.shape != (rows,):
        raise FieldError(name, f"expected {rows} values (one per row), got shape {array.shape}")
    return array


def _row_list(name: str, values: Sequence[Any] | None, rows: int) -> list[Any] | None:
    if values is None:
        return None
    out = list(values)
    if len(out) != rows:
        raise FieldError(name, f"expected {rows} values (one per row), got {len(out)}")
    return out


@dataclass(frozen=True)
class _Region:
    """Which positions hold tokens: ``valid`` [B, L]; for ``lengths`` each row's padding too."""

    valid: BoolArray
    pad_lo: IntArray | None = None  # padding is columns pad_lo .. pad_hi - 1 of each row
    pad_hi: IntArray | None = None


def _valid_region(
    shape: tuple[int, int],
    lengths: Any,
    attention_mask: Any,
    padding_side: Literal["right", "left"],
) -> _Region | None:
    """Where the tokens are; None when every position holds one."""
    rows, width = shape
    if lengths is not None and attention_mask is not None:
        raise FieldError("lengths", "give either lengths or attention_mask, not both")
    if attention_mask is not None:
        valid: BoolArray = _matrix("attention_mask", attention_mask, shape) != 0
        return _Region(valid)
    if lengths is None:
        return None
    length = _row_vector("lengths", lengths, rows).astype(np.int64)
    if ((length < 0) | (length > width)).any():
        raise FieldError("lengths", f"every length must lie in 0..{width}")
    columns = np.arange(width, dtype=np.int64)
    full = np.full(rows, width, dtype=np.int64)
    if padding_side == "right":
        return _Region(columns[None, :] < length[:, None], length, full)
    if padding_side == "left":
        return _Region(
            columns[None, :] >= (width - length)[:, None],
            np.zeros(rows, dtype=np.int64),
            width - length,
        )
    raise FieldError("padding_side", f"expected 'right' or 'left', got {padding_side!r}")


_SIGN_FREE = {
    2: (np.uint16, 0x7FFF),
    4: (np.uint32, 0x7FFFFFFF),
    8: (np.uint64, 0x7FFFFFFFFFFFFFFF),
}


def _padding_rows_nonzero(values: npt.NDArray[Any], region: _Region) -> BoolArray:
    """Per row, whether ``values`` is nonzero on a padding position (with row lengths, one read as
    unsigned integers OR-reduced per padding run, -0.0 counting as zero)."""
    rows, width = values.shape
    kind, size = values.dtype.kind, values.dtype.itemsize
    if region.pad_lo is None or region.pad_hi is None or kind not in "biuf" or (kind == "f" and size not in _SIGN_FREE):
        return ((~region.valid) & (values != 0)).any(axis=1)  # type: ignore[no-any-return]
    flat = np.ascontiguousarray(values).reshape(-1)
    unsigned = flat.view(np.uint8 if kind == "b" else np.dtype(f"u{size}"))
    base = np.arange(rows, dtype=np.int64) * width
    lo, hi = base + region.pad_lo, base + region.pad_hi
    bounds = np.unique(np.concatenate((lo, hi)))
    bounds = bounds[bounds < len(flat)]
    out = np.zeros(rows, dtype=bool)
    if len(bounds) == 0:
        return out
    runs = np.bitwise_or.reduceat(unsigned, bounds)
    if kind == "f":
        runs &= _SIGN_FREE[size][1]
    nonempty = hi > lo
    out[nonempty] = runs[np.searchsorted(bounds, lo[nonempty])] != 0
    return out


def _label_spans(labels: npt.NDArray[Any], region: _Region | None) -> tuple[IntArray, IntArray, IntArray]:
    """Per-position labels as version spans (offsets, versions, starts): one span wherever the
    label or the validity changes, -1 for unlabelled (any negative) and padding."""
    if labels.dtype.kind not in "iu":
        raise FieldError("token_versions", f"expected integers, got {labels.dtype}")
    rows, width = labels.shape
    if width == 0:
        empty = np.zeros(0, dtype=np.int64)
        return np.zeros(rows + 1, dtype=np.int64), empty, empty
    keys = np.arange(rows, dtype=np.int64) * width
    if width > 1:
        change = labels[:, 1:] != labels[:, :-1]
        if region is not None:
            change |= region.valid[:, 1:] != region.valid[:, :-1]
        at = np.flatnonzero(change)
        keys = np.sort(np.concatenate((keys, (at // (width - 1)) * width + at % (width - 1) + 1)))
    row, column = keys // width, keys % width
    versions = np.maximum(labels[row, column].astype(np.int64), -1)
    if region is not None:
        versions = np.where(region.valid[row, column], versions, -1)
    offsets = np.concatenate(([0], np.cumsum(np.bincount(row, minlength=rows)))).astype(np.int64)
    return offsets, versions, column


class PaddedColumns(TypedDict, total=False):
    """The keyword arguments of :func:`padded_columns` (each optional)."""

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


_FLOAT_COLUMNS = ("rl_weights", "ce_weights", "ref_kl_weights", "logprobs", "trainer_logprobs")


def padded_columns(
    ids: Sequence[str], mask: Any, **columns: Unpack[PaddedColumns]
) -> dict[str, Any]:  # fmt: skip
    """The :class:`~staleness_metrics.records.columnar.RolloutBatch` fields of ``B`` rollouts from
    ``[B, L]`` arrays (numpy or any array-like): the arguments of its constructor.

    - ``mask``: the loss / response mask, 1 (or True) on positions sampled by the policy.
    - ``token_versions`` ``[B, L]``: the policy version that sampled each position, any negative
      value meaning unlabelled (AReaL's prompt ``-1``); or only ``dispatch_version`` ``[B]`` per
      row. ``dispatch_version`` defaults to the oldest label among the row's valid positions (a
      partial rollout keeps the versions of its first tokens); a live row with neither raises
      ``TraceError``.
    - ``lengths`` ``[B]`` with ``padding_side`` (``"right"``, the default, or ``"left"``), or
      ``attention_mask`` ``[B, L]``: which positions hold tokens. Labels on padding are ignored; a
      padding position with mask 1 (or a ce / ref-KL weight) raises ``TraceError``. Without either,
      every position holds a token.
    - ``rl_weights``, ``ce_weights``, ``ref_kl_weights``, ``logprobs``, ``trainer_logprobs`` (NaN
      where missing, SPEC 11) ``[B, L]``; ``completion_version``, ``group_ids``, ``envs``,
      ``frozen``, ``agentic`` per row.

    C-contiguous mask and weight arrays are masked in place by the sink;
    :func:`~staleness_metrics.engine.shipment.padded_shipment` reads them back either way.
    """
    unknown = sorted(set(columns) - PaddedColumns.__optional_keys__)
    if unknown:
        raise TypeError(f"padded_columns() got an unexpected keyword argument {unknown[0]!r}")
    mask_2d = _matrix("mask", mask, None)
    shape: tuple[int, int] = (int(mask_2d.shape[0]), int(mask_2d.shape[1]))
    rows, width = shape
    id_list = _row_list("ids", ids, rows)
    assert id_list is not None
    given: dict[str, Any] = dict(columns)
    side = given.get("padding_side", "right")
    region = _valid_region(shape, given.get("lengths"), given.get("attention_mask"), side)
    arrays = {n: _matrix(n, given[n], shape) for n in _FLOAT_COLUMNS if given.get(n) is not None}
    if region is not None:
        checked = ("mask", *(n for n in ("ce_weights", "ref_kl_weights") if n in arrays))
        for name in checked:
            bad = np.flatnonzero(_padding_rows_nonzero(arrays.get(name, mask_2d), region))
            if len(bad):
                where = _FIELD.format(name)
                raise TraceError(id_list[int(bad[0])], where, "nonzero on a padding position")
    frozen = _per_row("frozen", given.get("frozen"), rows, bool)
    frozen_rows = np.zeros(rows, dtype=bool) if frozen is None else frozen
    tokens = given.get("token_versions")
    labels = None if tokens is None else _matrix("token_versions", tokens, shape)
    spans = None if labels is None else _label_spans(labels, region)
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
        **{n: arrays[n].reshape(-1) if n in arrays else None for n in _FLOAT_COLUMNS},
        padded=PaddedLayout(rows, width),
    )


def _per_row(name: str, values: Any, rows: int, dtype: Any = None) -> npt.NDArray[Any] | None:
    """``values`` as one entry per row (as ``dtype`` when given), or None when not given."""
    if values is None:
        return None
    array = _row_vector(name, values, rows)
    return array if dtype is None else array.astype(dtype)


def _dispatch(
    given: Any, spans: tuple[IntArray, IntArray, IntArray] | None, frozen: BoolArray, ids: list[str]
) -> IntArray:
    """Per row the dispatch version given, else the oldest label of its valid positions (-1 for a
    frozen row with neither; a live one raises ``TraceError``)."""
    rows = len(frozen)
    if given is not None:
        return _row_vector("dispatch_version", given, rows).astype(np.int64)
    if spans is None:
        if not frozen.all():
            row = int(np.flatnonzero(~frozen)[0])
            reason = "required: give dispatch_version or token_versions"
            raise TraceError(ids[row], "dispatch_version", reason)
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
        row = int(np.flatnonzero(missing)[0])
        reason = "no version label on the row and no dispatch_version given"
        raise TraceError(ids[row], "dispatch_version", reason)
    return np.where(oldest == big, -1, oldest)
