"""SPEC 15's one call, the part every trainer shares: add a trainer's batch,
ship it, hand back its rows.

An adapter's ``ship(monitor, batch, *, version)`` does three things of its own
and leaves the rest here:

1. it reads the trainer's batch into a :class:`~staleness_metrics.records.columnar.RolloutBatch`
   whose arrays are the trainer's own where they can be (wrap each one in :class:`TrainerArray` to
   get a numpy view and the way back);
2. it calls :func:`ship_rows` with that batch, the trainer's batch as ``source`` and the
   :class:`TrainerNames` that say how the trainer calls things;
3. it turns the returned :class:`ShippedPart` s back into the trainer's own type (the whole
   ``source`` when every row shipped, else the trainer's own row selection and concatenation),
   attaching :meth:`ShippedPart.lag_matrix` (or :attr:`ShippedPart.lags`) as ``staleness_lag``.

:func:`ship_rows` adds the batch, ships at step ``version + 1`` the rollouts entered through it (and
only those: rollouts the caller added to the same monitor by hand stay queued for the caller's own
ship), writes the masked arrays back into the trainer's arrays that are not shared with the sink,
and returns the shipped rows grouped by the call that entered them, in ship order. Rows the policy
holds back (``xtuner`` with ``retry_expired``) are kept per monitor with their trainer batch and
come back as a part of the later call that ships them; dropped and invalid rows are forgotten. A
``TraceError`` from the sink is raised again naming the trainer's own field and row
(``non_tensor_batch['param_version_start'][3]``), and for a version above ``version`` which of the
trainer's counters to pass.

Nothing here imports a trainer's package or torch at import time: tensors are told by their
methods. The record of held rows and their trainer batches lives in this process only: after a
restart from a checkpoint, rows held by the previous process stay queued in the restored sink
and are not handed back.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from ..engine.shipment import Shipment
from ..errors import FieldError, FieldTypeError, TraceError
from ..records.columnar import RolloutBatch

__all__ = [
    "ShipResult",
    "ShippedPart",
    "TrainerArray",
    "TrainerNames",
    "new_tensor_like",
    "ship_row_batches",
    "ship_rows",
]

S = TypeVar("S")
IntArray = npt.NDArray[np.int64]

_ABOVE_TRAINED = "is above the trained version"


@dataclass(frozen=True)
class TrainerNames:
    """How one trainer calls what the sink checks.

    ``counter`` names the trainer variable to pass as ``version`` (said in the error for a version
    above it); ``fields`` maps the last part of a SPEC 3 field name (``dispatch_version``,
    ``completion_version``, ``mask``, ``token_versions``, ``logprobs`` ...) to the trainer's own
    name of it, with ``{row}`` for the row of the trainer's batch.
    """

    trainer: str
    counter: str
    fields: Mapping[str, str] = field(default_factory=dict)

    def field_of(self, name: str, row: int | None) -> str:
        own = self.fields.get(name.rsplit(".", 1)[-1])
        if own is None or row is None:
            return name
        return own.format(row=row)

    def trace_error(self, error: TraceError, row: int | None) -> TraceError:
        reason = error.reason
        if _ABOVE_TRAINED in reason:
            reason += (
                f"; `version` is the policy version of the weights being trained: pass {self.trainer}'s {self.counter}"
            )
        return TraceError(error.rollout_id, self.field_of(error.field, row), reason)


class TrainerArray:
    """A trainer's ``[B, L]`` array or tensor as numpy, and the way back into it.

    ``array`` is a view of the trainer's memory for numpy arrays and CPU tensors (the sink then
    masks the trainer's own object), else a copy (a GPU tensor, one that needs grad);
    :meth:`write_back` copies the masked values into the trainer's object when they are not already
    there, keeping its dtype and device.
    """

    def __init__(self, value: Any) -> None:
        self.value = value
        self.shared = True  # whether ``array`` is the trainer's own memory
        if isinstance(value, np.ndarray):
            self.array = value
        elif _is_tensor(value) and value.device.type == "cpu" and not value.requires_grad:
            self.array = value.numpy()
        elif _is_tensor(value):
            self.array, self.shared = value.detach().cpu().numpy(), False
        else:
            raise FieldTypeError(None, f"expected a numpy array or a tensor, got {type(value).__name__}")

    def write_back(self, masked: npt.NDArray[Any]) -> None:
        """Make the trainer's object hold ``masked`` (the sink's flat view or
        copy of :attr:`array`)."""
        if self.shared and np.may_share_memory(masked, self.array):
            return  # masked in place
        values = np.ascontiguousarray(masked.reshape(self.array.shape))
        if isinstance(self.value, np.ndarray):
            self.value[...] = values
            return
        # copy_ keeps the tensor's dtype and device
        self.value.detach().copy_(_torch().from_numpy(values))


def _torch() -> Any:
    """The torch module, when a tensor was given (so torch is imported already):
    no import of our own."""
    return sys.modules["torch"]


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "numpy") and hasattr(value, "device") and hasattr(value, "copy_")


def new_tensor_like(reference: Any, values: npt.NDArray[Any]) -> Any:
    """``values`` as the kind of array ``reference`` is: numpy stays numpy, a tensor gives a tensor
    of ``values``' dtype on ``reference``'s device."""
    if _is_tensor(reference):
        return _torch().from_numpy(np.ascontiguousarray(values)).to(reference.device)
    return values


@dataclass(frozen=True)
class ShippedPart(Generic[S]):
    """The rows of one trainer batch (``source``, given to one call) that a
    ship shipped, in ship order.

    ``rows`` are rollout indices of ``batch`` (rows of the trainer's batch when each rollout is one
    row); ``samples[i]`` the kept sample indices of ``rows[i]``; ``lags`` one int64 array per kept
    sample, in the same order, SPEC 11's lag of each position (``T - v`` on sampled positions of
    live rollouts, -1 elsewhere).
    """

    source: S
    batch: RolloutBatch
    rows: IntArray
    samples: tuple[tuple[int, ...], ...]
    lags: tuple[npt.NDArray[np.int64], ...]

    @property
    def every_row(self) -> bool:
        """Every row of ``source`` shipped, in order, with all its samples: ``source``
        itself is the answer."""
        batch = self.batch
        return (
            len(self.rows) == batch.n_rollouts
            and bool((self.rows == np.arange(batch.n_rollouts)).all())
            and sum(map(len, self.samples)) == int(batch.sample_offsets[-1])
        )

    def lag_matrix(self) -> npt.NDArray[np.int64]:
        """``[len(rows), L]`` lags of a padded batch (one sample per row, all of width ``L``)."""
        if self.batch.padded is None:
            raise FieldError("lag_matrix", "the batch was not built by from_padded")
        width = self.batch.padded.width
        if not self.lags:
            return np.zeros((0, width), dtype=np.int64)
        return np.stack(self.lags).astype(np.int64, copy=False)


@dataclass(frozen=True)
class ShipResult(Generic[S]):
    """A ship seen per trainer batch: the :class:`~staleness_metrics.engine.shipment.Shipment`
    (metrics, drops, holds) and its shipped rows as :class:`ShippedPart` s, oldest call first."""

    shipment: Shipment
    parts: tuple[ShippedPart[S], ...]


@dataclass
class _Entry:
    batch: RolloutBatch
    source: Any
    write_back: Callable[[], None] | None
    open: int  # rows still queued
    row_of: dict[str, int] | None = None

    def row(self, rollout_id: str | None) -> int | None:
        if self.row_of is None:
            self.row_of = {rid: k for k, rid in enumerate(self.batch.ids)}
        return None if rollout_id is None else self.row_of.get(rollout_id)


@dataclass
class _Pending:
    entries: dict[int, _Entry] = field(default_factory=dict)  # by id() of the RolloutBatch
    owner: dict[str, int] = field(default_factory=dict)  # queued rollout id -> its entry


_PENDING: weakref.WeakKeyDictionary[Any, _Pending] = weakref.WeakKeyDictionary()


def _check_version(version: object, names: TrainerNames) -> int:
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
        raise FieldTypeError(
            "version",
            f"expected an int (the policy version being trained: {names.trainer}'s "
            f"{names.counter}), got {type(version).__name__}",
        )
    if version < 0:
        raise FieldError("version", f"{version} is negative; pass {names.trainer}'s {names.counter}")
    return int(version)


def ship_rows(
    monitor: Any,
    batch: RolloutBatch,
    source: S,
    *,
    version: int,
    names: TrainerNames,
    write_back: Callable[[], None] | None = None,
) -> ShipResult[S]:
    """Add ``batch`` (read from the trainer's ``source``) to ``monitor`` and ship
    at step ``version + 1``.

    ``write_back`` is called after a ship that shipped rows of ``batch`` (this call's or a later
    one's), to copy masked values into trainer arrays the sink could not mask in place.
    """
    return ship_row_batches(monitor, [(batch, source, write_back)], version=version, names=names)


def ship_row_batches(
    monitor: Any,
    batches: Sequence[tuple[RolloutBatch, S, Callable[[], None] | None]],
    *,
    version: int,
    names: TrainerNames,
) -> ShipResult[S]:
    """:func:`ship_rows` for a trainer batch held as several row batches (AReaL's ``list[dict]``,
    one ``[G, L_g]`` dict per group): each ``(batch, source, write_back)`` is added, then one
    ship takes them all, so the step gets one ship (one window, one export) however many parts
    the trainer's batch has."""
    trained = _check_version(version, names)
    pending = _PENDING.setdefault(monitor, _Pending())
    for batch, source, write_back in batches:
        try:
            monitor.add(batch)
        except TraceError as error:
            raise names.trace_error(error, _Entry(batch, source, None, 0).row(error.rollout_id)) from error
        queued = [rid for rid in batch.ids if rid not in pending.owner]
        pending.entries[id(batch)] = _Entry(batch, source, write_back, len(queued))
        pending.owner.update(dict.fromkeys(queued, id(batch)))
    try:
        shipment: Shipment = monitor.ship(trained + 1, ids=list(pending.owner))
    except TraceError as error:
        entry = pending.entries.get(pending.owner.get(error.rollout_id or "", -1))
        raise names.trace_error(error, None if entry is None else entry.row(error.rollout_id)) from error
    except ValueError as error:
        raise FieldError("version", f"{trained}: {error} (pass {names.trainer}'s {names.counter})") from error
    return ShipResult(shipment, _collect(pending, shipment))


def _collect(pending: _Pending, shipment: Shipment) -> tuple[ShippedPart[Any], ...]:
    lags, lag_offsets = shipment.lags, shipment.lag_offsets
    grouped: dict[int, tuple[list[int], list[tuple[int, ...]], list[npt.NDArray[np.int64]]]] = {}
    shipped_ids: list[str] = []
    sample = 0
    for rollout in shipment.rollouts:
        kept = rollout.samples
        shipped_ids.append(rollout.id)
        if kept:
            rows, samples, lag_list = grouped.setdefault(id(rollout.batch), ([], [], []))
            rows.append(rollout.index)
            samples.append(kept)
            for k in range(len(kept)):
                lag_list.append(lags[lag_offsets[sample + k] : lag_offsets[sample + k + 1]])
        sample += len(kept)
    parts = []
    for key, (rows, samples, lag_list) in grouped.items():
        entry = pending.entries[key]
        if entry.write_back is not None:
            entry.write_back()
        parts.append(
            ShippedPart(
                entry.source,
                entry.batch,
                np.asarray(rows, dtype=np.int64),
                tuple(samples),
                tuple(lag_list),
            )
        )
    gone = [
        *shipped_ids,
        *shipment.dropped_rollouts,
        *(e.rollout_id for e in shipment.invalid if e.rollout_id),
    ]
    for rid in gone:
        key = pending.owner.pop(rid, -1)
        if key >= 0:
            entry = pending.entries[key]
            entry.open -= 1
            if entry.open == 0:
                del pending.entries[key]
    return tuple(parts)
