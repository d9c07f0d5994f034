"""One step's mismatch sums reduced over a torch.distributed process group (SPEC 11, several
ranks): every field is a sum, so one ``SUM`` of one packed float64 tensor, once the ranks agree on
its header, is the whole reduction (docs/multi-gpu.md). torch is never imported by the package."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .errors import ConfigError, FieldError
from .metrics.buckets import LAG_BUCKETS, N_BUCKETS
from .metrics.mismatch import COUNT_FIELDS, SUM_FIELDS, MismatchSums

_FIELDS = (*COUNT_FIELDS, *SUM_FIELDS)
# The header: a bucket fingerprint, the bucket count, the env's key. The packed sums' size depends
# on N_BUCKETS: the ranks compare the header (its MIN and MAX) before any rank sends them.
_FINGERPRINT = float(N_BUCKETS) + sum(int(b) for b in LAG_BUCKETS if b != "inf") / 1024
_EXACT = float(2**53)


def all_reduce(sums: MismatchSums, group: Any = None, *, env: str | None = None) -> MismatchSums:
    """The sum of every rank's ``sums`` over ``group`` (None: the default group), on every rank.

    Every rank calls it once per step (``MismatchSums.zero()`` for a rank without tokens), or once
    per ``env`` of the group's, in one order. The tensors are on the CPU for a backend reducing CPU
    tensors (gloo, MPI, UCC, ``"cpu:gloo,..."``), else on the current accelerator. Raises
    :class:`~staleness_metrics.FieldError` naming the field when ``sums`` is not a ``MismatchSums``
    of one value per lag bucket, and on every rank when the group's counts reach 2**53, or the
    ranks' buckets or ``env`` differ;
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
    if env is not None and not isinstance(env, str):
        raise FieldError("env", f"expected an env name, got {env!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("all_reduce needs an initialised torch.distributed (init_process_group)",
                          field="group", reason="torch.distributed is not initialised")  # fmt: skip
    device = _device_for(dist.get_backend_config(group))
    # the env's key: 48 bits of its hash (exact in float64), -1 for none (surrogatepass: any str)
    digest = hashlib.blake2b(str(env).encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()
    key = -1 if env is None else int(digest, 16)
    header = torch.tensor([_FINGERPRINT, N_BUCKETS, key], dtype=torch.float64)
    agreed = torch.cat([header, -header]).to(device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)  # the least, -(the greatest)
    spread = agreed.cpu().reshape(2, 3).sum(dim=0).tolist()  # 0 where every rank agrees
    if spread[0] or spread[1]:
        raise FieldError("sums", "the ranks' lag buckets differ (another staleness-metrics version on a rank?)")
    if spread[2]:
        raise FieldError("env", f"the ranks' envs differ ({env!r} here): reduce them in one order")
    tensor = torch.from_numpy(np.concatenate([[float(sums.uncovered)], *rows])).to(device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    total = tensor.cpu().numpy()
    summed, n_counts = total[1:].reshape(len(_FIELDS), N_BUCKETS), len(COUNT_FIELDS)
    # every rank sees the total: exact below 2**53 (each partial sum is smaller), else refused
    if (largest := max(total[0], summed[:n_counts].max())) >= _EXACT:
        raise FieldError("sums", f"the group's counts reach {largest:.0f}: float64 sums inexactly")
    fields = dict(zip(_FIELDS, [*summed[:n_counts].astype(np.int64), *summed[n_counts:].copy()]))
    return MismatchSums(**fields, uncovered=int(total[0]))


def _device_for(config: str) -> torch.device:
    """Where ``config`` (``get_backend_config``, not ``get_backend``: ``"undefined"`` for a group
    made without a backend) reduces."""
    names = config.lower()
    if names.startswith("cpu:") or ",cpu:" in names or names in ("gloo", "mpi", "ucc"):
        return torch.device("cpu")
    if names == "nccl" or "cuda:" in names:
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        raise ConfigError(f"backend {config!r} without an accelerator", field="group", reason="no device")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())
