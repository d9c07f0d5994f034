"""One step's mismatch sums reduced over a torch.distributed process group (SPEC 11, several ranks).

Each rank sums its own tokens with :func:`~staleness_metrics.mismatch_sums` (on its GPU when the tensors
are there); :func:`all_reduce` adds the ranks' sums in one collective and returns the group's total on
every rank, so rank 0 alone records it (``monitor.record_mismatch``) or posts it, once per step::

    from staleness_metrics.distributed import all_reduce

    sums = all_reduce(mismatch_sums(lags, sampler_logprobs, trainer_logprobs, masked=mask == 0))
    if torch.distributed.get_rank() == 0:
        monitor.record_mismatch(step, sums)

Every field of :class:`~staleness_metrics.MismatchSums` is a sum (counts per lag bucket, float sums per lag
bucket, the uncovered count): there is no extremum to reduce, and every ratio (k3, ESS, excess) is derived
from the total afterwards. So one ``SUM`` over one packed float64 tensor is the whole reduction. The
counts travel as float64, exact while the group's total stays below 2**53 (checked); the float sums add
to float64 rounding. torch is imported when this module is, never by ``import staleness_metrics``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .errors import ConfigError, FieldError
from .metrics.buckets import LAG_BUCKETS, N_BUCKETS
from .metrics.mismatch import COUNT_FIELDS, SUM_FIELDS, MismatchSums

__all__ = ["all_reduce"]

_FIELDS = (*COUNT_FIELDS, *SUM_FIELDS)
# The packed layout: a bucket fingerprint (each rank adds its own: the total is the
# group's size times it only if every rank has these buckets), the uncovered count, then
# one row of N_BUCKETS per field.
_FINGERPRINT = float(N_BUCKETS) + sum(int(b) for b in LAG_BUCKETS if b != "inf") / 1024
_EXACT = float(2**53)


def all_reduce(sums: MismatchSums, group: Any = None) -> MismatchSums:
    """The sum of every rank's ``sums`` over ``group`` (the default group when None), on every rank.

    Every rank of the group must call it once per step, with its own sums (``MismatchSums.zero()``
    for a rank without tokens). The collective is one ``all_reduce(SUM)`` of a float64 tensor of
    ``2 + 8 * len(LAG_BUCKETS)`` values, placed on the CPU when the group's backend reduces CPU
    tensors (gloo, MPI, UCC, or a ``"cpu:gloo,cuda:nccl"`` pair) and on the current accelerator
    otherwise (NCCL: ``torch.cuda.current_device()``, which must be the rank's own GPU, as for any
    NCCL collective).

    Raises :class:`~staleness_metrics.errors.FieldError` naming the argument (or its field) when
    ``sums`` is not a ``MismatchSums`` of numpy arrays, one value per lag bucket, or its counts
    could overflow the reduction, and when the ranks disagree on the lag buckets;
    :class:`~staleness_metrics.errors.ConfigError` when torch.distributed is not initialised.
    """
    rows = _checked(sums)
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "all_reduce needs an initialised torch.distributed (torch.distributed.init_process_group)",
            field="group",
            reason="torch.distributed is not initialised",
        )
    world = dist.get_world_size(group)
    packed = _pack(sums, rows, world)
    tensor = torch.from_numpy(packed).to(_device_for(dist.get_backend(group)))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return _unpack(tensor.cpu().numpy(), world)


def _device_for(backend: str) -> torch.device:
    """Where the group reduces: the CPU if its backend takes CPU tensors, else
    the current accelerator."""
    names = backend.lower()
    if names.startswith("cpu:") or ",cpu:" in names or names in ("gloo", "mpi", "ucc"):
        return torch.device("cpu")
    if names == "nccl" or "cuda:" in names:
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        raise ConfigError(f"backend {backend!r} without an accelerator", field="group", reason="no device")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _checked(sums: MismatchSums) -> list[np.ndarray[Any, np.dtype[np.float64]]]:
    """The fields as float64 rows, each checked: a bad one is named before any
    rank waits on the others."""
    if not isinstance(sums, MismatchSums):
        raise FieldError("sums", f"expected MismatchSums (from mismatch_sums), got {type(sums).__name__}")
    rows = []
    for name in _FIELDS:
        value = getattr(sums, name)
        if not isinstance(value, np.ndarray) or value.shape != (N_BUCKETS,):
            got = f"{type(value).__name__} of shape {tuple(getattr(value, 'shape', ()))}"
            raise FieldError(f"sums.{name}", f"expected a numpy array of {N_BUCKETS} lag buckets, got {got}")
        rows.append(value.astype(np.float64))
    if isinstance(sums.uncovered, bool) or not isinstance(sums.uncovered, (int, np.integer)):
        raise FieldError("sums.uncovered", f"expected an integer, got {type(sums.uncovered).__name__}")
    return rows


def _pack(sums: MismatchSums, rows: list[np.ndarray[Any, np.dtype[np.float64]]], world: int) -> Any:
    largest = max(int(sums.uncovered), *(int(getattr(sums, name).max()) for name in COUNT_FIELDS))
    if largest * world >= _EXACT:  # a partial total beyond 2**53 would round
        raise FieldError("sums", f"counts up to {largest} on {world} ranks exceed what float64 adds exactly")
    return np.concatenate([[_FINGERPRINT, float(sums.uncovered)], *rows])


def _unpack(total: np.ndarray[Any, np.dtype[np.float64]], world: int) -> MismatchSums:
    if total[0] != _FINGERPRINT * world:
        raise FieldError("sums", "the ranks' lag buckets differ (another staleness-metrics version on a rank?)")
    rows = total[2:].reshape(len(_FIELDS), N_BUCKETS)
    counts = {name: rows[i].astype(np.int64) for i, name in enumerate(COUNT_FIELDS)}
    floats = {name: rows[len(COUNT_FIELDS) + i].copy() for i, name in enumerate(SUM_FIELDS)}
    return MismatchSums(**counts, **floats, uncovered=int(total[1]))
