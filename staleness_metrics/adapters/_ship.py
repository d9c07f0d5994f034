"""SPEC 15's one call, the part every trainer shares: add a trainer's batch, ship at step
``version + 1``, hand back its rows per trainer batch (held ones with the call that ships them)."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from ..engine.segments import segment_max
from ..engine.shipment import Shipment, ShippedRollout
from ..engine.sink import versions_above
from ..errors import FieldError, FieldTypeError, TraceError
from ..records.columnar import LABELS_SPANS, LABELS_TOKENS, IntArray, RolloutBatch, as_numpy
from ..records.model import UnparsedRollout

S = TypeVar("S")
Batch = tuple[RolloutBatch, S, Callable[[], None] | None]  # (its rows, read from S; write_back)
Batches = Sequence[Batch[S]]
SetAside = list[UnparsedRollout]  # the rows a lenient read set aside, counted once the call is added


@dataclass(frozen=True)
class TrainerNames:
    """How a trainer names ``version`` (``counter``) and SPEC 3 fields (``{row}``: the row)."""

    trainer: str
    counter: str
    fields: Mapping[str, str] = field(default_factory=dict)

    def trace_error(self, error: TraceError, ids: Sequence[str] = (), at: str = "") -> TraceError:
        """``error`` naming the trainer's own field, at the row of its rollout in ``ids`` (in the
        trainer batch ``at``)."""
        own, rid = self.fields.get(error.field.rsplit(".", 1)[-1]), error.rollout_id
        name = error.field if own is None or rid not in ids else own.format(row=ids.index(rid))
        reason = error.reason
        if "is above the trained version" in reason:
            trained = "`version` is the policy version of the weights being trained"
            reason += f"; {trained}: pass {self.trainer}'s {self.counter}"
        return TraceError(rid, at + name, reason)


class TrainerArray:
    """A trainer's array or tensor as numpy (a view where it can be), and the way back into it."""

    def __init__(self, value: Any, name: str | None = None) -> None:
        self.value = value
        self.shared = True  # whether ``array`` is the trainer's own memory
        if isinstance(value, np.ndarray):
            self.array = value
        elif _is_tensor(value):
            self.array = as_numpy(value, name)
            self.shared = self.array.ctypes.data == value.data_ptr() and not value.requires_grad
        else:
            raise FieldTypeError(name, f"expected a numpy array or a tensor, got {type(value).__name__}")

    def write_back(self, masked: npt.NDArray[Any]) -> None:
        """Make the trainer's object hold ``masked``, keeping its dtype and device."""
        if self.shared and np.may_share_memory(masked, self.array):
            return  # masked in place
        values = np.ascontiguousarray(masked.reshape(self.array.shape))
        if isinstance(self.value, np.ndarray):
            self.value[...] = values
        else:  # copy_ keeps the tensor's dtype and device (torch is imported: a tensor was given)
            self.value.detach().copy_(sys.modules["torch"].from_numpy(values))


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "numpy") and hasattr(value, "device") and hasattr(value, "copy_")


def read_rows(monitor: Any, ids: Sequence[str], read: Callable[[list[int] | None], S],
              names: TrainerNames, at: str = "", envs: Sequence[Any] | None = None, *,
              set_aside: SetAside) -> S:  # fmt: skip
    """``read(None)``: every row of a trainer batch (``ids``); a refusal raises naming the
    trainer's field or, lenient (SPEC 3), sets that rollout aside into ``set_aside`` (its env of
    ``envs``; counted invalid once the call is accepted), and ``read(rows)`` reads the rows left."""
    rows = list(range(len(ids)))
    while True:
        try:
            return read(None if len(rows) == len(ids) else rows)
        except TraceError as error:
            if monitor.config.strict or (rid := error.rollout_id) is None or rid not in ids:
                raise names.trace_error(error, ids, at) from error
            rows.remove(row := list(ids).index(rid))
            env = None if envs is None or envs[row] is None else str(envs[row])
            set_aside.append(UnparsedRollout(names.trace_error(error, ids, at), env))


def take_rows(value: Any, rows: Sequence[int] | None, total: int) -> Any:
    """``value`` restricted to ``rows`` (None: all) when it is per row (of ``total`` rows)."""
    if rows is None:
        return value
    if getattr(value, "ndim", 0) >= 1 and int(value.shape[0]) == total:  # (an array or a tensor)
        if isinstance(value, np.ndarray):
            return value[list(rows)]
        return value.index_select(0, new_tensor_like(value, np.array(rows, dtype=np.int64)))
    return [value[i] for i in rows] if isinstance(value, list) and len(value) == total else value


def new_tensor_like(reference: Any, values: npt.NDArray[Any]) -> Any:
    """``values`` as the kind of array ``reference`` is (a tensor on its device, or numpy)."""
    if _is_tensor(reference):
        return sys.modules["torch"].from_numpy(np.ascontiguousarray(values)).to(reference.device)
    return values


@dataclass(frozen=True)
class ShippedPart(Generic[S]):
    """The rows of one trainer batch a ship shipped, in order, with their kept samples' lags."""

    source: S
    batch: RolloutBatch
    rows: IntArray
    samples: tuple[tuple[int, ...], ...]
    lags: tuple[npt.NDArray[np.int64], ...]

    @property
    def every_row(self) -> bool:
        """Every row of ``source`` shipped, in order, with all its samples."""
        batch = self.batch
        in_order = np.array_equal(self.rows, np.arange(batch.n_rollouts))
        return in_order and sum(map(len, self.samples)) == int(batch.sample_offsets[-1])

    def lag_matrix(self) -> npt.NDArray[np.int64]:
        """``[len(rows), L]`` lags of a padded batch (one sample per row, all of width ``L``)."""
        assert self.batch.padded is not None  # (verl's and AReaL's batches are)
        if not self.lags:
            return np.zeros((0, self.batch.padded.width), dtype=np.int64)
        return np.stack(self.lags).astype(np.int64, copy=False)


@dataclass(frozen=True)
class ShipResult(Generic[S]):
    """A shipment, its rows per trainer batch (oldest call first) and this call's batches, no rows."""

    shipment: Shipment
    parts: tuple[ShippedPart[S], ...]
    empty: tuple[ShippedPart[S], ...]

    def handed_back(self, monitor: Any) -> None:
        """Its call's last act: a call with the same object again is a new one."""
        with monitor.adapter_lock:
            if (pending := _PENDING[monitor]).shipped and pending.shipped[1] is self:
                pending.shipped = None


@dataclass
class _Entry:
    batch: RolloutBatch
    source: Any
    write_back: Callable[[], None] | None
    given: object  # the caller's object, until a ship completes


@dataclass
class _Pending:
    entries: dict[int, _Entry] = field(default_factory=dict)  # by id() of the RolloutBatch
    owner: dict[str, int] = field(default_factory=dict)  # queued rollout id -> its entry
    queue: Any = None  # the sink's queue they were queued in (load_state_dict makes a new one)
    shipped: tuple[object, ShipResult[Any]] | None = None  # (given, its result) until handed back


_PENDING: weakref.WeakKeyDictionary[Any, _Pending] = weakref.WeakKeyDictionary()


def ship_rows(monitor: Any, rows: Batches[S] | Callable[[SetAside], Batches[S]], *, version: int,
              names: TrainerNames, given: object = None, alone: bool = False,
              apart: Callable[[Any], str | None] | None = None) -> ShipResult[S]:  # fmt: skip
    """Add each ``(batch, source, write_back)`` of ``rows`` (or ``rows(set_aside)``: read) and ship at
    step ``version + 1``; ``write_back`` runs once a ship took rows of its batch. A call with the
    ``given`` of one that did not ship ships its rows; ``alone``: none of another call queued;
    ``apart``: why the source of a row held by another call cannot be given back with this one's."""
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
        what = f"the policy version being trained: {names.trainer}'s {names.counter}"
        raise FieldTypeError("version", f"expected an int ({what}), got {type(version).__name__}")
    if version < 0:
        raise FieldError("version", f"{version} is negative; pass {names.trainer}'s {names.counter}")
    trained = int(version)
    with monitor.adapter_lock:  # from the read to the rows handed back: another call's are not ours
        pending = _PENDING.setdefault(monitor, _Pending())
        if pending.queue is not (queue := monitor.sink.queue):  # loaded a checkpoint: its rows only
            pending.queue, pending.shipped = queue, None
            _keep(pending, [rid for rid in pending.owner if len(queue.rows_named((rid,)))])
        if given is not None and pending.shipped is not None and pending.shipped[0] is given:
            return pending.shipped[1]  # (shipped, not handed back: interrupted after its ship)
        try:  # the step rule before the read and the add: a refused call queues and counts nothing
            monitor.sink.next_step(trained + 1)
        except ValueError as error:
            raise FieldError("version", f"{trained}: {error} (pass {names.trainer}'s {names.counter})") from error
        if alone and (other := [r for r, k in pending.owner.items() if pending.entries[k].given is not given]):
            reason = f"queued by an earlier {names.trainer} call that did not ship: repeat it, or pass a list"
            raise TraceError(other[0], "batch", reason)
        held = [(rid, e.source) for rid, k in pending.owner.items() if (e := pending.entries[k]).given is not given]
        if apart is not None and (why := next(((rid, w) for rid, s in held if (w := apart(s))), None)):
            raise TraceError(why[0], "batch", why[1])
        entries = pending.entries.values() if given is not None else ()
        batches: Batches[S] = [(e.batch, e.source, e.write_back) for e in entries if e.given is given]
        if not batches:  # (else the call is one's again that did not ship: its rows are queued)
            set_aside: SetAside = []
            batches = rows(set_aside) if callable(rows) else rows
            try:  # one add: all or nothing (so the ship's version rule first: it refuses queued rows)
                for batch, _, _ in batches if monitor.config.strict else ():  # (lenient: at ship)
                    _refuse_above(batch, trained)
                monitor.add(set_aside)  # (lenient: the rows the read set aside, counted invalid)
                monitor.add(batches[0][0] if len(batches) == 1 else [b for b, _, _ in batches])
            except TraceError as error:
                k = next((k for k, (b, _, _) in enumerate(batches) if error.rollout_id in b.ids), 0)
                which = f"batch[{k}]." if len(batches) > 1 else ""  # (the trainer batch at fault)
                raise names.trace_error(error, batches[k][0].ids, which) from error
            for b, source, write_back in batches:  # (a row owned already stays its owner's)
                pending.entries[id(b)] = _Entry(b, source, write_back, given)
                pending.owner.update({rid: id(b) for rid in b.ids if rid not in pending.owner})
        try:
            shipment: Shipment = monitor.ship(trained + 1, ids=list(pending.owner))
        except TraceError as error:
            entry = pending.entries.get(pending.owner.get(error.rollout_id or "", -1))
            raise names.trace_error(error, () if entry is None else entry.batch.ids) from error
        for entry in pending.entries.values():  # shipped: a call again with a held row's is a new one
            entry.given = None
        empty = tuple(ShippedPart(s, b, np.zeros(0, dtype=np.int64), (), ()) for b, s, _ in batches)
        result = ShipResult(shipment, _collect(pending, shipment), empty)
        pending.shipped = None if given is None else (given, result)
        return result


def rollout_lags(shipment: Shipment) -> Iterator[tuple[ShippedRollout, list[npt.NDArray[np.int64]]]]:
    """Each shipped rollout with the SPEC 11 lags of its kept samples, per position."""
    lags, offsets, sample = shipment.lags, shipment.lag_offsets, 0
    for rollout in shipment.rollouts:
        count = len(rollout.samples)
        yield rollout, [lags[offsets[k] : offsets[k + 1]] for k in range(sample, sample + count)]
        sample += count


def _collect(pending: _Pending, shipment: Shipment) -> tuple[ShippedPart[Any], ...]:
    # id of the RolloutBatch -> (row, kept samples, their lags) per shipped rollout
    grouped: dict[int, list[tuple[int, tuple[int, ...], list[npt.NDArray[np.int64]]]]] = {}
    for rollout, spans in rollout_lags(shipment):
        if rollout.samples:
            grouped.setdefault(id(rollout.batch), []).append((rollout.index, rollout.samples, spans))
    parts = []
    for key, shipped in grouped.items():
        entry = pending.entries[key]
        if entry.write_back is not None:
            entry.write_back()
        rows = np.array([row for row, _, _ in shipped], dtype=np.int64)
        samples = tuple(kept for _, kept, _ in shipped)
        part_lags = tuple(lag for _, _, spans in shipped for lag in spans)
        parts.append(ShippedPart(entry.source, entry.batch, rows, samples, part_lags))
    _keep(pending, set(shipment.held))  # it took every owned row (a set-aside id may name a held)
    return tuple(parts)


def _keep(pending: _Pending, queued: Container[str]) -> None:
    """Only the rows ``queued`` still wait: the entries of none of them are forgotten."""
    pending.owner = {rid: key for rid, key in pending.owner.items() if rid in queued}
    pending.entries = {k: e for k, e in pending.entries.items() if k in pending.owner.values()}


def _refuse_above(batch: RolloutBatch, trained: int) -> None:
    """The sink's ship-time rule before the add: the sink refuses only queued rows, and a refused
    call must queue none."""
    assert batch.label_kind is not None
    max_label = np.full(batch.n_samples, -1, dtype=np.int64)
    for kind, values, offsets in ((LABELS_TOKENS, batch.token_versions, batch.position_offsets),
                                  (LABELS_SPANS, batch.span_versions, batch.span_offsets)):  # fmt: skip
        if values is not None and offsets is not None:
            mine = batch.label_kind == kind
            max_label[mine] = segment_max(values, offsets, -1)[mine]
    counts = np.diff(batch.sample_offsets)
    errors = versions_above(
        batch.ids.__getitem__, batch.dispatch_version, counts, max_label, batch.label_kind, trained
    )[1]
    if errors:
        raise errors[0]
