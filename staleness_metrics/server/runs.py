"""The service's runs: one monitor (sink + exporters) per run, with exactly-once accounting.

The sink is not thread-safe, and exactly-once needs "check the ids, then add" to be one step, so every
call into a run holds the run's lock. Runs do not share locks: runs progress independently.

Exactly-once:

- **Rollouts**: a run remembers every rollout id it received (queued, or set aside as invalid in a
  lenient run) with a digest of the record. A record whose id and content were received before is a
  *duplicate*: counted as such and otherwise ignored, so a batch re-sent after a timeout changes nothing.
  In a batch that mixes new and already-received records, the new ones are added and the others are
  duplicates. A record re-using a received id with *different* content is a conflict (409) and nothing of
  its batch is applied. The same holds for one record twice in one batch.
- **Ships**: a ship carries an optional idempotency key; a ship with a key the run has already answered
  returns the stored answer (``replayed``) instead of shipping again, and the same key with a different
  request is refused. The last :data:`IDEMPOTENCY_KEYS_KEPT` keys of each run are remembered.
- **Mismatch sums** (SPEC 11): posts for one step merge (one per rank or micro-batch); a post carries an
  optional idempotency key with the same rules as a ship's (keys are kept per run and per endpoint), so
  a post retried after a timeout is counted once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from ..config import StalenessConfig
from ..engine.shipment import Shipment
from ..engine.state_checks import arrays_left_as_numpy
from ..errors import StalenessError, TraceError
from ..metrics.metric_table import BOUND_KEY_PREFIX, MISMATCH_KEY_PREFIX
from ..metrics.mismatch import LAG_BUCKETS, SUM_FIELDS, MismatchSums
from ..metrics.report import MetricValue
from ..monitor import StalenessMonitor
from ..records.validation import lone_surrogate, printable_id, surrogate_reason, unstorable
from .exporting import ExportSettings, RunExporters, build_exporters, preload
from .models import (
    AddResult,
    ErrorItem,
    MismatchRequest,
    MismatchResult,
    RunInfo,
    ShipRequest,
    ShipResult,
    StepRow,
    counts_of,
)
from .store import PIECE_BYTES, SNAPSHOT_BYTES, SNAPSHOT_EVERY, Chunked, Store, StoredRun, encoded_pieces

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = [
    "IDEMPOTENCY_KEYS_KEPT",
    "IdempotencyMismatch",
    "NotPersisted",
    "RecordConflict",
    "RecordsInvalid",
    "RestoreFailed",
    "Run",
    "RunBroken",
    "RunConflict",
    "RunError",
    "RunNotFound",
    "RunRegistry",
    "StepConflict",
]

logger = logging.getLogger("staleness_metrics.server")
RUN_STATE_FORMAT = 1

IDEMPOTENCY_KEYS_KEPT = 1024
_INT64 = (-(2**63), 2**63 - 1)


class RunError(Exception):
    """A request the run cannot honour; the app maps each subclass to a status code."""


class RunNotFound(RunError):
    pass


class RunConflict(RunError):
    """The run exists with another configuration."""


class RecordConflict(RunError):
    """A rollout id was received before with different content."""


class StepConflict(RunError):
    """A step below the run's latest step (steps never decrease)."""


class IdempotencyMismatch(RunError):
    """An idempotency key re-used for a different ship."""


class RunBroken(RunError):
    """A write could not be persisted: the run's memory is ahead of its store, so it takes no more writes."""


class NotPersisted(RunError):
    """The service keeps no history (``--in-memory``)."""


class RestoreFailed(Exception):
    """A stored run could not be loaded again at start (the message names the run and the row)."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RunError | TraceError | ValueError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class RecordsInvalid(RunError):
    """Invalid records or ship-time versions; nothing of the request was applied."""

    def __init__(self, errors: list[ErrorItem]) -> None:
        super().__init__("; ".join(f"{e.rollout_id!r}: {e.field}: {e.reason}" for e in errors))
        self.errors = errors


_DIGEST_OPTIONS = orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY


def _holds_large_array(record: Mapping[str, Any]) -> bool:
    """True when a sample of ``record`` holds an array (a long per-position list, see .decode) larger than
    :data:`~.store.PIECE_BYTES`: its text is then hashed and journalled a piece at a time."""
    samples = record.get("samples")
    if not isinstance(samples, list):
        return False
    for sample in samples:
        if isinstance(sample, dict):
            for value in sample.values():
                if isinstance(value, np.ndarray) and value.nbytes > PIECE_BYTES:
                    return True
    return False


def _canonical_digest(record: Mapping[str, Any], option: int) -> bytes:
    """The digest of ``orjson.dumps(record, option=option)``, hashed piece by piece for a large record."""
    if not _holds_large_array(record):
        return hashlib.blake2b(orjson.dumps(record, option=option), digest_size=16).digest()
    digest = hashlib.blake2b(digest_size=16)
    for piece in encoded_pieces(dict(record), option):
        digest.update(piece)
    return digest.digest()


def _digest(record: Mapping[str, Any]) -> bytes:
    # orjson writes bytes; json.dumps would first build a string per list item (per position).
    try:
        return _canonical_digest(record, _DIGEST_OPTIONS)
    except orjson.JSONEncodeError:  # an integer beyond 64 bits: rejected later, with its path
        canonical = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(canonical, digest_size=16).digest()


def _stored_digest(record: Mapping[str, Any]) -> bytes | None:
    """:func:`_digest` of a record the journal can store, None for one it cannot (a lone surrogate, an
    integer beyond signed 64 bits, deep nesting). The common case is one strict orjson encoding, the one
    the digest needs anyway; only a record it refuses is walked to find out why."""
    try:
        return _canonical_digest(record, _DIGEST_OPTIONS | orjson.OPT_STRICT_INTEGER)
    except orjson.JSONEncodeError:
        if unstorable(record) is not None:
            return None
        return _digest(record)  # integers past 2**53 but within 64 bits: stored exactly all the same


_CHUNKED_ADD_RECORDS = 256  # an add of more records than this is journalled a record at a time


def _add_row(records: list[dict[str, Any]], duplicates: int) -> Any:
    """The journal request of an add, ``{"rollouts": records, "duplicates": n}``: as a value for a small
    add, as pieces of its text (see :class:`~.store.Chunked`) for many records or large arrays."""
    large = [_holds_large_array(record) for record in records]
    if len(records) <= _CHUNKED_ADD_RECORDS and not any(large):
        return {"rollouts": records, "duplicates": duplicates}

    def pieces() -> Iterator[bytes]:  # byte for byte orjson.dumps of the request
        yield b'{"rollouts":['
        for number, (record, is_large) in enumerate(zip(records, large, strict=True)):
            if number:
                yield b","
            if is_large:
                yield from encoded_pieces(record)
            else:
                yield orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY)
        yield b'],"duplicates":%d}' % duplicates

    return Chunked(pieces)


def _trace_item(error: TraceError, index: int | None = None) -> ErrorItem:
    return ErrorItem(field=error.field, reason=error.reason, rollout_id=error.rollout_id, index=index)


def _out_of_range(value: Any, path: str) -> str | None:
    """Path of the first integer in ``value`` outside int64 (the sink's integer width), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return path if not _INT64[0] <= value <= _INT64[1] else None
    if isinstance(value, Mapping):
        for key, item in value.items():
            found = _out_of_range(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _out_of_range(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _field_item(error: ValueError, default_field: str) -> ErrorItem:
    """An ErrorItem from the library's error: its ``field`` and ``reason`` (``default_field`` and the
    whole message for an error that names no field)."""
    if isinstance(error, StalenessError) and error.field:
        return ErrorItem(field=error.field, reason=error.reason)
    return ErrorItem(field=default_field, reason=str(error))


def _parse_sums(sums: Mapping[str, Any]) -> MismatchSums:
    """The posted sums, validated by the library; errors name the field under ``sums``."""
    path = _out_of_range(sums, "sums")
    if path is not None:
        raise RecordsInvalid([ErrorItem(field=path, reason="integer out of range")])
    try:
        parsed = MismatchSums.from_dict(sums)
    except ValueError as error:
        item = _field_item(error, "sums")
        if item.field != "sums":
            item = item.model_copy(update={"field": f"sums.{item.field}"})
        raise RecordsInvalid([item]) from None
    # A bucket without covered positions has nothing to sum: non-zero sums there are a client bug that
    # would skew the all-bucket k3.
    for i in np.flatnonzero(parsed.tokens == 0).tolist():
        for name in SUM_FIELDS:
            if getattr(parsed, name)[i] != 0:
                bucket = LAG_BUCKETS[i]
                raise RecordsInvalid(
                    [ErrorItem(field=f"sums.lags.{bucket}.{name}", reason="non-zero while tokens is 0")]
                )
    return parsed


def _lags_by_rollout(shipment: Shipment) -> list[list[list[int]]]:
    """``shipment.lags`` cut per shipped rollout and sample, aligned with the returned records."""
    flat, offsets = shipment.lags.tolist(), shipment.lag_offsets.tolist()
    out: list[list[list[int]]] = []
    sample = 0
    for rollout in shipment.rollouts:
        n = len(rollout.samples)
        out.append([flat[offsets[k] : offsets[k + 1]] for k in range(sample, sample + n)])
        sample += n
    return out


_MISMATCH_PREFIXES = (MISMATCH_KEY_PREFIX, BOUND_KEY_PREFIX)


@dataclass(frozen=True)
class _StepMismatch:
    """The posted sums of one step: how many posts, their total, and its keys and dict (made once)."""

    posts: int
    total: MismatchSums
    metrics: dict[str, MetricValue]
    sums: dict[str, Any]

    @classmethod
    def of(cls, posts: int, total: MismatchSums, metrics: dict[str, MetricValue]) -> _StepMismatch:
        return cls(posts, total, metrics, total.to_dict())

    def on(self, row: StepRow) -> StepRow:
        """``row`` with these keys in place of any SPEC 11 / SPEC 14 keys the ship computed, and the sums."""
        kept = {key: value for key, value in row.metrics.items() if not key.startswith(_MISMATCH_PREFIXES)}
        return row.model_copy(update={"metrics": {**kept, **self.metrics}, "mismatch": self.sums})


class Run:
    """One run of the service: a :class:`StalenessMonitor` and what exactly-once needs."""

    def __init__(self, name: str, config: StalenessConfig, exporters: RunExporters, store: Store | None = None) -> None:
        self.name = name
        self.config = config
        self._exporters = exporters
        self.monitor = StalenessMonitor(config, exporters.all, run=name)
        exporters.report_failures(self.monitor.export_errors)
        self._lock = threading.Lock()
        self._received: dict[str, bytes] = {}  # rollout id -> digest of the record
        self._duplicates = 0
        self._history: list[StepRow] = []
        self._answers: OrderedDict[str, tuple[tuple[Any, ...], ShipResult]] = OrderedDict()
        self._mismatch: dict[int, _StepMismatch] = {}  # posted trainer-side sums, per shipped step
        self._mismatch_answers: OrderedDict[str, tuple[tuple[Any, ...], MismatchResult]] = OrderedDict()
        self._closed = False
        # Persistence: every write that changed the run is one journal row (see .store).
        self._store = store or Store()
        self._seq = 0
        self._rows_since_snapshot = 0
        self._bytes_since_snapshot = 0
        self._restoring = False
        self._broken: BaseException | None = None
        # How each journalled operation is applied again at restart. A new write endpoint adds one entry
        # here and journals its validated request with ``self._journal(op, request)``.
        self._ops: dict[str, Callable[[Any], object]] = {
            "add": self._replay_add,
            "sweep": lambda request: self.sweep(int(request["step"])),
            "ship": lambda request: self.ship(ShipRequest.model_validate(request["request"]), request.get("key")),
            "mismatch": lambda request: self.record_mismatch(
                MismatchRequest.model_validate(request["request"]), request.get("key")
            ),
        }

    @property
    def registry(self) -> CollectorRegistry:
        """The Prometheus registry of this run's exporter."""
        return self._exporters.prometheus.registry

    @property
    def unavailable(self) -> str | None:
        """Why the run takes no requests (a write it could not persist), or None."""
        broken = self._broken
        return None if broken is None else f"run {self.name!r} could not persist a write ({broken})"

    def _check_open(self) -> None:
        if self._closed:
            raise RunNotFound(f"run {self.name!r} was deleted")
        if self._broken is not None:
            raise RunBroken(
                f"run {self.name!r} could not persist a write ({self._broken}); restart the service to reload it"
            )

    # ------------------------------------------------------------------ persistence
    def _journal(self, op: str, request: Any, history_row: Any | None = None) -> None:
        """Persist one write before it is answered (under the run's lock, so in the order applied)."""
        if self._restoring:
            return
        self._seq += 1
        try:
            written = self._store.append(self.name, self._seq, op, request, history_row)
        except Exception as exc:
            self._broken = exc
            raise RunBroken(f"run {self.name!r}: the write was applied but could not be persisted: {exc}") from exc
        if not self._store.persistent:
            return
        self._rows_since_snapshot += 1
        self._bytes_since_snapshot += written
        if self._rows_since_snapshot >= SNAPSHOT_EVERY or self._bytes_since_snapshot >= SNAPSHOT_BYTES:
            self._snapshot()

    def _snapshot(self) -> None:
        try:
            with arrays_left_as_numpy():  # the queue's arrays written by orjson, never as Python lists
                state = self.state_dict()
            self._store.save_snapshot(self.name, self._seq, state)
        except Exception:  # the journal still holds everything: a restart replays a longer tail
            logger.exception("run %s: snapshot failed", self.name)
            return
        self._rows_since_snapshot = self._bytes_since_snapshot = 0

    def state_dict(self) -> dict[str, Any]:
        """The run without its history rows (stored apart): monitor, received ids, idempotency answers."""
        return {
            "format": RUN_STATE_FORMAT,
            "seq": self._seq,
            "monitor": self.monitor.state_dict(),
            "received": {rid: digest.hex() for rid, digest in self._received.items()},
            "duplicates": self._duplicates,
            "answers": [
                [key, [fp[0], None if fp[1] is None else list(fp[1]), fp[2]], answer.model_dump(mode="json")]
                for key, (fp, answer) in self._answers.items()
            ],
            # Posted mismatch sums (SPEC 11) per step, and the answers to their idempotency keys.
            # The keys published with them too: SPEC 14's floor and window are of the moment they were posted.
            "mismatch": [[step, m.posts, m.sums, m.metrics] for step, m in self._mismatch.items()],
            "mismatch_answers": [
                [key, [fp[0], fp[1].hex()], answer.model_dump(mode="json")]
                for key, (fp, answer) in self._mismatch_answers.items()
            ],
        }

    def restore(self, stored: StoredRun) -> None:
        """Load the latest snapshot and re-apply the journal after it (ships are not exported again).

        Raises :class:`RestoreFailed` naming the stored row that could not be loaded or applied.
        """
        self._restoring = True
        try:
            if stored.snapshot is not None:
                try:
                    self._load_snapshot(stored.snapshot)
                except Exception as exc:
                    where = f"snapshot (taken at journal row {stored.snapshot_seq})"
                    raise RestoreFailed(f"run {self.name!r}: its {where} cannot be loaded: {_reason(exc)}") from exc
            try:
                self._history = [StepRow.model_validate(row) for row in stored.history]
            except Exception as exc:
                raise RestoreFailed(f"run {self.name!r}: a history row cannot be loaded: {_reason(exc)}") from exc
            self._seq = stored.snapshot_seq
            with self.monitor.absorbing():
                for row in stored.tail:
                    try:
                        self._ops[row.op](row.request)
                    except Exception as exc:
                        raise RestoreFailed(
                            f"run {self.name!r}: its journal row {row.seq} ({row.op}) cannot be applied again: "
                            f"{_reason(exc)}"
                        ) from exc
                    self._seq = row.seq
                    self._rows_since_snapshot += 1
        finally:
            self._restoring = False

    def _load_snapshot(self, state: Any) -> None:
        if state.get("format") != RUN_STATE_FORMAT:
            raise ValueError(f"unknown stored format {state.get('format')!r}")
        self.monitor.load_state_dict(state["monitor"])
        self._received = {rid: bytes.fromhex(digest) for rid, digest in state["received"].items()}
        self._duplicates = int(state["duplicates"])
        self._answers = OrderedDict(
            (key, ((fp[0], None if fp[1] is None else tuple(fp[1]), fp[2]), ShipResult.model_validate(answer)))
            for key, fp, answer in state["answers"]
        )
        self._mismatch = {}
        for step, posts, sums, *published in state.get("mismatch", []):
            total = MismatchSums.from_dict(sums)
            # A snapshot from before SPEC 14 kept no keys: the SPEC 11 ones, without a floor.
            metrics = dict(published[0]) if published else dict(total.metrics())
            self._mismatch[int(step)] = _StepMismatch.of(int(posts), total, metrics)
        self._mismatch_answers = OrderedDict(
            (key, ((int(fp[0]), bytes.fromhex(fp[1])), MismatchResult.model_validate(answer)))
            for key, fp, answer in state.get("mismatch_answers", [])
        )

    def _replay_add(self, request: Mapping[str, Any]) -> None:
        self.add(list(request["rollouts"]))
        with self._lock:
            self._duplicates += int(request.get("duplicates", 0))

    def events(self) -> Iterator[dict[str, Any]]:
        """The run's history as SPEC 9 events (``staleness-metrics replay`` reproduces its ships)."""
        if not self._store.persistent:
            raise NotPersisted("the service runs without a data directory (--in-memory): no history to export")
        for row in self._store.journal(self.name):
            if row.op == "add":
                for record in row.request["rollouts"]:
                    yield {"type": "rollout", "rollout": record}
            elif row.op == "sweep":
                yield {"type": "sweep", "step": row.request["step"]}
            elif row.op == "ship":
                ship: dict[str, Any] = {"type": "ship", "step": row.request["request"]["step"]}
                if row.request["request"].get("ids") is not None:
                    ship["ids"] = row.request["request"]["ids"]
                yield ship

    # ------------------------------------------------------------------ rollouts
    def add(self, records: list[dict[str, Any]]) -> AddResult:
        """Queue the records not received before; all or nothing in a strict run."""
        with self._lock:
            self._check_open()
            fresh: list[dict[str, Any]] = []
            fresh_index: dict[str, int] = {}
            digests: dict[str, bytes] = {}
            duplicates = 0
            conflicts: list[str] = []
            for index, record in enumerate(records):
                rid = record.get("id")
                if not isinstance(rid, str) or not rid:
                    reason = "required non-empty string (the service counts each rollout once by its id)"
                    raise RecordsInvalid(
                        [
                            ErrorItem(
                                field="id", reason=reason, rollout_id=None if rid is None else str(rid), index=index
                            )
                        ]
                    )
                digest = _stored_digest(record)
                if digest is None:  # refused before anything is applied: the journal could not write it
                    raise RecordsInvalid([self._unstorable_item(record, rid, index)])
                known = self._received.get(rid, digests.get(rid))
                if known is None:
                    fresh.append(record)
                    fresh_index[rid] = index
                    digests[rid] = digest
                elif known == digest:
                    duplicates += 1
                else:
                    conflicts.append(rid)
            if conflicts:
                raise RecordConflict(
                    "rollout ids received before with different content (ids are unique within a run): "
                    + ", ".join(repr(c) for c in conflicts[:10])
                    + (f" and {len(conflicts) - 10} more" if len(conflicts) > 10 else "")
                )
            sink = self.monitor.sink
            set_aside_before = len(sink.invalid)
            try:
                self.monitor.add(fresh)
            except TraceError as error:
                rid = error.rollout_id
                raise RecordsInvalid([_trace_item(error, fresh_index.get(rid) if rid else None)]) from None
            except OverflowError:
                raise RecordsInvalid([self._range_error(fresh, fresh_index)]) from None
            self._received.update(digests)
            self._duplicates += duplicates
            if fresh or duplicates:
                self._journal("add", _add_row(fresh, duplicates))
            invalid = [
                _trace_item(error, fresh_index.get(error.rollout_id) if error.rollout_id else None)
                for error in sink.invalid[set_aside_before:]
            ]
            return AddResult(
                run=self.name,
                accepted=len(fresh) - len(invalid),
                duplicates=duplicates,
                invalid=invalid,
                queued=sink.queued,
            )

    @staticmethod
    def _unstorable_item(record: Mapping[str, Any], rid: str, index: int) -> ErrorItem:
        field, reason = unstorable(record) or ("rollout", "cannot be stored")
        return ErrorItem(
            field=field,
            reason=f"{reason} (the run's journal could not store it)",
            rollout_id=printable_id(rid),
            index=index,
        )

    @staticmethod
    def _range_error(records: list[dict[str, Any]], index_of: Mapping[str, int]) -> ErrorItem:
        for record in records:
            path = _out_of_range(record, "")
            if path is not None:
                rid = str(record["id"])
                return ErrorItem(field=path, reason="integer out of range", rollout_id=rid, index=index_of.get(rid))
        return ErrorItem(field="rollouts", reason="a number is out of range")

    # ------------------------------------------------------------------ sweep and ship
    def _check_step(self, step: int) -> None:
        latest = self.monitor.sink.step
        if step < latest:
            raise StepConflict(f"step {step} is below the run's latest step {latest}: steps never decrease")

    def sweep(self, step: int) -> RunInfo:
        with self._lock:
            self._check_open()
            self._check_step(step)
            self.monitor.sweep(step)
            self._journal("sweep", {"step": step})
            return self._info()

    def ship(self, request: ShipRequest, idempotency_key: str | None = None) -> ShipResult:
        """Ship for ``request.step``; a repeated ``idempotency_key`` returns the first answer."""
        fingerprint = (request.step, None if request.ids is None else tuple(request.ids), request.include_rollouts)
        with self._lock:
            self._check_open()
            if idempotency_key is not None and idempotency_key in self._answers:
                first, answer = self._answers[idempotency_key]
                if first != fingerprint:
                    raise IdempotencyMismatch(
                        f"Idempotency-Key {idempotency_key!r} was used for a different ship of this run"
                    )
                return answer.model_copy(update={"replayed": True})
            self._check_step(request.step)
            try:
                shipment = self.monitor.ship(request.step, request.ids)
            except TraceError as error:  # strict run: a version above the trained one
                # The ship swept at its step before it refused: that much happened and is journalled.
                self._journal("sweep", {"step": request.step})
                raise RecordsInvalid([_trace_item(error)]) from None
            report = shipment.report
            number = len(self._history) + 1
            counts = counts_of(report.tally)
            metrics = dict(report.metrics)
            row = StepRow(
                ship=number,
                step=shipment.step,
                metrics=metrics,
                counts=counts,
                token_histogram=report.tally.token_histogram.tolist(),
                rollout_histogram=report.tally.rollout_histogram.tolist(),
            )
            self._history.append(row)
            answer = ShipResult(
                run=self.name,
                ship=number,
                step=shipment.step,
                shipped=shipment.ids,
                dropped_rollouts=list(shipment.dropped_rollouts),
                dropped_samples=list(shipment.dropped_samples),
                held=list(shipment.held),
                invalid=[_trace_item(error) for error in shipment.invalid],
                metrics=metrics,
                counts=counts,
                rollouts=[r.record() for r in shipment.rollouts] if request.include_rollouts else None,
                lags=_lags_by_rollout(shipment) if request.include_rollouts else None,
            )
            if idempotency_key is not None:
                self._answers[idempotency_key] = (fingerprint, answer)
                while len(self._answers) > IDEMPOTENCY_KEYS_KEPT:
                    self._answers.popitem(last=False)
            self._journal(
                "ship",
                {"request": request.model_dump(mode="json"), "key": idempotency_key},
                history_row=row.model_dump(mode="json"),
            )
            return answer

    # ------------------------------------------------------------------ mismatch sums
    def record_mismatch(self, request: MismatchRequest, idempotency_key: str | None = None) -> MismatchResult:
        """Merge trainer-side sums into ``request.step``'s total and publish it; all or nothing."""
        delta = _parse_sums(request.sums)
        if request.env is not None and (at := lone_surrogate(request.env)) is not None:
            raise RecordsInvalid([ErrorItem(field="env", reason=surrogate_reason(request.env, at))])
        fingerprint = (request.step, _digest({"env": request.env, "sums": delta.to_dict()}))
        with self._lock:
            self._check_open()
            if idempotency_key is not None and idempotency_key in self._mismatch_answers:
                first, answer = self._mismatch_answers[idempotency_key]
                if first != fingerprint:
                    raise IdempotencyMismatch(
                        f"Idempotency-Key {idempotency_key!r} was used for different mismatch sums of this run"
                    )
                return answer.model_copy(update={"replayed": True})
            known = self._mismatch.get(request.step)
            posts = known.posts if known is not None else 0
            with np.errstate(over="ignore"):  # checked just below, and refused
                total = (known.total if known is not None else MismatchSums.zero()) + delta
            if not all(np.isfinite(getattr(total, name)).all() for name in SUM_FIELDS):
                raise RecordsInvalid([ErrorItem(field="sums", reason="the step's merged sums overflow a float64")])
            try:
                self.monitor.record_mismatch(request.step, delta, env=request.env)
            except ValueError as error:  # a step never shipped: "step: ..."
                raise RecordsInvalid([_field_item(error, "step")]) from None
            metrics = self.monitor.mismatch_metrics(request.step) or {}
            merged = self._mismatch[request.step] = _StepMismatch.of(posts + 1, total, metrics)
            answer = MismatchResult(
                run=self.name, step=request.step, posts=merged.posts, tokens=total.covered, metrics=merged.metrics
            )
            if idempotency_key is not None:
                self._mismatch_answers[idempotency_key] = (fingerprint, answer)
                while len(self._mismatch_answers) > IDEMPOTENCY_KEYS_KEPT:
                    self._mismatch_answers.popitem(last=False)
            self._journal("mismatch", {"request": request.model_dump(mode="json"), "key": idempotency_key})
            return answer

    # ------------------------------------------------------------------ reads
    def steps(self, since: int = 0) -> list[StepRow]:
        """The metrics history: every ship with ``step > since``, oldest first.

        The last ship of a step with posted mismatch sums carries their merged total: its SPEC 11 keys in
        ``metrics`` (replacing any the ship computed from records) and the sums in ``mismatch``.
        """
        with self._lock:
            self._check_open()
            rows = [row for row in self._history if row.step > since]
            last_of_step = {row.step: i for i, row in enumerate(rows)}
            for step, i in last_of_step.items():
                if step in self._mismatch:
                    rows[i] = self._mismatch[step].on(rows[i])
            return rows

    def info(self) -> RunInfo:
        with self._lock:
            self._check_open()
            return self._info()

    def _info(self) -> RunInfo:
        sink = self.monitor.sink
        return RunInfo(
            run=self.name,
            config=asdict(self.config),
            step=sink.step,
            ships=len(self._history),
            queued=sink.queued,
            rollouts_received=len(self._received),
            duplicates_ignored=self._duplicates,
            totals=counts_of(sink.totals),
        )

    def checkpoint(self) -> None:
        """Snapshot now if anything was journalled since the last one (a clean shutdown restarts faster)."""
        with self._lock:
            if self._store.persistent and self._rows_since_snapshot and not self._closed and self._broken is None:
                self._snapshot()

    def close(self) -> None:
        """Flush and close the run's exporters; later requests to it get :class:`RunNotFound`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.monitor.close()  # the exporters flush, and finish a W&B run of their own


class RunRegistry:
    """The runs of one service, by name.

    Stored runs are checked at start (:meth:`restore`: every row's checksum, every journal's sequence) and
    then loaded in the background, so that a restart serves at once: a request for a run not loaded yet
    loads it first. A run whose stored rows cannot be applied again is *unavailable*: its requests get
    503 with the reason, and ``/healthz`` names it.
    """

    def __init__(self, export_settings: ExportSettings | None = None, store: Store | None = None) -> None:
        self.export_settings = export_settings or ExportSettings()
        preload(self.export_settings)
        self.store = store or Store()
        self._runs: dict[str, Run] = {}
        self._pending: dict[str, tuple[StalenessConfig, StoredRun]] = {}  # checked, not loaded yet
        self._failed: dict[str, str] = {}  # runs whose stored rows could not be applied: why
        self._lock = threading.Lock()  # guards the dicts
        self._creating = threading.Lock()  # one creation or deletion at a time (exporters start slowly)
        self._loading = threading.Lock()  # one run loaded at a time (by the background thread or a request)
        self._loader: threading.Thread | None = None

    def create(self, name: str, config: StalenessConfig) -> tuple[Run, bool]:
        """The run ``name``, created with ``config`` (True) or already there with the same config (False).

        Raises :class:`RunConflict` when it exists with another configuration.
        """
        with self._creating:
            existing = self._find(name)
            if existing is not None:
                if existing.config != config:
                    raise RunConflict(
                        f"run {name!r} exists with another configuration ({asdict(existing.config)}); "
                        "delete it first or pick another name"
                    )
                return existing, False
            self.store.create_run(name, asdict(config))  # persisted before the 201
            run = Run(name, config, build_exporters(name, self.export_settings), self.store)
            with self._lock:
                self._runs[name] = run
            return run, True

    def restore(self, background: bool = True, defer: bool = False) -> int:
        """Check every stored run (at start-up, before serving) and load them; returns how many.

        Stored data that fails its checks refuses the start (the store's error names the run and the row):
        a run silently left out would look deleted, and its clients would start it again from nothing.
        The runs are then loaded on a background thread (``background``) or here; with ``defer``, by
        :meth:`load_in_background` (the service calls it once it listens: loading before would share
        the interpreter with the start and delay it) or on demand, by the first request for each.
        """
        stored_runs = self.store.load()
        pending: dict[str, tuple[StalenessConfig, StoredRun]] = {}
        for stored in stored_runs:
            try:
                config = StalenessConfig(**stored.config)
            except Exception as exc:
                what = f"run {stored.name!r}: its configuration cannot be loaded: {_reason(exc)}"
                raise self.store.damaged(what) from None
            pending[stored.name] = (config, stored)
        with self._lock:
            self._pending.update(pending)
        if defer:
            return len(stored_runs)
        if background:
            self.load_in_background()
        else:
            self._load_pending()
        return len(stored_runs)

    def load_in_background(self) -> None:
        """Load the stored runs not loaded yet on a daemon thread (once)."""
        with self._lock:
            if self._loader is not None or not self._pending:
                return
            self._loader = threading.Thread(target=self._load_pending, name="staleness-restore", daemon=True)
        self._loader.start()

    def _load_pending(self) -> None:
        while True:
            with self._lock:
                name = next(iter(self._pending), None)
            if name is None:
                return
            self._load(name)

    def _load(self, name: str) -> Run | None:
        """Load the pending run ``name`` (None when it is not pending, or could not be loaded)."""
        with self._loading:
            with self._lock:
                loaded = self._runs.get(name)
                entry = self._pending.get(name)
            if loaded is not None or entry is None:
                return loaded
            config, stored = entry
            run = Run(name, config, build_exporters(name, self.export_settings), self.store)
            try:
                run.restore(stored)
            except RestoreFailed as exc:
                run.close()
                reason = (
                    f"{exc}. The run is unavailable: restore the data directory from a backup and restart, "
                    f"or DELETE /v1/runs/{name} to drop it"
                )
                logger.error("%s", reason)
                with self._lock:
                    del self._pending[name]
                    self._failed[name] = reason
                return None
            with self._lock:
                del self._pending[name]
                self._runs[name] = run
            return run

    def loaded(self, timeout: float | None = None) -> bool:
        """Wait until every stored run is loaded (or found unavailable); False when ``timeout`` passed."""
        loader = self._loader
        if loader is not None:
            loader.join(timeout)
            return not loader.is_alive()
        with self._lock:
            return not self._pending  # deferred and not started: nothing loads them until asked

    def _find(self, name: str) -> Run | None:
        with self._lock:
            run = self._runs.get(name)
            if run is not None:
                return run
            failed = self._failed.get(name)
            pending = name in self._pending
        if failed is not None:
            raise RunBroken(failed)
        return self._load(name) if pending else None

    def get(self, name: str) -> Run:
        run = self._find(name)
        if run is None:
            raise RunNotFound(f"no run {name!r}: create it first with PUT /v1/runs/{name}")
        return run

    def unavailable(self) -> dict[str, str]:
        """The runs that take no requests, and why (a store that failed a write, or rows that failed to load)."""
        with self._lock:
            runs = list(self._runs.values())
            out = dict(self._failed)
        for run in runs:
            reason = run.unavailable
            if reason is not None:
                out[run.name] = reason
        return out

    def loading(self) -> bool:
        """True while stored runs wait to be loaded (after a restart)."""
        with self._lock:
            return bool(self._pending)

    def unavailable_once_loaded(self, timeout: float) -> dict[str, str]:
        """:meth:`unavailable` once every stored run is loaded or found unavailable, waiting up to
        ``timeout`` seconds (loading them now if nothing did yet); runs still loading then are named too."""
        self.load_in_background()
        self.loaded(timeout)
        out = self.unavailable()
        with self._lock:
            pending = list(self._pending)
        for name in pending:
            out.setdefault(name, f"run {name!r} is still loading after the restart")
        return out

    def count(self) -> int:
        """How many runs the service holds (loaded or not yet), without waiting for any."""
        with self._lock:
            return len(self._runs) + len(self._pending)

    def delete(self, name: str) -> None:
        with self._creating:
            with self._lock:
                failed = self._failed.pop(name, None)
            if failed is not None:  # an unavailable run can still be deleted (and its name used again)
                self.store.delete_run(name)
                return
            run = self.get(name)
            self.store.delete_run(name)
            with self._lock:
                del self._runs[name]
        run.close()

    def runs(self) -> list[Run]:
        """Every available run (loading the ones not loaded yet)."""
        self._load_pending()
        with self._lock:
            return list(self._runs.values())

    def registries(self) -> Iterable[CollectorRegistry]:
        return [run.registry for run in self.runs()]

    def close(self) -> None:
        """Close every run (service shutdown): their exporters flush."""
        with self._creating, self._loading, self._lock:
            runs = list(self._runs.values())
            self._runs.clear()
            self._pending.clear()  # not loaded: nothing of theirs to flush
        for run in runs:
            run.checkpoint()
        # In parallel: each run's exporters may wait up to their close timeout for a receiver.
        with ThreadPoolExecutor(max_workers=min(32, len(runs) or 1), thread_name_prefix="staleness-close") as pool:
            for _ in pool.map(Run.close, runs):
                pass
        self.store.close()
