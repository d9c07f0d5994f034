"""SPEC 11's mismatch sums of one call in one compiled pass over the positions (the loop behind
:func:`~staleness_metrics.metrics.mismatch.mismatch_sums`; its numpy reference is in the tests).
"""

from __future__ import annotations

import itertools
import math
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt

from ..compiled import CompiledLoop
from ..parallel import PARALLEL_MIN_POSITIONS, SHARES, run_all

IntArray = npt.NDArray[np.int64]

_NO_FLAGS = np.zeros(0, dtype=np.uint8)


# exp(x) for |x| <= 20 as fdlibm's e_exp.c computes it (within 1 ulp of the C library's): x = k ln2
# + r, |r| <= ln2 / 2 (ln2 in two parts, so k ln2 is exact), a rational approximation of exp(r),
# then 2^k. Written in the loop, it is vectorised; the C library's exp is a call per position.
_LN2_HI, _LN2_LO, _INV_LN2 = (
    6.93147180369123816490e-01,
    1.90821492927058770002e-10,
    1.44269504088896338700e00,
)
_EXP_P1, _EXP_P2, _EXP_P3 = (
    1.66666666666666019037e-01,
    -2.77777777770155933842e-03,
    6.61375632143793436117e-05,
)
_EXP_P4, _EXP_P5 = -1.65339022054652515390e-06, 4.13813679705723846039e-08
# added to an integer-valued float below 2^51, leaves it in the low mantissa bits
_SHIFTER = 1.5 * 2.0**52
# A log-ratio this close to the log of a band edge is compared again with the C library's exp;
# farther, its side of the edge is the side of exp(d) (log's and exp's rounding are far below it)
_NEAR = 2.0**-39


def _ratio(d: float) -> tuple[float, float]:  # pragma: no cover - compiled
    """``r = exp(d)`` for ``|d| <= 700`` (fdlibm's e_exp.c) and the k3 term ``r - 1 - d``; compiled
    without reassociation, the polynomial in Estrin's order (a shorter chain of dependencies)."""
    k = np.rint(d * _INV_LN2)
    high = d - k * _LN2_HI
    low = k * _LN2_LO
    x = high - low
    xx = x * x
    x4 = xx * xx
    c = x - xx * ((_EXP_P1 + xx * _EXP_P2) + x4 * ((_EXP_P3 + xx * _EXP_P4) + x4 * _EXP_P5))
    y = 1.0 - ((low - (x * c) / (2.0 - c)) - high)
    # 2^k from k's bits in the mantissa of k + 1.5 * 2^52 (no float-to-integer conversion: any d
    # gives a value, which a loop may compute for positions it then discards)
    scale = np.int64((np.float64(k + _SHIFTER).view(np.int64) + 1023) << 52).view(np.float64)
    r = y * scale  # exact
    return r, r - 1.0 - d


_ratio_compiled: Any = None  # _ratio, compiled when _mismatch_runs is

# The band in log space (log_lo, log_hi, then the margins of each edge: near_lo, near_lo_top,
# near_hi, near_hi_top): d outside [log_lo, log_hi] is out of band, except d within _NEAR of an
# edge, where which side exp(d) falls is the C library exp's answer. The comparisons read d, not r:
# they do not wait for the exp.
Band = tuple[float, float, float, float, float, float]
Sums = tuple[float, float, float, float, float]  # d, |d|, r - 1 - d, r, r^2


def _run_end(lag: IntArray, p: int) -> int:  # pragma: no cover - compiled
    """The end of the run of equal lag that starts at ``p`` (64 positions compared at once)."""
    n = len(lag)
    run_lag = lag[p]
    q = p + 1
    while q < n:
        top = min(q + 64, n)
        ahead = lag[q:top]
        differ = 0
        for i in range(top - q):
            differ += ahead[i] != run_lag
        if differ == 0:
            q = top
            continue
        i = 0
        while ahead[i] == run_lag:
            i += 1
        return q + i
    return q


def _usual_sums(
    s: npt.NDArray[Any], t: npt.NDArray[Any], clamp: float, band: Band
) -> tuple[Sums, int, int, int]:  # pragma: no cover - compiled
    """A run's sums, its unusual positions (a difference not finite or to be clamped), and its
    positions out of band and near a band edge: one vector pass with no per-position branch."""
    log_lo, log_hi, near_lo, near_lo_top, near_hi, near_hi_top = band
    sum_d = sum_abs = sum_k3 = sum_r = sum_r2 = 0.0
    unusual = 0
    n_out = 0
    near = 0
    for i in range(len(s)):
        d = np.float64(t[i]) - np.float64(s[i])
        unusual += not (abs(d) <= clamp)  # NaN, infinite or to be clamped: the run computed again
        r, k3 = _ratio_compiled(d)
        sum_d += d
        sum_abs += abs(d)
        sum_k3 += k3
        sum_r += r
        sum_r2 += r * r
        n_out += (d < log_lo) | (d > log_hi)
        near += ((d > near_lo) & (d < near_lo_top)) | ((d > near_hi) & (d < near_hi_top))
    return (sum_d, sum_abs, sum_k3, sum_r, sum_r2), unusual, n_out, near


def _clamped_sums(
    s: npt.NDArray[Any],
    t: npt.NDArray[Any],
    flags: tuple[npt.NDArray[np.uint8], int, bool],
    clamp: float,
    band: Band,
) -> tuple[Sums, int, int, int, int]:  # pragma: no cover - compiled
    """A run's sums position by position (non-finite differences uncovered, the others clamped),
    with its covered, masked (``flags``: the flags, the run's start, whether any), out-of-band and
    near-edge positions."""
    # (flags read at p + i as in the loop this was cut from: LLVM then adds the sums in that order)
    f, p, has_flags = flags
    log_lo, log_hi, near_lo, near_lo_top, near_hi, near_hi_top = band
    sum_d = sum_abs = sum_k3 = sum_r = sum_r2 = 0.0
    tokens = 0
    n_masked = 0
    n_out = 0
    near = 0
    for i in range(len(s)):
        d = np.float64(t[i]) - np.float64(s[i])
        finite = abs(d) < np.inf  # either value NaN or infinite: uncovered, never an error
        d = min(max(d, -clamp), clamp) if finite else 0.0
        r, k3 = _ratio_compiled(d)
        r = r if finite else 0.0
        sum_d += d
        sum_abs += abs(d)
        sum_k3 += k3 if finite else 0.0
        sum_r += r
        sum_r2 += r * r
        tokens += finite
        if has_flags:
            n_masked += finite & (f[p + i] != 0)
        n_out += finite & ((d < log_lo) | (d > log_hi))
        near += finite & (((d > near_lo) & (d < near_lo_top)) | ((d > near_hi) & (d < near_hi_top)))
    return (sum_d, sum_abs, sum_k3, sum_r, sum_r2), tokens, n_masked, n_out, near


def _out_of_band(
    s: npt.NDArray[Any],
    t: npt.NDArray[Any],
    clamp: float,
    band: Band,
    band_lo: float,
    band_hi: float,
) -> int:  # pragma: no cover - compiled
    """A run's positions out of band, those near a band edge compared with the C library's exp."""
    log_lo, log_hi, near_lo, near_lo_top, near_hi, near_hi_top = band
    n_out = 0
    for i in range(len(s)):
        d = np.float64(t[i]) - np.float64(s[i])
        if abs(d) < np.inf:
            d = min(max(d, -clamp), clamp)
            if ((d > near_lo) & (d < near_lo_top)) | ((d > near_hi) & (d < near_hi_top)):
                r = math.exp(d)
                n_out += (r < band_lo) | (r > band_hi)
            else:
                n_out += (d < log_lo) | (d > log_hi)
    return n_out


_OPTIONS: dict[str, Any] = {"error_model": "numpy", "fastmath": {"reassoc"}}


@CompiledLoop(
    **_OPTIONS,
    callees={
        "_ratio_compiled": (_ratio, {"error_model": "numpy"}),
        "_run_end": (_run_end, {}),
        "_usual_sums": (_usual_sums, _OPTIONS),
        "_clamped_sums": (_clamped_sums, _OPTIONS),
        "_out_of_band": (_out_of_band, _OPTIONS),
    },
)
def _mismatch_runs(
    lag: IntArray,
    sampler: npt.NDArray[Any],
    trainer: npt.NDArray[Any],
    flags: npt.NDArray[np.uint8],
    has_flags: bool,
    bounds: IntArray,
    band_lo: float,
    band_hi: float,
    clamp: float,
) -> tuple[IntArray, npt.NDArray[np.float64], int]:  # pragma: no cover - compiled
    # The sums are the callees', compiled with reassociation: they go in vector lanes (float64
    # rounding apart from a sequential pass); exp and the k3 term are _ratio's, compiled without it.
    n = len(lag)
    if len(sampler) != n or len(trainer) != n or (has_flags and len(flags) != n):
        raise ValueError("mismatch_runs: the arrays differ in length")
    n_buckets = len(bounds) + 1
    counts = np.zeros((3, n_buckets), dtype=np.int64)  # tokens, masked, out_of_band
    sums = np.zeros((5, n_buckets), dtype=np.float64)  # d, |d|, r - 1 - d, r, r^2
    uncovered = 0
    log_lo = math.log(band_lo) if band_lo > 0 else -np.inf
    log_hi = math.log(band_hi) if band_hi > 0 else -np.inf
    band = (log_lo, log_hi, log_lo - _NEAR, log_lo + _NEAR, log_hi - _NEAR, log_hi + _NEAR)
    last_lag = -1
    bucket = 0
    p = 0
    while p < n:  # one run of equal lag at a time: its bucket is found once
        q = _run_end(lag, p)
        run_lag = lag[p]
        if run_lag < 0:  # not a sampled position of a live rollout: outside the population
            p = q
            continue
        if run_lag != last_lag:  # numpy's searchsorted(bounds, lag, "left")
            bucket = 0
            while bucket < n_buckets - 1 and bounds[bucket] < run_lag:
                bucket += 1
            last_lag = run_lag
        s = sampler[p:q]  # slices: in bounds, no negative-index fix-up per position
        t = trainer[p:q]
        run, unusual, n_out, near = _usual_sums(s, t, clamp, band)
        tokens = q - p
        n_masked = 0
        if unusual == 0:
            if has_flags:
                f = flags[p:q]
                for i in range(q - p):
                    n_masked += f[i] != 0
        else:  # position by position: non-finite differences are uncovered, the others clamped
            here = (flags, p, has_flags)
            run, tokens, n_masked, n_out, near = _clamped_sums(s, t, here, clamp, band)
        if near:  # a ratio on a band edge: which side it falls is the C library exp's answer
            n_out = _out_of_band(s, t, clamp, band, band_lo, band_hi)
        counts[0, bucket] += tokens
        counts[1, bucket] += n_masked
        counts[2, bucket] += n_out
        for j in range(5):
            sums[j, bucket] += run[j]
        uncovered += (q - p) - tokens
        p = q
    return counts, sums, uncovered


def mismatch_runs(
    lag: IntArray,
    sampler: npt.NDArray[Any],
    trainer: npt.NDArray[Any],
    flags: npt.NDArray[np.bool_] | npt.NDArray[np.uint8] | None,
    band_lo: float,
    band_hi: float,
    bounds: IntArray,
    clamp: float,
) -> tuple[IntArray, npt.NDArray[np.float64], int]:
    """SPEC 11's per-bucket sums of one call: ``counts`` (tokens, masked, out of band), ``sums``
    (d, \|d\|, r - 1 - d, r, r\ :sup:`2`) per bucket (``searchsorted(bounds, lag, "left")``) and
    the uncovered positions. Negative lags are skipped, non-finite differences uncovered, ``d``
    clamped to ``±clamp`` (at most 700); the counts are exact, the float sums those of a sequential
    pass to float64 rounding. Large inputs are summed in parallel shares. ``ValueError`` when the
    arrays differ in length or ``clamp`` is out of range.
    """
    if not 0 <= clamp <= 700:
        raise ValueError(f"mismatch_runs: clamp {clamp} outside 0..700")
    flag_bytes = _NO_FLAGS if flags is None else flags.view(np.uint8)
    has_flags = flags is not None
    n = len(lag)
    if n < PARALLEL_MIN_POSITIONS:
        one: tuple[IntArray, npt.NDArray[np.float64], int] = _mismatch_runs(
            lag, sampler, trainer, flag_bytes, has_flags, bounds, band_lo, band_hi, clamp
        )
        return one
    if len(sampler) != n or len(trainer) != n or (has_flags and len(flag_bytes) != n):
        raise ValueError("mismatch_runs: the arrays differ in length")
    edges = np.linspace(0, n, num=SHARES + 1, dtype=np.int64).tolist()
    tasks = [
        partial(_mismatch_runs, lag[a:b], sampler[a:b], trainer[a:b], flag_bytes[a:b] if has_flags else flag_bytes,
                has_flags, bounds, band_lo, band_hi, clamp)
        for a, b in itertools.pairwise(edges)
    ]  # fmt: skip
    parts: list[tuple[IntArray, npt.NDArray[np.float64], int]] = run_all(tasks, n)
    counts = np.sum([p[0] for p in parts], axis=0)
    sums = np.sum([p[1] for p in parts], axis=0)
    return counts, sums, sum(p[2] for p in parts)
