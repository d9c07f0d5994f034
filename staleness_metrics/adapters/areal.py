"""AReaL rollout batches (padded tensors with per-token ``versions``) as a :class:`RolloutBatch`.

Built from AReaL's own source, with no import of it:

- ``inclusionAI/AReaL`` @ ``072480e26a1dc2ac1692164e504315d7e508478b``, ``areal/workflow/rlvr.py``
  (``RLVRWorkflow.arun_episode``): each sequence is ``input_ids`` = prompt + output, ``loss_mask`` =
  ``[0] * prompt + [1] * output``, ``logprobs`` = ``[0.0] * prompt + output_logprobs``, ``versions``
  = ``[-1] * prompt + output_versions`` (the engine version that sampled each output token),
  ``attention_mask`` all ones, ``rewards`` one per sequence; one dict per sample, each ``[1, n]``.
- ``inclusionAI/AReaL`` @ ``7da889ab7532e1a42dff35ee9362385ddde1c38f``, ``areal/utils/data.py``
  (``concat_padded_tensors``): the samples are right-padded to the longest ``attention_mask``, with
  0 in ``attention_mask`` and ``pad_value`` (0) in every other key, ``versions`` included.

So a padded AReaL batch is ``[B, L]`` rows; the attention mask says which positions hold tokens (a
padded ``versions`` 0 is not a label), prompt positions are unlabelled (``-1``) and never sampled
(``loss_mask`` 0). Each row is one rollout. Its dispatch version is the oldest version among its
labels (a partial rollout keeps its first tokens' versions), unless given.

What ``rollout_batch`` / ``prepare_batch`` return (``inclusionAI/AReaL`` release 1.0.4,
``areal/infra/workflow_executor.py`` ``rollout_batch`` / ``prepare_batch``) is a
``list[dict]``, one dict per prompt group shaped ``[G, L_g]``
(``GroupedRolloutWorkflow`` in ``areal/infra/remote_inf_engine.py`` concatenates the
group's ``[1, n]`` dicts with ``concat_padded_tensors``); ``concat_batch``
(``areal/utils/data.py``) makes one padded dict of them.

:func:`ship` is the one call (SPEC 15): in ``PPOTrainer.train``
(``areal/trainer/rl_trainer.py``), right after ``rollout_batch = self.actor.prepare_batch(...)``
and before the critic, reference, ``compute_logp`` and ``compute_advantages``, with
``version=global_step``: AReaL's version during global step ``g`` is ``g``
(``new_version = global_step + 1`` is set after the update), not its epoch step ``step``. The
lower-level :func:`from_areal` and :func:`areal_loss_mask` stay for one padded dict.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

from ..engine.shipment import Shipment, padded_shipment
from ..errors import ConfigError, FieldError, FieldTypeError, MissingFieldError, TraceError
from ..records.columnar import RolloutBatch
from ..records.padded import from_padded
from ._ship import ShippedPart, TrainerArray, TrainerNames, new_tensor_like, ship_row_batches

if TYPE_CHECKING:
    from ..monitor import StalenessMonitor

__all__ = ["areal_loss_mask", "from_areal", "ship"]

AReaLBatch = TypeVar("AReaLBatch", list[dict[str, Any]], dict[str, Any])


def from_areal(
    batch: Mapping[str, Any],
    ids: Sequence[str],
    *,
    group_ids: Sequence[str | None] | None = None,
    envs: Sequence[str | None] | None = None,
    dispatch_version: Any = None,
) -> RolloutBatch:
    """One rollout per row of an AReaL batch (``loss_mask``, ``versions``,
    ``attention_mask``, ``logprobs``).

    Tensors may be numpy arrays or CPU torch tensors (read through
    ``numpy.asarray``, so a contiguous ``loss_mask`` is masked in place). ``ids``
    name the rows (AReaL's batches carry no id).
    """
    for key in ("loss_mask", "versions"):
        if key not in batch:
            raise MissingFieldError(key, f"missing from the AReaL batch (present: {sorted(batch)})")
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


def areal_loss_mask(shipment: Shipment, batch: RolloutBatch) -> npt.NDArray[np.generic]:
    """The ``[B, L]`` ``loss_mask`` after ``shipment``: masked positions and
    rows not shipped are 0."""
    return padded_shipment(shipment, batch).mask


# --------------------------------------------------------------------------- the one call (SPEC 15)

NAMES = TrainerNames(
    "AReaL",
    "global_step (its version during global step g is g), not the epoch step `step`",
    {
        "token_versions": "versions[{row}]",
        "weight_versions": "versions[{row}]",
        "dispatch_version": "versions[{row}]",
        "mask": "loss_mask[{row}]",
        "logprobs": "logprobs[{row}]",
    },
)


def _read_group(
    data: dict[str, Any], group_sizes: Sequence[int] | None
) -> tuple[RolloutBatch, dict[str, Any], Callable[[], None]]:
    """One of AReaL's ``[G, L]`` dicts as rows for the sink, its ``loss_mask`` the sink's mask."""
    if not isinstance(data, dict):
        raise FieldTypeError("data", f"AReaL batch: expected a dict of tensors per group, got {type(data).__name__}")
    prefix = f"areal-{uuid.uuid4().hex[:12]}"
    for key in ("loss_mask", "versions"):
        if data.get(key) is None:
            state = "None" if key in data else f"missing (keys: {sorted(data)})"
            raise TraceError(f"{prefix}/0", f"{key}[0]", f"AReaL's {key} is {state}")
    mask = TrainerArray(data["loss_mask"])
    if mask.array.ndim != 2:
        raise TraceError(f"{prefix}/0", "loss_mask[0]", f"expected [G, L], got shape {mask.array.shape}")
    rows = int(mask.array.shape[0])
    ids = [f"{prefix}/{k}" for k in range(rows)]
    if group_sizes is None:
        # one dict = one prompt group (GroupedRolloutWorkflow)
        group_ids: list[str | None] = [prefix] * rows
    else:
        sizes = [int(n) for n in group_sizes]
        if sum(sizes) != rows or any(n < 1 for n in sizes):
            raise FieldError("group_sizes", f"{sizes} do not add up to the batch's {rows} rows")
        group_ids = [f"{prefix}/g{g}" for g, n in enumerate(sizes) for _ in range(n)]
    attention, logprobs = data.get("attention_mask"), data.get("logprobs")
    try:
        rollouts = from_padded(
            ids,
            mask.array,
            token_versions=TrainerArray(data["versions"]).array,
            attention_mask=None if attention is None else TrainerArray(attention).array,
            logprobs=None if logprobs is None else TrainerArray(logprobs).array,
            group_ids=group_ids,
        )
    except TraceError as error:
        raise NAMES.trace_error(error, ids.index(error.rollout_id) if error.rollout_id in ids else None) from None
    return rollouts, data, lambda: mask.write_back(rollouts.mask)


def _take_rows(value: Any, rows: npt.NDArray[np.int64], total: int) -> Any:
    """``value`` restricted to ``rows`` when it is per row (a tensor, array or
    list of ``total`` rows)."""
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) >= 1 and int(shape[0]) == total:
        if isinstance(value, np.ndarray):
            return value[rows]
        # a tensor: AReaL's own kind and device
        return value.index_select(0, new_tensor_like(value, rows))
    if isinstance(value, list) and len(value) == total:
        return [value[i] for i in rows.tolist()]
    return value


def _rows_of(part: ShippedPart[dict[str, Any]]) -> dict[str, Any]:
    """The part's dict with only its shipped rows, ``staleness_lag`` attached."""
    data = part.source
    if part.every_row:
        out = dict(data)
    else:
        out = {key: _take_rows(value, part.rows, part.batch.n_rollouts) for key, value in data.items()}
    out["staleness_lag"] = new_tensor_like(data["loss_mask"], part.lag_matrix())
    return out


def ship(
    monitor: StalenessMonitor,
    batch: AReaLBatch,
    *,
    version: int,
    group_sizes: Sequence[int] | None = None,
) -> AReaLBatch:
    """Ship an AReaL batch at its trained ``version`` (``global_step``) and give
    back the batch to train.

    ``batch`` is what ``prepare_batch`` / ``rollout_batch`` return (``list[dict]``, one ``[G, L_g]``
    dict per prompt group) or one padded dict (``concat_batch``; ``group_sizes`` are its
    ``traj_group_sizes``, else each row is its own group). The rollouts are added and shipped at
    step ``version + 1`` in one ship; the masked ``loss_mask`` lands in AReaL's own tensors; rows
    dropped for staleness are left out (a ``list`` loses the groups left empty; a dict is filtered
    in place and keeps its keys); every kept dict gets ``staleness_lag`` (int64 ``[G, L]``, the SPEC
    11 lag of each sampled position, -1 elsewhere). Only ``xtuner`` with ``retry_expired`` holds
    rows back, until re-rollouts of their group arrive; AReaL re-rolls nothing, so that
    configuration is refused (``ConfigError``) rather than holding rows for ever.
    """
    if monitor.config.policy == "xtuner" and monitor.config.retry_expired:
        # Held rows wait for re-rollouts of their group; AReaL re-rolls nothing and its batches
        # carry no group id that a later batch could name, so they would wait for ever.
        raise ConfigError("retry_expired: AReaL does not re-roll expired rollouts; use retry_expired=False with AReaL")
    single = isinstance(batch, dict)
    given: list[Any] = [batch] if single else list(batch)
    parts = [_read_group(data, group_sizes if single else None) for data in given]
    result = ship_row_batches(monitor, parts, version=version, names=NAMES)
    if not single:
        return [_rows_of(part) for part in result.parts]  # type: ignore[return-value]
    assert isinstance(batch, dict)
    if result.parts:
        batch.update(_rows_of(result.parts[0]))
    else:  # no row left: the dict keeps its keys, with 0 rows
        empty = ShippedPart(batch, parts[0][0], np.zeros(0, dtype=np.int64), (), ())
        batch.update(_rows_of(empty))
    return batch  # type: ignore[return-value]
