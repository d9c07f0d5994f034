"""SPEC 11's sums of torch tensors (``mismatch_sums`` given a tensor): CPU tensors as zero-copy
numpy views for the compiled pass, tensors on an accelerator summed there in float64."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..errors import FieldError
from .buckets import LAG_UPPER_BOUNDS, N_BUCKETS

# Rows of the packed per-bucket tensor: counts (out of band: edges apart), then the float sums of
# d, |d|, k3, r, r² (the order of MismatchSums' float fields).
PACKED_ROWS = (
    *("tokens", "masked", "out_of_band", "uncovered", "near_edge"),
    *("d", "abs_d", "k3", "r", "r2"),
)
_COUNTS = 3  # the first rows are MismatchSums' counts, in its order
_SUMS = slice(5, 10)
_NEAR = 2.0**-39  # the compiled pass's margin: farther from an edge, d's side is exp(d)'s
_INT64_MAX = torch.iinfo(torch.int64).max
IntArray = np.ndarray[Any, np.dtype[np.int64]]
FloatArray = np.ndarray[Any, np.dtype[np.float64]]


def device_of(arrays: Mapping[str, Any]) -> torch.device:
    """The trainer log-probabilities' device if a tensor, else the first tensor's; a tensor on
    another accelerator is a ``FieldError``."""
    tensors = {name: value for name, value in arrays.items() if isinstance(value, torch.Tensor)}
    device: torch.device = tensors.get("trainer_logprobs", next(iter(tensors.values()))).device
    for name, tensor in tensors.items():
        if tensor.device != device and tensor.device.type != "cpu":
            raise FieldError(name, f"a tensor on {tensor.device}, the log-probabilities are on {device}")
    return device


def host_views(arrays: Mapping[str, Any], kinds: Mapping[str, str]) -> dict[str, Any]:
    """CPU tensors as numpy arrays sharing their memory (the float dtypes numpy lacks, bfloat16 and
    float8, as float32: exactly); ``FieldError`` names a tensor of the wrong kind or layout."""
    return {name: _host_view(name, value, kinds[name]) if isinstance(value, torch.Tensor) else value
            for name, value in arrays.items()}  # fmt: skip


def _host_view(name: str, tensor: torch.Tensor, kind: str) -> Any:
    tensor = _checked(name, tensor, kind)
    if tensor.is_floating_point() and tensor.dtype not in (torch.half, torch.float, torch.double):
        tensor = tensor.to(torch.float32)
    return tensor.resolve_conj().resolve_neg().numpy()


def device_sums(
    arrays: Mapping[str, Any], kinds: Mapping[str, str], lo: float, hi: float, device: torch.device, clamp: float
) -> tuple[IntArray, FloatArray, int]:
    """The sums of ``arrays`` on ``device``, as the compiled pass returns them, with one
    ``[10, buckets]`` transfer back; ``FieldError`` names an argument of a wrong length or dtype."""
    lag, sampler, trainer, flags = (_on_device(k, arrays.get(k), device, kind) for k, kind in kinds.items())
    assert lag is not None and sampler is not None and trainer is not None  # (mismatch_sums' check)
    for name, tensor in zip(list(kinds)[1:], (sampler, trainer, flags)):
        if tensor is not None and tensor.numel() != lag.numel():
            raise FieldError(name, f"length {tensor.numel()} differs from the lags' {lag.numel()}")
    with torch.no_grad():
        packed, d, bucket, near = packed_sums(lag, sampler, trainer, flags, (lo, hi), clamp)
    if device.type == "meta":
        raise FieldError("trainer_logprobs", "tensors on the meta device have no values to sum")
    host = packed.to("cpu").numpy()  # the one transfer: [10, buckets] float64
    counts = host[:_COUNTS].astype(np.int64)
    if host[PACKED_ROWS.index("near_edge")].any():
        # a ratio on a band edge: the C library exp's answer, as in the compiled pass (only these)
        index = near.nonzero().reshape(-1)
        for value, b in zip(d[index].tolist(), bucket[index].tolist(), strict=True):
            ratio = math.exp(value)
            counts[2, b] += ratio < lo or ratio > hi
    return counts, host[_SUMS].copy(), int(host[PACKED_ROWS.index("uncovered")].sum())


def packed_sums(
    lag: torch.Tensor,
    sampler: torch.Tensor,
    trainer: torch.Tensor,
    flags: torch.Tensor | None,
    band: tuple[float, float],
    clamp: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of :data:`PACKED_ROWS` as one float64 tensor on the inputs' device, with the clamped
    log-ratios, buckets and near-edge flags; nothing is read on the host (it runs on meta too)."""
    device = lag.device
    lag = lag.reshape(-1)
    if lag.dtype == torch.uint64:  # unsigned 64-bit lags beyond int64 are all "inf"
        lag = torch.where(lag.view(torch.int64) < 0, _INT64_MAX, lag.view(torch.int64))
    lag = lag.to(torch.int64)
    t, s = (values.reshape(-1).to(torch.float64) for values in (trainer, sampler))
    inside = lag >= 0  # negative: not a sampled position of a live rollout (outside the population)
    d, finite = t - s, torch.isfinite(t) & torch.isfinite(s)  # (d may overflow: clamped)
    covered = inside & finite
    d = torch.where(covered, d.clamp(-clamp, clamp), 0.0)
    r = torch.where(covered, torch.exp(d), 0.0)
    log_lo, log_hi = math.log(band[0]), math.log(band[1])
    near = covered & (((d - log_lo).abs() < _NEAR) | ((d - log_hi).abs() < _NEAR))
    out = covered & ((d < log_lo) | (d > log_hi)) & ~near
    masked = torch.zeros_like(covered) if flags is None else covered & (flags.reshape(-1) != 0)
    bounds = torch.tensor(LAG_UPPER_BOUNDS, dtype=torch.int64, device=device)
    bucket = torch.bucketize(lag, bounds, right=False)  # numpy's searchsorted(bounds, lag, "left")
    packed = torch.zeros((len(PACKED_ROWS), N_BUCKETS), dtype=torch.float64, device=device)
    k3 = torch.where(covered, r - 1.0 - d, 0.0)  # the k3 term, as the pass
    rows = (covered, masked, out, inside & ~finite, near, d, d.abs(), k3, r, r * r)
    for i, row in enumerate(rows):  # float64 counts are exact: a tensor holds < 2**53 elements
        packed[i].index_add_(0, bucket, row.to(torch.float64))
    return packed, d, bucket, near


_KINDS = {
    "integers": lambda dtype: not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool),
    "numbers": lambda dtype: not (dtype.is_complex or dtype == torch.bool),
    "booleans or integers": lambda dtype: not (dtype.is_floating_point or dtype.is_complex),
}


def _checked(name: str, tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """``tensor`` detached, if dense and of the kind ``name`` holds."""
    if tensor.layout != torch.strided or tensor.is_quantized:  # (neither numpy nor our ops read it)
        layout = "quantized" if tensor.is_quantized else tensor.layout
        raise FieldError(name, f"expected a dense tensor, got {layout}")
    if tensor.numel() and not _KINDS[kind](tensor.dtype):
        raise FieldError(name, f"expected {kind}, got dtype {tensor.dtype}")
    return tensor.detach()


def _on_device(name: str, value: Any, device: torch.device, kind: str) -> torch.Tensor | None:
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(np.asarray(value))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise FieldError(name, f"expected {kind}, got {type(value).__name__} ({exc})") from None
    tensor = _checked(name, value, kind)
    return tensor if tensor.device == device else tensor.to(device)
