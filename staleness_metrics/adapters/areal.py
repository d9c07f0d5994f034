"""AReaL rollout batches (padded tensors with per-token ``versions``) as a :class:`RolloutBatch`.

Built from AReaL's own source, with no import of it:

- ``inclusionAI/AReaL`` @ ``072480e26a1dc2ac1692164e504315d7e508478b``, ``areal/workflow/rlvr.py``
  (``RLVRWorkflow.arun_episode``): each sequence is ``input_ids`` = prompt + output,
  ``loss_mask`` = ``[0] * prompt + [1] * output``, ``logprobs`` = ``[0.0] * prompt + output_logprobs``,
  ``versions`` = ``[-1] * prompt + output_versions`` (the engine version that sampled each output token),
  ``attention_mask`` all ones, ``rewards`` one per sequence; one dict per sample, each ``[1, n]``.
- ``inclusionAI/AReaL`` @ ``7da889ab7532e1a42dff35ee9362385ddde1c38f``, ``areal/utils/data.py``
  (``concat_padded_tensors``): the samples are right-padded to the longest ``attention_mask``, with 0 in
  ``attention_mask`` and ``pad_value`` (0) in every other key, ``versions`` included.

So a padded AReaL batch is ``[B, L]`` rows; the attention mask says which positions hold tokens (a
padded ``versions`` 0 is not a label), prompt positions are unlabelled (``-1``) and never sampled
(``loss_mask`` 0). Each row is one rollout. Its dispatch version is the oldest version among its
labels (a partial rollout keeps its first tokens' versions), unless given.

What ``rollout_batch`` / ``prepare_batch`` return (``inclusionAI/AReaL`` release 1.0.4,
``areal/infra/workflow_executor.py`` ``rollout_batch`` / ``prepare_batch``) is a ``list[dict]``, one dict
per prompt group shaped ``[G, L_g]`` (``GroupedRolloutWorkflow`` in ``areal/infra/remote_inf_engine.py``
concatenates the group's ``[1, n]`` dicts with ``concat_padded_tensors``); ``concat_batch``
(``areal/utils/data.py``) makes one padded dict of them.

:func:`ship` is the one call (SPEC 15): in ``PPOTrainer.train`` (``areal/trainer/rl_trainer.py``), right
after ``rollout_batch = self.actor.prepare_batch(...)`` and before the critic, reference, ``compute_logp``
and ``compute_advantages``, with ``version=global_step``: AReaL's version during global step ``g`` is ``g``
(``new_version = global_step + 1`` is set after the update), not its epoch step ``step``.
The lower-level :func:`from_areal` and :func:`areal_loss_mask` stay for one padded dict.
"""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

from ..columnar import RolloutBatch
from ..errors import ConfigError, TraceError
from ..padded import from_padded, padded_shipment

if TYPE_CHECKING:
    from ..monitor import StalenessMonitor
    from ..sink import Shipment

__all__ = ["areal_loss_mask", "from_areal", "ship"]

AReaLBatch = TypeVar("AReaLBatch", list[dict[str, Any]], dict[str, Any])

COUNTER = "pass AReaL's global_step as version (its version during global step g is g), not the epoch step `step`"


def from_areal(
    batch: Mapping[str, Any],
    ids: Sequence[str],
    *,
    group_ids: Sequence[str | None] | None = None,
    envs: Sequence[str | None] | None = None,
    dispatch_version: Any = None,
) -> RolloutBatch:
    """One rollout per row of an AReaL batch (``loss_mask``, ``versions``, ``attention_mask``, ``logprobs``).

    Tensors may be numpy arrays or CPU torch tensors (read through ``numpy.asarray``, so a contiguous
    ``loss_mask`` is masked in place). ``ids`` name the rows (AReaL's batches carry no id).
    """
    for key in ("loss_mask", "versions"):
        if key not in batch:
            raise KeyError(f"AReaL batch: missing {key!r} (present: {sorted(batch)})")
    return from_padded(
        ids,
        batch["loss_mask"],
        token_versions=batch["versions"],
        attention_mask=batch.get("attention_mask"),
        logprobs=batch.get("logprobs"),
        dispatch_version=dispatch_version,
        group_ids=group_ids,
        envs=envs,
    )


def areal_loss_mask(shipment: Any, batch: RolloutBatch) -> npt.NDArray[np.generic]:
    """The ``[B, L]`` ``loss_mask`` after ``shipment``: masked positions and rows not shipped are 0."""
    return padded_shipment(shipment, batch).mask


# --------------------------------------------------------------------------- the one call (SPEC 15)


@dataclass(eq=False)
class _Group:
    """One of AReaL's ``[G, L]`` dicts as the sink holds it: the dict as given (its own tensors) and its rows."""

    data: dict[str, Any]
    rollouts: RolloutBatch
    mask: npt.NDArray[Any]  # data["loss_mask"] as numpy: its own memory, or a host copy of a device tensor
    host_copy: bool


def _torch() -> Any:
    """torch, imported only once the batch holds its tensors (never at import time)."""
    return importlib.import_module("torch")


def _on_device(value: Any) -> bool:
    return getattr(value, "detach", None) is not None and str(value.device) != "cpu"


def _as_numpy(name: str, value: Any, rid: str) -> npt.NDArray[Any]:
    """A tensor or array as numpy: a CPU tensor's own memory, a device tensor's host copy."""
    if value is None:
        raise TraceError(rid, name, "is None")
    if getattr(value, "detach", None) is not None:  # a torch tensor, read by duck typing
        tensor = value.detach()
        return np.asarray(tensor.cpu() if _on_device(tensor) else tensor)
    return np.asarray(value)


def _renamed(error: TraceError) -> TraceError:
    """A sink error in AReaL's words: its field names, and for a version above T the counter to pass."""
    field = error.field
    if "versions" in field or field == "dispatch_version":
        field = "versions"
    elif field.endswith(".mask"):
        field = "loss_mask"
    reason = error.reason
    if "above the trained version" in reason:
        reason = f"{reason}; {COUNTER}"
    return TraceError(error.rollout_id, field, reason)


def _read_group(data: Mapping[str, Any], group_sizes: Sequence[int] | None) -> _Group:
    if not isinstance(data, dict):
        raise TypeError(f"AReaL batch: expected a dict of tensors per group, got {type(data).__name__}")
    prefix = f"areal-{uuid.uuid4().hex[:12]}"
    if "loss_mask" not in data:
        raise TraceError(f"{prefix}/0", "loss_mask", f"missing from the AReaL batch (keys: {sorted(data)})")
    mask = _as_numpy("loss_mask", data["loss_mask"], f"{prefix}/0")
    if mask.ndim != 2:
        raise TraceError(f"{prefix}/0", "loss_mask", f"expected [G, L], got shape {mask.shape}")
    rows = int(mask.shape[0])
    ids = [f"{prefix}/{k}" for k in range(rows)]
    if "versions" not in data:
        raise TraceError(ids[0] if ids else prefix, "versions", "missing: AReaL's per-token versions of the rollout")
    versions = _as_numpy("versions", data["versions"], ids[0] if ids else prefix)
    attention = data.get("attention_mask")
    logprobs = data.get("logprobs")
    if group_sizes is None:
        group_ids: list[str | None] = [prefix] * rows  # one dict = one prompt group (GroupedRolloutWorkflow)
    else:
        sizes = [int(n) for n in group_sizes]
        if sum(sizes) != rows or any(n < 1 for n in sizes):
            raise ValueError(f"group_sizes: {sizes} do not add up to the batch's {rows} rows")
        group_ids = [f"{prefix}/g{g}" for g, n in enumerate(sizes) for _ in range(n)]
    try:
        rollouts = from_padded(
            ids,
            mask,
            token_versions=versions,
            attention_mask=None if attention is None else _as_numpy("attention_mask", attention, ids[0]),
            logprobs=None if logprobs is None else _as_numpy("logprobs", logprobs, ids[0]),
            group_ids=group_ids,
        )
    except TraceError as error:
        raise _renamed(error) from None
    return _Group(dict(data), rollouts, mask, _on_device(data["loss_mask"]))


def _take_rows(value: Any, rows: npt.NDArray[np.int64], total: int) -> Any:
    """``value`` restricted to ``rows`` when it is per row (a tensor, array or list of ``total`` rows)."""
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) >= 1 and int(shape[0]) == total:
        if getattr(value, "detach", None) is not None:
            torch = _torch()
            return value.index_select(0, torch.as_tensor(rows, device=value.device))
        return np.asarray(value)[rows]
    if isinstance(value, list) and len(value) == total:
        return [value[i] for i in rows.tolist()]
    return value


def _lag_tensor(like: Any, lags: npt.NDArray[np.int64]) -> Any:
    """``lags`` in the batch's own kind: a torch int64 tensor on ``like``'s device, or numpy."""
    if getattr(like, "detach", None) is not None:
        torch = _torch()
        return torch.from_numpy(lags).to(like.device)
    return lags


def _write_back(group: _Group) -> None:
    """When the sink masked a copy (of a non-contiguous or device tensor), the mask goes into AReaL's own."""
    if not np.may_share_memory(group.rollouts.mask, group.mask):
        group.mask[...] = group.rollouts.mask.reshape(group.mask.shape)
    if group.host_copy:
        torch = _torch()
        group.data["loss_mask"].copy_(torch.from_numpy(group.mask))


def _rows_of(group: _Group, picked: list[tuple[int, npt.NDArray[np.int64]]]) -> dict[str, Any]:
    """The group's dict with only ``picked`` rows (row, lag), ``staleness_lag`` attached."""
    picked.sort(key=lambda item: item[0])
    rows = np.array([row for row, _ in picked], dtype=np.int64)
    total = group.rollouts.n_rollouts
    data = group.data
    out = dict(data) if len(rows) == total else {key: _take_rows(v, rows, total) for key, v in data.items()}
    width = int(group.mask.shape[1])
    lags = np.stack([lag for _, lag in picked]) if picked else np.zeros((0, width), dtype=np.int64)
    out["staleness_lag"] = _lag_tensor(data["loss_mask"], lags)
    return out


def ship(
    monitor: StalenessMonitor, batch: AReaLBatch, *, version: int, group_sizes: Sequence[int] | None = None
) -> AReaLBatch:
    """Ship an AReaL batch at its trained ``version`` (``global_step``) and give back the batch to train.

    ``batch`` is what ``prepare_batch`` / ``rollout_batch`` return (``list[dict]``, one ``[G, L_g]`` dict per
    prompt group) or one padded dict (``concat_batch``; ``group_sizes`` are its ``traj_group_sizes``, else
    each row is its own group). The rollouts are added and shipped at step ``version + 1``; the masked
    ``loss_mask`` lands in AReaL's own tensors; rows dropped for staleness or held back are left out (a
    ``list`` loses the groups left empty; a dict is filtered in place); every kept dict gets
    ``staleness_lag`` (int64 ``[G, L]``, the SPEC 11 lag of each sampled position, -1 elsewhere). Only
    ``xtuner`` with ``retry_expired`` holds rows back, until re-rollouts of their group arrive; AReaL re-rolls
    nothing, so that configuration is refused (``ConfigError``) rather than holding rows for ever.
    """
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise ValueError(f"version: expected AReaL's global_step (an integer >= 0), got {version!r}")
    if monitor.config.policy == "xtuner" and monitor.config.retry_expired:
        # Held rows wait for re-rollouts of their group; AReaL re-rolls nothing and its batches carry no group
        # id that a later batch could name, so they would wait for ever.
        raise ConfigError("retry_expired: AReaL does not re-roll expired rollouts; use retry_expired=False with AReaL")
    single = isinstance(batch, dict)
    given: list[Any] = [batch] if single else list(batch)
    if single and group_sizes is None:
        groups = [_read_group(given[0], None)]
    else:
        groups = [_read_group(data, group_sizes if single else None) for data in given]
    for group in groups:
        monitor.add(group.rollouts)
    try:
        shipment = monitor.ship(int(version) + 1)
    except TraceError as error:
        raise _renamed(error) from None
    kept = _kept_rows(shipment, groups)
    if not single:
        return [_rows_of(group, picked) for group, picked in kept]  # type: ignore[return-value]
    assert isinstance(batch, dict)
    batch.update(_rows_of(groups[0], kept[0][1] if kept else []))  # no row left: the keys stay, with 0 rows
    return batch  # type: ignore[return-value]


def _kept_rows(
    shipment: Shipment, groups: list[_Group]
) -> list[tuple[_Group, list[tuple[int, npt.NDArray[np.int64]]]]]:
    """Per group of this call, the shipped rows with their lags (the mask written back where needed)."""
    by_batch = {id(group.rollouts): group for group in groups}
    picked: dict[int, list[tuple[int, npt.NDArray[np.int64]]]] = {}
    lags, offsets = shipment.lags, shipment.lag_offsets
    sample = 0
    for rollout in shipment.rollouts:
        if id(rollout.batch) in by_batch and rollout.samples:
            lo, hi = int(offsets[sample]), int(offsets[sample + 1])
            picked.setdefault(id(rollout.batch), []).append((rollout.index, lags[lo:hi]))
        sample += len(rollout.samples)
    out = []
    for group in groups:
        rows = picked.get(id(group.rollouts))
        if rows:
            _write_back(group)
            out.append((group, rows))
    return out
