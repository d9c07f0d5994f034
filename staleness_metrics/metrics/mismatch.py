"""What staleness costs (SPEC 11): trainer-vs-sampler mismatch split by token lag.

Per position ``d = trainer_logprob - sampler_logprob`` (clamped to ±20) and ``r = exp(d)``; the per
lag bucket sums add across micro-batches, ranks and processes, so every ratio is derived from merged
sums, never averaged. The sink (records with ``trainer_logprobs``) and the live path share them.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import FieldError
from . import keys
from .buckets import LAG_BUCKETS, LAG_UPPER_BOUNDS, N_BUCKETS
from .mismatch_kernel import mismatch_runs

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

LOG_RATIO_CLAMP = 20.0
DEFAULT_BAND = (0.5, 2.0)
DICT_FORMAT = 1
_BOUNDS = np.asarray(LAG_UPPER_BOUNDS, dtype=np.int64)

COUNT_FIELDS = ("tokens", "masked", "out_of_band")
SUM_FIELDS = ("sum_log_ratio", "sum_abs_log_ratio", "sum_k3", "sum_ratio", "sum_ratio_sq")


def _zeros_int() -> IntArray:
    return np.zeros(N_BUCKETS, dtype=np.int64)


def _zeros_float() -> FloatArray:
    return np.zeros(N_BUCKETS, dtype=np.float64)


@dataclass(frozen=True, eq=False)
class MismatchSums:
    """Per-lag-bucket sums of SPEC 11 (arrays of length ``len(LAG_BUCKETS)``) plus ``uncovered``.

    ``tokens`` counts covered positions, ``masked`` those of them the policy masked, ``out_of_band``
    those whose ratio lies outside the band; ``uncovered`` counts sampled positions lacking a value.
    """

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
        return cls._of({f: _zeros_int() for f in COUNT_FIELDS}, {f: _zeros_float() for f in SUM_FIELDS}, 0)

    @classmethod
    def _of(cls, counts: dict[str, Any], sums: dict[str, Any], uncovered: int) -> MismatchSums:
        """From the count arrays and the float sum arrays, by field name."""
        return cls(**counts, **sums, uncovered=uncovered)

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
        return MismatchSums._of(
            {f: getattr(self, f) + getattr(other, f) for f in COUNT_FIELDS},
            {f: getattr(self, f) + getattr(other, f) for f in SUM_FIELDS},
            self.uncovered + other.uncovered,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MismatchSums):
            return NotImplemented
        return self.uncovered == other.uncovered and all(
            np.array_equal(getattr(self, name), getattr(other, name)) for name in (*COUNT_FIELDS, *SUM_FIELDS)
        )

    __hash__ = None  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form:
        ``{"format": 1, "uncovered": n, "lags": {"0": {...}, ..., "inf": {...}}}``."""
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
        """Inverse of :meth:`to_dict`; raises :class:`~staleness_metrics.errors.FieldError` (a
        ``ValueError``) naming the field at fault."""
        if not isinstance(data, Mapping):
            raise FieldError(None, f"mismatch sums: expected an object, got {type(data).__name__}")
        if data.get("format", DICT_FORMAT) != DICT_FORMAT:
            raise FieldError(
                "format",
                f"unknown mismatch sums format {data.get('format')!r} (expected {DICT_FORMAT})",
            )
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
            for f in ("masked", "out_of_band"):
                if columns[f][-1] > columns["tokens"][-1]:
                    raise FieldError(
                        f"lags.{name}.{f}",
                        f"{columns[f][-1]} exceeds tokens {columns['tokens'][-1]}",
                    )
            nonnegative = ("sum_abs_log_ratio", "sum_k3", "sum_ratio", "sum_ratio_sq")
            for f in nonnegative:
                if columns[f][-1] < 0:
                    raise FieldError(f"lags.{name}.{f}", f"must be >= 0, got {columns[f][-1]!r}")
        return cls._of(
            {f: np.asarray(columns[f], dtype=np.int64) for f in COUNT_FIELDS},
            {f: np.asarray(columns[f], dtype=np.float64) for f in SUM_FIELDS},
            uncovered,
        )

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
            out[keys.MISMATCH_ESS_BY_LAG[bucket]] = _ess(float(self.sum_ratio[i]), float(self.sum_ratio_sq[i]), n)
            if floor is not None and i > 0:
                out[keys.MISMATCH_EXCESS_K3_BY_LAG[bucket]] = float(k3[i]) - floor
        out[keys.MISMATCH_K3] = float(self.sum_k3.sum() / covered)
        stale_tokens = int(self.tokens[1:].sum())
        if floor is not None and stale_tokens:
            out[keys.MISMATCH_EXCESS_K3] = float(self.sum_k3[1:].sum() / stale_tokens) - floor
        out[keys.MISMATCH_COVERAGE] = covered / self.sampled
        return out


def _ess(sum_ratio: float, sum_ratio_sq: float, tokens: int) -> float:
    """(Σr)² / (n Σr²): 1 when every ratio is equal, towards 1/n when one dominates."""
    if sum_ratio_sq <= 0:
        return 1.0
    return min(1.0, sum_ratio * sum_ratio / (tokens * sum_ratio_sq))


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(name, f"expected a non-negative integer, got {value!r}")
    if value < 0:
        raise FieldError(name, f"must be >= 0, got {value}")
    return value


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise FieldError(name, f"expected a finite number, got {value!r}")
    return float(value)


def _flat(name: str, values: npt.ArrayLike, kinds: str) -> npt.NDArray[Any]:
    """``values`` as a flat array whose dtype kind is one of ``kinds``."""
    array = np.asarray(values).reshape(-1)
    if array.size and array.dtype.kind not in kinds:
        raise FieldError(name, f"expected {'integers' if kinds == 'iu' else 'numbers'}, got dtype {array.dtype}")
    return array


def mismatch_sums(
    lags: npt.ArrayLike,
    sampler_logprobs: npt.ArrayLike,
    trainer_logprobs: npt.ArrayLike,
    masked: npt.ArrayLike | None = None,
    *,
    band: tuple[float, float] = DEFAULT_BAND,
) -> MismatchSums:
    """Sums of SPEC 11 over positions, in one pass over the arrays.

    ``lags`` is a shipment's per-position lag (``Shipment.lags``; negative: skipped); the
    log-probabilities are aligned with it (arrays or torch tensors, any float dtype, ``[B, L]``
    read flat), a position where either is not finite uncovered. ``masked`` flags the positions the
    policy masked: counted in the sums and apart in ``masked``. Tensors on a GPU are summed there in
    float64 (only the per-bucket sums come back); CPU tensors as numpy arrays.

    Raises :class:`~staleness_metrics.errors.FieldError` (a ``ValueError``) naming the argument at
    fault: lengths that differ, a dtype of the wrong kind, a bad ``band``.
    """
    lo, hi = band
    if not (0 < lo <= hi and math.isfinite(hi)):
        raise FieldError("band", f"expected 0 < lo <= hi, got {band!r}")
    arrays = {"lags": lags, "sampler_logprobs": sampler_logprobs, "trainer_logprobs": trainer_logprobs,
              "masked": masked}  # fmt: skip
    # the one seam: tensors go to the torch module (only a caller that imported torch reaches it)
    torch = sys.modules.get("torch")
    if torch is not None and any(isinstance(value, torch.Tensor) for value in arrays.values()):
        from . import mismatch_torch

        device = mismatch_torch.device_of(arrays)
        if device.type == "cpu":  # the compiled pass, on views of the tensors' memory
            return array_sums(mismatch_torch.host_views(arrays), lo, hi)
        return _of_pass(*mismatch_torch.device_sums(arrays, lo, hi, device, LOG_RATIO_CLAMP))
    return array_sums(arrays, lo, hi)


def array_sums(arrays: Mapping[str, Any], lo: float, hi: float) -> MismatchSums:
    """:func:`mismatch_sums` of host arrays, the band already checked: the compiled pass."""
    lag = _flat("lags", arrays["lags"], "iu")
    sampler = _flat("sampler_logprobs", arrays["sampler_logprobs"], "fiu")
    trainer = _flat("trainer_logprobs", arrays["trainer_logprobs"], "fiu")
    flags = None if arrays["masked"] is None else _flat("masked", arrays["masked"], "biu")
    for name, array in (
        ("sampler_logprobs", sampler),
        ("trainer_logprobs", trainer),
        ("masked", flags),
    ):
        if array is not None and len(array) != len(lag):
            raise FieldError(name, f"length {len(array)} differs from the lags' {len(lag)}")
    bool_flags = None if flags is None else np.ascontiguousarray(flags, dtype=bool)
    if any(values.dtype.kind == "f" and values.dtype.itemsize > 8 for values in (sampler, trainer)):
        # wider than float64 (long double): d taken in that precision, then read as float64
        trainer, sampler = trainer - sampler, np.zeros(len(lag))
    # float32 / float64 as they are, others as float64; unsigned lags beyond 2**62 are all "inf"
    if lag.dtype.kind == "u":
        lag = np.minimum(lag, np.uint64(1 << 62))
    counts, sums, uncovered = mismatch_runs(
        np.ascontiguousarray(lag, dtype=np.int64),
        _float_for_kernel(sampler),
        _float_for_kernel(trainer),
        bool_flags,
        lo,
        hi,
        _BOUNDS,
        LOG_RATIO_CLAMP,
    )
    return _of_pass(counts, sums, int(uncovered))


def _of_pass(counts: IntArray, sums: FloatArray, uncovered: int) -> MismatchSums:
    """The sums from a pass's ``[3, buckets]`` counts and ``[5, buckets]`` float sums."""
    # each term is >= 0; rounding of tiny ones must not make the sum negative
    k3 = np.maximum(sums[2], 0.0)
    return MismatchSums._of(
        dict(zip(COUNT_FIELDS, counts)),
        {"sum_log_ratio": sums[0], "sum_abs_log_ratio": sums[1], "sum_k3": k3, "sum_ratio": sums[3],
         "sum_ratio_sq": sums[4]},
        uncovered,
    )  # fmt: skip


def _float_for_kernel(values: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """float32 and float64 as they are (contiguous); any other dtype as float64."""
    if values.dtype in (np.float32, np.float64):
        return np.ascontiguousarray(values)
    return np.ascontiguousarray(values, dtype=np.float64)
