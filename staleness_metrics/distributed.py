"""One step's mismatch sums reduced over a torch.distributed process group (SPEC 11, several
ranks): every field is a sum, so one ``SUM`` over one packed float64 tensor is the whole reduction
(docs/multi-gpu.md). torch is imported here, never by ``import staleness_metrics``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .errors import ConfigError, FieldError
from .metrics.buckets import LAG_BUCKETS, N_BUCKETS
from .metrics.mismatch import COUNT_FIELDS, SUM_FIELDS, MismatchSums

_FIELDS = (*COUNT_FIELDS, *SUM_FIELDS)
# The packed layout: a bucket fingerprint (the total is the group's size times it only if every
# rank has these buckets), the uncovered count, then one row of N_BUCKETS per field.
_FINGERPRINT = float(N_BUCKETS) + sum(int(b) for b in LAG_BUCKETS if b != "inf") / 1024
_EXACT = float(2**53)


def all_reduce(sums: MismatchSums, group: Any = None) -> MismatchSums:
    """The sum of every rank's ``sums`` over ``group`` (None: the default group), on every rank.

    Every rank calls it once per step (``MismatchSums.zero()`` for a rank without tokens); the
    tensor is on the CPU for a backend reducing CPU tensors (gloo, MPI, UCC, ``"cpu:gloo,..."``),
    else on the current accelerator. Raises :class:`~staleness_metrics.FieldError` naming the
    field when ``sums`` is not a ``MismatchSums`` of one value per lag bucket, the group's counts
    reach 2**53 (on every rank), or the ranks' buckets differ;
    :class:`~staleness_metrics.ConfigError` when torch.distributed is not initialised."""
    if not isinstance(sums, MismatchSums):
        raise FieldError("sums", f"expected MismatchSums (from mismatch_sums), got {type(sums).__name__}")
    rows = []  # the fields as float64 rows, checked before any rank waits on the others
    for name in _FIELDS:
        value = getattr(sums, name)
        if not isinstance(value, np.ndarray) or value.shape != (N_BUCKETS,):
            got = f"{type(value).__name__} of shape {tuple(getattr(value, 'shape', ()))}"
            raise FieldError(f"sums.{name}", f"expected a numpy array of {N_BUCKETS} lag buckets, got {got}")
        rows.append(value.astype(np.float64))
    if isinstance(sums.uncovered, bool) or not isinstance(sums.uncovered, (int, np.integer)):
        raise FieldError("sums.uncovered", f"expected an integer, got {type(sums.uncovered).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "all_reduce needs an initialised torch.distributed (torch.distributed.init_process_group)",
            field="group",
            reason="torch.distributed is not initialised",
        )
    world = dist.get_world_size(group)
    packed = np.concatenate([[_FINGERPRINT, float(sums.uncovered)], *rows])
    tensor = torch.from_numpy(packed).to(_device_for(dist.get_backend(group)))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    total = tensor.cpu().numpy()
    if total[0] != _FINGERPRINT * world:
        raise FieldError("sums", "the ranks' lag buckets differ (another staleness-metrics version on a rank?)")
    summed = total[2:].reshape(len(_FIELDS), N_BUCKETS)
    # every rank sees the total: exact below 2**53 (each partial sum is smaller), else refused
    if (largest := max(total[1], summed[: len(COUNT_FIELDS)].max())) >= _EXACT:
        raise FieldError("sums", f"the group's counts reach {largest:.0f}: float64 sums inexactly")
    counts = {name: summed[i].astype(np.int64) for i, name in enumerate(COUNT_FIELDS)}
    floats = {name: summed[len(COUNT_FIELDS) + i].copy() for i, name in enumerate(SUM_FIELDS)}
    return MismatchSums(**counts, **floats, uncovered=int(total[1]))


def _device_for(backend: str) -> torch.device:
    names = backend.lower()
    if names.startswith("cpu:") or ",cpu:" in names or names in ("gloo", "mpi", "ucc"):
        return torch.device("cpu")
    if names == "nccl" or "cuda:" in names:
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        raise ConfigError(f"backend {backend!r} without an accelerator", field="group", reason="no device")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())
