"""What staleness costs (SPEC 11): trainer-vs-sampler mismatch sums by token lag, and their compiled
pass. The sums add across micro-batches, ranks and processes; ratios come from merged sums."""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from numbers import Real
from typing import Any

import numpy as np
import numpy.typing as npt

from ..compiled import CompiledLoop
from ..errors import FieldError
from ..parallel import PARALLEL_MIN_POSITIONS, SHARES, run_all
from . import keys
from .buckets import LAG_BUCKETS, LAG_UPPER_BOUNDS, N_BUCKETS

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

LOG_RATIO_CLAMP = 20.0
DEFAULT_BAND = (0.5, 2.0)
DICT_FORMAT = 1
_BOUNDS = np.asarray(LAG_UPPER_BOUNDS, dtype=np.int64)

COUNT_FIELDS = ("tokens", "masked", "out_of_band")
SUM_FIELDS = ("sum_log_ratio", "sum_abs_log_ratio", "sum_k3", "sum_ratio", "sum_ratio_sq")
# The least and most a covered token adds to each sum, d in ±20: d, |d|, r - 1 - d, r, r²
_D_MAX, _R_MAX = LOG_RATIO_CLAMP, math.exp(LOG_RATIO_CLAMP)
_TOKEN_RANGE = np.array([[-_D_MAX, 0, 0, 0, 0],  # (only Σd may be negative)
                         [_D_MAX, _D_MAX, _R_MAX - 1 - _D_MAX, _R_MAX, _R_MAX**2]])  # fmt: skip
# What each per-position argument holds (read by the torch paths too), and numpy's kinds of it
ARGUMENT_KINDS = {"lags": "integers", "sampler_logprobs": "numbers", "trainer_logprobs": "numbers",
                  "masked": "booleans or integers"}  # fmt: skip
_NUMPY_KINDS = {"integers": "iu", "numbers": "fiu", "booleans or integers": "biu"}


@dataclass(frozen=True, eq=False)
class MismatchSums:
    """SPEC 11's sums per lag bucket (arrays over ``LAG_BUCKETS``): ``tokens`` counts covered
    positions, ``masked`` those the policy masked, ``out_of_band`` those whose ratio is outside
    the band; ``uncovered`` counts sampled positions lacking a log-probability."""

    tokens: IntArray
    masked: IntArray
    out_of_band: IntArray
    sum_log_ratio: FloatArray
    sum_abs_log_ratio: FloatArray
    sum_k3: FloatArray
    sum_ratio: FloatArray
    sum_ratio_sq: FloatArray
    uncovered: int = 0

    @classmethod
    def zero(cls) -> MismatchSums:
        return _of_pass(np.zeros((3, N_BUCKETS), dtype=np.int64), np.zeros((5, N_BUCKETS)), 0)

    @property
    def covered(self) -> int:
        return int(self.tokens.sum())

    @property
    def sampled(self) -> int:
        """Positions of the population: covered plus uncovered."""
        return self.covered + self.uncovered

    def __add__(self, other: MismatchSums) -> MismatchSums:
        if not isinstance(other, MismatchSums):
            return NotImplemented
        fields = {f: getattr(self, f) + getattr(other, f) for f in (*COUNT_FIELDS, *SUM_FIELDS)}
        return MismatchSums(**fields, uncovered=self.uncovered + other.uncovered)

    def merged(self, other: MismatchSums) -> MismatchSums:
        """``self + other`` (a trainer's posts); ``FieldError`` past int64 or a pass's reach."""
        with np.errstate(over="ignore"):
            total = self + other
        wrapped = any((getattr(total, f) < 0).any() for f in COUNT_FIELDS)
        if wrapped or not 0 <= total.uncovered < 2**63:
            raise FieldError("sums", "the step's merged sums overflow (int64 counts)")
        return _possible(total)  # (inf too: the monitor keeps only what its checkpoint loads)

    def __sub__(self, other: MismatchSums) -> MismatchSums:
        """The change from ``other`` to these sums (what a revised total adds to a merged one)."""
        if not isinstance(other, MismatchSums):
            return NotImplemented
        fields = {f: getattr(self, f) - getattr(other, f) for f in (*COUNT_FIELDS, *SUM_FIELDS)}
        return MismatchSums(**fields, uncovered=self.uncovered - other.uncovered)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MismatchSums):
            return NotImplemented
        return self.uncovered == other.uncovered and all(
            np.array_equal(getattr(self, name), getattr(other, name)) for name in (*COUNT_FIELDS, *SUM_FIELDS)
        )

    __hash__ = None  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        """``{"format": 1, "uncovered": n, "lags": {"0": {...}, ..., "inf": {...}}}``."""
        lags = {
            name: {
                **{f: int(getattr(self, f)[i]) for f in COUNT_FIELDS},
                **{f: float(getattr(self, f)[i]) for f in SUM_FIELDS},
            }
            for i, name in enumerate(LAG_BUCKETS)
        }
        return {"format": DICT_FORMAT, "uncovered": int(self.uncovered), "lags": lags}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MismatchSums:
        """Inverse of :meth:`to_dict`; a ``FieldError`` names the field at fault (a sum its bucket's
        tokens cannot add up to: ``d`` is clamped to ±20, ``r`` to at most e^20)."""
        if not isinstance(data, Mapping):
            raise FieldError(None, f"mismatch sums: expected an object, got {type(data).__name__}")
        if data.get("format", DICT_FORMAT) != DICT_FORMAT:
            raise FieldError("format", f"unknown mismatch sums format {data.get('format')!r} (expected {DICT_FORMAT})")
        uncovered = _count("uncovered", data.get("uncovered"))
        lags = data.get("lags")
        if not isinstance(lags, Mapping):
            raise FieldError("lags", "required object with one entry per lag bucket")
        unknown = sorted(set(lags) - set(LAG_BUCKETS))
        if unknown:
            raise FieldError(f"lags.{unknown[0]}", f"unknown lag bucket (buckets are {', '.join(LAG_BUCKETS)})")
        columns: dict[str, list[Any]] = {f: [] for f in (*COUNT_FIELDS, *SUM_FIELDS)}
        for name in LAG_BUCKETS:
            bucket = lags.get(name)
            if not isinstance(bucket, Mapping):
                raise FieldError(f"lags.{name}", "missing lag bucket")
            for f in COUNT_FIELDS:
                columns[f].append(_count(f"lags.{name}.{f}", bucket.get(f)))
            for f in SUM_FIELDS:
                columns[f].append(_finite(f"lags.{name}.{f}", bucket.get(f)))
            for f in COUNT_FIELDS[1:]:
                if columns[f][-1] > columns["tokens"][-1]:
                    raise FieldError(f"lags.{name}.{f}", f"{columns[f][-1]} exceeds tokens {columns['tokens'][-1]}")
        counts: dict[str, Any] = {f: np.asarray(columns[f], dtype=np.int64) for f in COUNT_FIELDS}
        floats: dict[str, Any] = {f: np.asarray(columns[f], dtype=np.float64) for f in SUM_FIELDS}
        return _possible(cls(**counts, **floats, uncovered=uncovered))

    def metrics(self, floor: float | None = None) -> dict[str, float | int]:
        """The SPEC 11 keys (none when nothing is covered, none of a bucket without tokens); the
        excess keys over ``floor`` (SPEC 14), left out without one and for bucket ``0``."""
        covered = self.covered
        if covered == 0:
            return {}
        out: dict[str, float | int] = {}
        k3 = np.divide(self.sum_k3, self.tokens, out=np.zeros(N_BUCKETS), where=self.tokens > 0)
        for i in np.flatnonzero(self.tokens).tolist():
            n = int(self.tokens[i])
            bucket = LAG_BUCKETS[i]
            out[keys.MISMATCH_TOKENS_BY_LAG[bucket]] = n
            out[keys.MISMATCH_K3_BY_LAG[bucket]] = float(k3[i])
            out[keys.MISMATCH_ABS_LOG_RATIO_BY_LAG[bucket]] = float(self.sum_abs_log_ratio[i] / n)
            out[keys.MISMATCH_OUT_OF_BAND_BY_LAG[bucket]] = float(int(self.out_of_band[i]) / n)
            # ESS (Σr)² / (n Σr²): 1 when every ratio is equal, towards 1/n when one dominates
            ratio, ratio_sq = float(self.sum_ratio[i]), float(self.sum_ratio_sq[i])
            ess = 1.0 if ratio_sq <= 0 else min(1.0, ratio * ratio / (n * ratio_sq))
            out[keys.MISMATCH_ESS_BY_LAG[bucket]] = ess
            if floor is not None and i > 0:
                out[keys.MISMATCH_EXCESS_K3_BY_LAG[bucket]] = float(k3[i]) - floor
        out[keys.MISMATCH_K3] = float(self.sum_k3.sum() / covered)
        stale_tokens = int(self.tokens[1:].sum())
        if floor is not None and stale_tokens:
            out[keys.MISMATCH_EXCESS_K3] = float(self.sum_k3[1:].sum() / stale_tokens) - floor
        out[keys.MISMATCH_COVERAGE] = covered / self.sampled
        return out


def _possible(sums: MismatchSums) -> MismatchSums:
    """``sums`` if a pass could make them; else ``FieldError`` names a bucket's sum outside what its
    tokens add (with rounding's slack: an ulp per addition, a few for exp and r²)."""
    tokens = sums.tokens.astype(np.float64)[:, None]
    values = np.transpose([getattr(sums, f) for f in SUM_FIELDS])  # [bucket, sum]
    low, high = _TOKEN_RANGE[:, None] * tokens * (1 + (tokens + 8) * 2.0**-52)
    for i, f in np.argwhere(~((low <= values) & (values <= high)))[:1].tolist():  # (NaN too)
        span = f"{low[i, f]:.9g}..{high[i, f]:.9g}, what {sums.tokens[i]} tokens add (d in ±20)"
        value = values[i, f].item()
        raise FieldError(f"lags.{LAG_BUCKETS[i]}.{SUM_FIELDS[f]}", f"{value!r} is outside {span}")
    return sums


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(name, f"expected a non-negative integer, got {value!r}")
    if not 0 <= value < 2**63:
        raise FieldError(name, f"must be >= 0, got {value}" if value < 0 else f"must fit int64, got {value}")
    return value


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= sys.float_info.max:
        raise FieldError(name, f"expected a finite number, got {value!r}")  # (NaN, inf, a huge int)
    return float(value)


def _flat(name: str, values: npt.ArrayLike) -> npt.NDArray[Any]:
    array, kind = np.asarray(values).reshape(-1), ARGUMENT_KINDS[name]
    if array.dtype == object and kind == "numbers":  # None in a list: missing (SPEC 11), as NaN
        array = np.asarray([math.nan if value is None else value for value in array.tolist()])
    if array.size and array.dtype.kind not in _NUMPY_KINDS[kind]:
        raise FieldError(name, f"expected {kind}, got dtype {array.dtype}")
    return array


def mismatch_sums(
    lags: npt.ArrayLike,
    sampler_logprobs: npt.ArrayLike | Sequence[float | None],  # (None: no value, as NaN)
    trainer_logprobs: npt.ArrayLike | Sequence[float | None],
    masked: npt.ArrayLike | None = None,
    *,
    band: tuple[float, float] = DEFAULT_BAND,
) -> MismatchSums:
    """SPEC 11's sums over positions, in one pass: ``lags`` per position (``Shipment.lags``;
    negative: skipped), the log-probabilities aligned with it (arrays or torch tensors of any float
    dtype, ``[B, L]`` read flat; uncovered where either is not finite), ``masked`` the positions the
    policy masked. Tensors on an accelerator are summed there, in float64.

    Raises :class:`~staleness_metrics.errors.FieldError` naming the argument at fault (a length, a
    dtype, a ``None``, the ``band``)."""
    lo, hi = band if isinstance(band, tuple | list) and len(band) == 2 else (math.nan, math.nan)
    if not (isinstance(lo, Real) and isinstance(hi, Real) and 0 < lo <= hi and math.isfinite(hi)):
        raise FieldError("band", f"expected a pair of numbers 0 < lo <= hi, got {band!r}")
    given = (lags, sampler_logprobs, trainer_logprobs, masked)
    arrays: dict[str, Any] = dict(zip(ARGUMENT_KINDS, given))  # (or the tensors' host views)
    if missing := [name for name, value in arrays.items() if value is None and name != "masked"]:
        raise FieldError(missing[0], "required, got None")  # (not one missing position)
    # the one seam: tensors go to the torch module (only a caller that imported torch reaches it)
    torch = sys.modules.get("torch")
    if torch is not None and any(isinstance(value, torch.Tensor) for value in arrays.values()):
        from . import mismatch_torch

        device = mismatch_torch.device_of(arrays)
        if device.type != "cpu":
            return _of_pass(*mismatch_torch.device_sums(arrays, ARGUMENT_KINDS, lo, hi, device, LOG_RATIO_CLAMP))
        arrays = mismatch_torch.host_views(arrays, ARGUMENT_KINDS)  # the pass reads the tensors' memory
    lag, sampler, trainer = (_flat(name, arrays[name]) for name in list(ARGUMENT_KINDS)[:3])
    flags = None if arrays["masked"] is None else _flat("masked", arrays["masked"])
    for name, array in zip(list(ARGUMENT_KINDS)[1:], (sampler, trainer, flags)):
        if array is not None and len(array) != len(lag):
            raise FieldError(name, f"length {len(array)} differs from the lags' {len(lag)}")
    bool_flags = None if flags is None else np.ascontiguousarray(flags, dtype=bool)
    if any(values.dtype.kind == "f" and values.dtype.itemsize > 8 for values in (sampler, trainer)):
        # wider than float64 (long double): d taken in that precision, then read as float64 (NaN
        # where a value is not finite; one that overflows float64: its largest, clamped by the pass)
        d = np.where(np.isfinite(trainer) & np.isfinite(sampler), trainer - sampler, np.nan)
        trainer, sampler = np.clip(d, -sys.float_info.max, sys.float_info.max), np.zeros(len(lag))
    # float32 / float64 as they are, others as float64; unsigned lags beyond 2**62 are all "inf"
    lag = np.minimum(lag, np.uint64(1 << 62)) if lag.dtype.kind == "u" else lag
    lag = np.ascontiguousarray(lag, dtype=np.int64)
    logprobs = _float_for_kernel(sampler), _float_for_kernel(trainer)
    return _of_pass(*mismatch_runs(lag, *logprobs, bool_flags, lo, hi, _BOUNDS, LOG_RATIO_CLAMP))


def _of_pass(counts: IntArray, sums: FloatArray, uncovered: int) -> MismatchSums:
    """The sums from a pass's ``[3, buckets]`` counts and ``[5, buckets]`` float sums."""
    # each k3 term is >= 0; rounding of tiny ones must not make the sum negative
    floats = {**dict(zip(SUM_FIELDS, sums)), "sum_k3": np.maximum(sums[2], 0.0)}
    return MismatchSums(**dict(zip(COUNT_FIELDS, counts)), **floats, uncovered=int(uncovered))


def _float_for_kernel(values: npt.NDArray[Any]) -> npt.NDArray[Any]:
    as_they_are = values.dtype in (np.float32, np.float64)
    return np.ascontiguousarray(values, dtype=None if as_they_are else np.float64)


_NO_FLAGS = np.zeros(0, dtype=np.uint8)


# exp(x) for |x| <= 20 as fdlibm's e_exp.c computes it (within 1 ulp of the C library's): x = k ln2
# + r, |r| <= ln2 / 2 (ln2 in two parts, so k ln2 is exact), a rational approximation of exp(r),
# then 2^k. Written in the loop, it is vectorised; the C library's exp is a call per position.
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_EXP_P1 = 1.66666666666666019037e-01
_EXP_P2 = -2.77777777770155933842e-03
_EXP_P3 = 6.61375632143793436117e-05
_EXP_P4 = -1.65339022054652515390e-06
_EXP_P5 = 4.13813679705723846039e-08
_SHIFTER = 1.5 * 2.0**52  # adding an integral float below 2^51 leaves it in the low mantissa bits
# A log-ratio this close to the log of a band edge is compared again with the C library's exp;
# farther, its side of the edge is the side of exp(d) (log's and exp's rounding are far below it)
_NEAR = 2.0**-39


def _ratio(d: float) -> tuple[float, float]:  # pragma: no cover - compiled
    """``exp(d)`` for ``|d| <= 700`` and the k3 term ``r - 1 - d`` (the polynomial in Estrin's
    order: a shorter chain of dependencies)."""
    k = np.rint(d * _INV_LN2)
    high, low = d - k * _LN2_HI, k * _LN2_LO
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

# The band in log space (log_lo, log_hi, then each edge's margins: near_lo, near_lo_top, near_hi,
# near_hi_top): d outside [log_lo, log_hi] is out of band, but within _NEAR of an edge the C library
# exp says on which side exp(d) falls. Comparing d, not r, does not wait for the exp.
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
    """A run's sums, unusual positions (to clamp or not finite), positions out of band and near a
    band edge: one vector pass with no per-position branch."""
    log_lo, log_hi, near_lo, near_lo_top, near_hi, near_hi_top = band
    sum_d = sum_abs = sum_k3 = sum_r = sum_r2 = 0.0
    unusual = n_out = near = 0
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


def _covered(sampler: float, trainer: float) -> bool:  # pragma: no cover - compiled
    """SPEC 11: covered unless a log-probability is NaN or infinite (uncovered, never an error)."""
    return abs(sampler) < np.inf and abs(trainer) < np.inf


def _clamped_sums(
    s: npt.NDArray[Any],
    t: npt.NDArray[Any],
    flags: tuple[npt.NDArray[np.uint8], int, bool],
    clamp: float,
    band: Band,
) -> tuple[Sums, int, int, int, int]:  # pragma: no cover - compiled
    """A run's sums position by position (uncovered: a value not finite; covered: clamped), and
    its covered, masked (``flags``: flags, run start, any), out-of-band and near-edge positions."""
    # (flags read at p + i as in the loop this was cut from: LLVM then adds the sums in that order)
    f, p, has_flags = flags
    log_lo, log_hi, near_lo, near_lo_top, near_hi, near_hi_top = band
    sum_d = sum_abs = sum_k3 = sum_r = sum_r2 = 0.0
    tokens = n_masked = n_out = near = 0
    for i in range(len(s)):
        d = np.float64(t[i]) - np.float64(s[i])
        finite = _covered(s[i], t[i])  # (if their difference overflows: clamped)
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
        if _covered(s[i], t[i]):
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
        "_covered": (_covered, {}),
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
    n_buckets = len(bounds) + 1
    counts = np.zeros((3, n_buckets), dtype=np.int64)  # tokens, masked, out_of_band
    sums = np.zeros((5, n_buckets), dtype=np.float64)  # d, |d|, r - 1 - d, r, r^2
    uncovered = 0
    log_lo = math.log(band_lo) if band_lo > 0 else -np.inf
    log_hi = math.log(band_hi) if band_hi > 0 else -np.inf
    band = (log_lo, log_hi, log_lo - _NEAR, log_lo + _NEAR, log_hi - _NEAR, log_hi + _NEAR)
    last_lag = -1
    bucket = p = 0
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
        else:  # position by position: a value not finite is uncovered, the others clamped
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
    """The compiled pass: per bucket of ``searchsorted(bounds, lag, "left")`` the counts (tokens,
    masked, out of band) and float sums (d, |d|, r - 1 - d, r, r²), and the uncovered positions;
    ``d`` clamped to ``±clamp`` (at most 700). Large inputs are summed in parallel shares."""
    if not 0 <= clamp <= 700:
        raise ValueError(f"mismatch_runs: clamp {clamp} outside 0..700")
    flag_bytes = _NO_FLAGS if flags is None else flags.view(np.uint8)
    has_flags = flags is not None
    n = len(lag)
    if len(sampler) != n or len(trainer) != n or (has_flags and len(flag_bytes) != n):
        raise ValueError("mismatch_runs: the arrays differ in length")
    if n < PARALLEL_MIN_POSITIONS:
        one: tuple[IntArray, npt.NDArray[np.float64], int] = _mismatch_runs(
            lag, sampler, trainer, flag_bytes, has_flags, bounds, band_lo, band_hi, clamp
        )
        return one
    edges = np.linspace(0, n, num=SHARES + 1, dtype=np.int64).tolist()
    tasks = [
        partial(_mismatch_runs, lag[a:b], sampler[a:b], trainer[a:b], flag_bytes[a:b] if has_flags else flag_bytes,
                has_flags, bounds, band_lo, band_hi, clamp)
        for a, b in itertools.pairwise(edges)
    ]  # fmt: skip
    parts: list[tuple[IntArray, npt.NDArray[np.float64], int]] = run_all(tasks, n)
    counts = np.sum([p[0] for p in parts], axis=0)
    return counts, np.sum([p[1] for p in parts], axis=0), sum(p[2] for p in parts)
