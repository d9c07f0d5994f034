"""AReaL's padded rollout batches (``loss_mask``, per-token ``versions``) as a :class:`RolloutBatch`
and back, one rollout per row, read with no import of AReaL (``docs/trainers/areal.md``)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

from ..engine.shipment import Shipment, padded_shipment
from ..errors import ConfigError, FieldError, FieldTypeError, MissingFieldError, TraceError
from ..records.columnar import RolloutBatch
from ._ship import SetAside, ShippedPart, TrainerArray, TrainerNames, new_tensor_like, read_rows, ship_rows, take_rows

if TYPE_CHECKING:
    from ..monitor import StalenessMonitor

AReaLBatch = TypeVar("AReaLBatch", list[dict[str, Any]], dict[str, Any])


def from_areal(
    batch: Mapping[str, Any],
    ids: Sequence[str],
    *,
    group_ids: Sequence[str | None] | None = None,
    envs: Sequence[str | None] | None = None,
    dispatch_version: Any = None,
) -> RolloutBatch:
    """One rollout per row of one padded AReaL dict (numpy arrays or CPU tensors; a contiguous
    ``loss_mask`` is masked in place); ``attention_mask`` says which positions hold tokens, and
    ``ids`` name the rows (AReaL's carry no id)."""
    for key in ("loss_mask", "versions"):
        if key not in batch:
            raise MissingFieldError(key, f"missing from the AReaL batch (present: {sorted(batch)})")
    return RolloutBatch.from_padded(
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
    """The ``[B, L]`` ``loss_mask`` after ``shipment`` (0 on masked and unshipped rows)."""
    return padded_shipment(shipment, batch).mask


_NAMES = TrainerNames(
    "AReaL", "global_step (its version during global step g is g), not the epoch step `step`",
    {**dict.fromkeys(("token_versions", "weight_versions", "dispatch_version"), "versions[{row}]"),
     "mask": "loss_mask[{row}]", "logprobs": "logprobs[{row}]"},
)  # fmt: skip

_READ = ("versions", "attention_mask", "logprobs")


def _read_group(
    monitor: StalenessMonitor, data: dict[str, Any], sizes: Sequence[int] | None, at: str, set_aside: SetAside
) -> tuple[RolloutBatch, dict[str, Any], Callable[[], None]]:
    """One of AReaL's ``[G, L]`` dicts (``at``: ``batch[k].`` among several) as rows for the sink,
    its ``loss_mask`` the sink's mask (``set_aside``: its rows lenient mode sets aside)."""
    if not isinstance(data, dict):
        raise FieldTypeError("data", f"AReaL batch: expected a dict of tensors per group, got {type(data).__name__}")
    prefix = f"areal-{uuid.uuid4().hex[:12]}"
    for key in ("loss_mask", "versions"):
        if data.get(key) is None:
            state = "None" if key in data else f"missing (keys: {sorted(data)})"
            raise TraceError(f"{prefix}/0", f"{at}{key}[0]", f"AReaL's {key} is {state}")
    mask = TrainerArray(data["loss_mask"], f"{at}loss_mask")
    if mask.array.ndim != 2:
        raise TraceError(f"{prefix}/0", f"{at}loss_mask[0]", f"expected [G, L], got shape {mask.array.shape}")
    rows = int(mask.array.shape[0])
    ids = [f"{prefix}/{k}" for k in range(rows)]
    if sizes is None:  # one dict = one prompt group (GroupedRolloutWorkflow)
        group_ids: list[str | None] = [prefix] * rows
    else:
        sizes = [int(n) for n in sizes]
        if sum(sizes) != rows or any(n < 1 for n in sizes):
            raise FieldError("group_sizes", f"{sizes} do not add up to the batch's {rows} rows")
        group_ids = [f"{prefix}/g{g}" for g, n in enumerate(sizes) for _ in range(n)]

    def read(rows: list[int] | None) -> tuple[RolloutBatch, dict[str, Any], TrainerArray]:
        kept = {k: take_rows(v, rows, len(ids)) for k, v in data.items()}  # (lenient: rows left)
        own = TrainerArray(kept["loss_mask"], f"{at}loss_mask")
        arrays = {k: TrainerArray(v, at + k).array for k, v in kept.items() if k in _READ and v is not None}
        row_ids, groups = take_rows(ids, rows, len(ids)), take_rows(group_ids, rows, len(ids))
        try:
            rollouts = from_areal({**arrays, "loss_mask": own.array}, row_ids, group_ids=groups)
        except FieldError as error:  # a whole array's fault: named at its first row
            raise TraceError(row_ids[0], str(error.field), error.reason) from None
        return rollouts, kept, own

    rollouts, kept, own = read_rows(monitor, ids, read, _NAMES, at, set_aside=set_aside)
    return rollouts, kept, lambda: own.write_back(rollouts.mask)


def _rows_of(part: ShippedPart[dict[str, Any]]) -> dict[str, Any]:
    data, rows, total = part.source, part.rows.tolist(), part.batch.n_rollouts
    out = dict(data) if part.every_row else {k: take_rows(v, rows, total) for k, v in data.items()}
    out["staleness_lag"] = new_tensor_like(data["loss_mask"], part.lag_matrix())
    return out


def ship(
    monitor: StalenessMonitor,
    batch: AReaLBatch,
    *,
    version: int,
    group_sizes: Sequence[int] | None = None,
) -> AReaLBatch:
    """Ship an AReaL batch (``prepare_batch``'s ``list[dict]`` or a ``concat_batch`` dict, whose
    ``traj_group_sizes`` are ``group_sizes``) at ``version`` (``global_step``); give back the batch
    to train: the masking in its ``loss_mask``, dropped rows left out, ``staleness_lag`` (int64
    ``[G, L]``) in every kept dict. ``xtuner`` with ``retry_expired`` is refused."""
    if monitor.config.policy == "xtuner" and monitor.config.retry_expired:
        # held rows would wait for ever for re-rollouts of their group
        raise ConfigError("retry_expired: AReaL does not re-roll expired rollouts; use retry_expired=False with AReaL")
    single = isinstance(batch, dict)
    given: list[Any] = [batch] if single else list(batch)
    sizes = group_sizes if single else None  # (several dicts: refusals name the dict, as ship_rows)
    at = [f"batch[{k}]." * (len(given) > 1) for k in range(len(given))]

    def read(set_aside: SetAside) -> list[tuple[RolloutBatch, dict[str, Any], Callable[[], None]]]:
        return [_read_group(monitor, data, sizes, where, set_aside) for data, where in zip(given, at)]

    # (one dict holds one call's rows: refused while another's are queued)
    result = ship_rows(monitor, read, version=version, names=_NAMES, given=batch, alone=single)
    out = batch if isinstance(batch, dict) else [_rows_of(part) for part in result.parts]
    if isinstance(batch, dict):
        batch.update(_rows_of((result.parts or result.empty)[0]))
    result.handed_back(monitor)  # (its last act: a Ctrl-C before it, a repeat gets this result)
    return out  # type: ignore[return-value]
