"""The quick check of a batch's values in one compiled pass at every size, copying the positions
where a sink gathers small adds: "plain" or "not sure" (:mod:`.validation` names what is wrong)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..compiled import CompiledLoop

IntArray = npt.NDArray[np.int64]


def _finite(values: npt.NDArray[Any]) -> bool:  # pragma: no cover - compiled
    bad = False
    for x in values:
        bad |= not math.isfinite(x)
    return not bad


def _copy_to(copy: npt.NDArray[Any], values: npt.NDArray[Any], start: int, n: int) -> None:  # pragma: no cover
    if len(copy) and len(values) == n:
        copy[start : start + n] = values


def _plain_rows(
    n_rollouts: int,
    offsets: tuple[IntArray, IntArray, IntArray, IntArray],
    label_kind: npt.NDArray[np.int8],
    labels: int,
) -> bool:  # pragma: no cover - compiled
    sample_offsets, position_offsets, dispatch, completion = offsets
    n_samples = len(position_offsets) - 1
    if n_samples < 0 or len(sample_offsets) != n_rollouts + 1 or len(dispatch) != n_rollouts:
        return False  # (the lengths every read below relies on)
    if len(completion) != n_rollouts or len(label_kind) != n_samples:
        return False
    if sample_offsets[0] != 0 or sample_offsets[n_rollouts] != n_samples or position_offsets[0] != 0:
        return False
    for i in range(n_rollouts):  # offsets never decreasing; versions as check_batch wants them
        d, c = dispatch[i], completion[i]
        if sample_offsets[i + 1] < sample_offsets[i] or d < 0 or c < -1 or 0 <= c < d:
            return False  # (frozen ones too: -1 falls to the exact path)
    for j in range(n_samples):
        kind = label_kind[j]
        if position_offsets[j + 1] < position_offsets[j] or kind < 0 or kind > 2 or not (labels >> kind) & 1:
            return False
    return True


@CompiledLoop(callees={"_finite": (_finite, {}), "_copy_to": (_copy_to, {}), "_plain_rows": (_plain_rows, {})})
def _plain_values(
    n_rollouts: int,
    offsets: tuple[IntArray, IntArray, IntArray, IntArray],
    label_kind: npt.NDArray[np.int8],
    labels: int,
    values: tuple[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]],
    tokens: IntArray,
    copies: tuple[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]],
    token_copy: IntArray,
    start: int,
) -> bool:  # pragma: no cover - compiled
    # (plain tuples, not named tuples: numba types them as fast as flat arguments)
    mask, rl, ce, ref_kl, logprobs = values
    n = len(mask)
    if not _plain_rows(n_rollouts, offsets, label_kind, labels) or offsets[1][len(offsets[1]) - 1] != n:
        return False
    bad = False
    for x in mask:
        bad |= (x != 0) & (x != 1)  # NaN too
    for t in tokens:
        bad |= t < -1
    if bad or not (_finite(rl) and _finite(ce) and _finite(ref_kl) and _finite(logprobs)):
        return False
    mask_copy, rl_copy, ce_copy, ref_kl_copy = copies
    _copy_to(mask_copy, mask, start, n)
    _copy_to(rl_copy, rl, start, n)
    _copy_to(ce_copy, ce, start, n)
    _copy_to(ref_kl_copy, ref_kl, start, n)
    _copy_to(token_copy, tokens, start, n)
    return True


_NO_TOKENS = np.zeros(0, dtype=np.int64)
_PLAIN_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))  # (numba reads no float16)
_INT8 = np.dtype(np.int8)
# (read-only: never written)
_PLAIN_PADDING = {dtype: np.zeros(0, dtype=dtype) for dtype in _PLAIN_DTYPES}


class BatchRows(NamedTuple):
    """A batch's rollout and sample rows (``labels``: bit ``k`` set if label kind ``k`` may be)."""

    n_rollouts: int
    sample_offsets: IntArray
    position_offsets: IntArray
    dispatch: IntArray
    completion: IntArray
    label_kind: npt.NDArray[np.int8]
    labels: int


class PositionCopies(NamedTuple):
    """Where :func:`plain_values` copies the mask, the three weights and the token versions (an
    empty array: not copied)."""

    mask_and_weights: tuple[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]]
    token_versions: IntArray


_NO_COPIES = {
    dtype: PositionCopies((empty, empty, empty, empty), _NO_TOKENS) for dtype, empty in _PLAIN_PADDING.items()
}  # (nothing copied)

Weights = tuple[npt.NDArray[Any] | None, npt.NDArray[Any] | None, npt.NDArray[Any] | None]


def plain_values(
    rows: BatchRows,
    mask: npt.NDArray[Any],
    weights: Weights,
    logprobs: npt.NDArray[Any] | None,
    tokens: IntArray | None,
    into: PositionCopies | None = None,
    start: int = 0,
) -> bool:
    """Whether a batch's values are plain (offsets, versions and label kinds as the exact checks
    want them, a 0/1 mask, finite floats, token versions >= -1), in one compiled pass, copying
    the positions to ``into`` (from ``start`` on) when they are. False ("not sure") unless the
    arrays are 1-d contiguous float32/float64 of one type and the label kinds int8."""
    dtype = mask.dtype
    empty = _PLAIN_PADDING.get(dtype)
    n_rollouts, sample_offsets, position_offsets, dispatch, completion, label_kind, labels = rows
    if empty is None or mask.ndim != 1 or not mask.flags.c_contiguous or label_kind.dtype != _INT8:
        return False
    if not sample_offsets.ndim == position_offsets.ndim == dispatch.ndim == completion.ndim == label_kind.ndim == 1:
        return False  # (other shapes: the exact checks name them)
    rl, ce, ref_kl, logprobs = [empty if v is None else v for v in (*weights, logprobs)]
    for values in (rl, ce, ref_kl, logprobs):
        if values is not empty and (values.dtype != dtype or values.ndim != 1 or not values.flags.c_contiguous):
            return False
    copies, token_copy = _NO_COPIES[dtype] if into is None else into
    loop = _plain_values.loaded()  # (the compiled loop itself once it is loaded)
    result: bool = loop(
        n_rollouts, (sample_offsets, position_offsets, dispatch, completion), label_kind, labels,
        (mask, rl, ce, ref_kl, logprobs), _NO_TOKENS if tokens is None else tokens, copies, token_copy, start,
    )  # fmt: skip
    return result
