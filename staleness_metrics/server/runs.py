"""The service's runs: one monitor per run, exactly-once accounting (rollouts by digest, ships and
mismatch posts by idempotency key) and a journal of every write (see docs/service.md)."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import sqlite3
import threading
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import orjson
from pydantic import BaseModel

from ..config import StalenessConfig
from ..engine.shipment import Shipment
from ..errors import TraceError
from ..exporters.base import Exporter
from ..metrics.metric_table import BOUND_KEY_PREFIX, MISMATCH_KEY_PREFIX
from ..metrics.mismatch import MismatchSums
from ..metrics.report import MetricValue
from ..monitor import MISMATCH_STEPS_KEPT, StalenessMonitor
from ..records.validation import lone_surrogate, printable_id, surrogate_reason, unstorable
from ..state_checks import PIECE_ITEMS, arrays_left_as_numpy, json_pieces
from .models import (
    AddResult,
    ErrorItem,
    MismatchRequest,
    MismatchResult,
    RecordsInvalid,
    RestoreFailed,
    RunBroken,
    RunConflict,
    RunInfo,
    RunNotFound,
    ShipRequest,
    ShipResult,
    StepRow,
    counts_of,
    field_item,
    out_of_range,
    reason_of,
    trace_item,
)
from .store import SNAPSHOT_BYTES, SNAPSHOT_EVERY, Chunked, Store, StoredRun, quoted

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..exporters.prometheus import PrometheusExporter

logger = logging.getLogger("staleness_metrics.server")

RUN_STATE_FORMAT = 1
# a run whose queue holds at most this much ships in a few milliseconds
QUICK_MAX_ROLLOUTS = 512
QUICK_MAX_POSITIONS = 65_536
CHUNKED_ADD_RECORDS = 256  # an add of more records than this is journalled a record at a time
IDEMPOTENCY_KEYS_KEPT = 1024
_DIGEST_OPTIONS = orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY


def holds_large_array(record: Mapping[str, Any]) -> bool:
    """True when a sample holds an array to hash and journal a piece at a time."""
    samples = record.get("samples")
    return isinstance(samples, list) and any(
        isinstance(value, np.ndarray) and value.size > PIECE_ITEMS
        for sample in samples
        if isinstance(sample, dict)
        for value in sample.values()
    )


def _canonical_digest(record: Mapping[str, Any], option: int) -> bytes:
    if not holds_large_array(record):
        return hashlib.blake2b(orjson.dumps(record, option=option), digest_size=16).digest()
    digest = hashlib.blake2b(digest_size=16)
    for piece in json_pieces(dict(record), option):
        digest.update(piece)
    return digest.digest()


def record_digest(record: Mapping[str, Any]) -> bytes:
    """The digest of a record's canonical JSON: the same content, the same digest."""
    # orjson writes bytes; json.dumps would first build a string per list item (per position).
    try:
        return _canonical_digest(record, _DIGEST_OPTIONS)
    except orjson.JSONEncodeError:  # an integer beyond 64 bits: rejected later, with its path
        canonical = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(canonical, digest_size=16).digest()


def stored_digest(record: Mapping[str, Any]) -> bytes | tuple[str, str]:
    """:func:`record_digest` of a record the journal can store, else ``(field, reason)`` why not."""
    try:
        return _canonical_digest(record, _DIGEST_OPTIONS | orjson.OPT_STRICT_INTEGER)
    except orjson.JSONEncodeError:
        # integers past 2**53 but within 64 bits: stored exactly all the same
        return unstorable(record) or record_digest(record)


A = TypeVar("A", bound=BaseModel)


class Answers(Generic[A]):
    """The newest answers of one endpoint by idempotency key, with its request's fingerprint."""

    def __init__(self, different: str, answer: type[A]) -> None:
        self.different = different
        self._answer = answer
        self._answers: OrderedDict[str, tuple[list[Any], A]] = OrderedDict()

    def replay(self, key: str | None, fingerprint: list[Any]) -> A | None:
        """The first answer to ``key``, None for a new key; 422 for another request."""
        if key is None or key not in self._answers:
            return None
        first, answer = self._answers[key]
        if first != fingerprint:
            reason = f"Idempotency-Key {key!r} was used for {self.different} of this run"
            raise RecordsInvalid([ErrorItem(field="Idempotency-Key", reason=reason)])
        return answer.model_copy(update={"replayed": True})

    def remember(self, key: str | None, fingerprint: list[Any], answer: A) -> None:
        if key is not None:
            self._answers[key] = (fingerprint, answer)
        while len(self._answers) > IDEMPOTENCY_KEYS_KEPT:
            self._answers.popitem(last=False)

    def to_json(self) -> list[list[Any]]:
        """``[[key, fingerprint, answer], ...]``, oldest first."""
        return [[key, fp, ans.model_dump(mode="json")] for key, (fp, ans) in self._answers.items()]

    def load_json(self, items: Any) -> None:
        answers = ((key, (list(fp), self._answer.model_validate(ans))) for key, fp, ans in items)
        self._answers = OrderedDict(answers)


def add_row(records: list[dict[str, Any]], duplicates: int) -> Any:
    """The journal request of an add: a value, or the pieces of its text."""
    large = [holds_large_array(record) for record in records]
    if len(records) <= CHUNKED_ADD_RECORDS and not any(large):
        return {"rollouts": records, "duplicates": duplicates}

    def pieces() -> Iterator[bytes]:  # byte for byte orjson.dumps of the request
        yield b'{"rollouts":['
        for number, (record, is_large) in enumerate(zip(records, large, strict=True)):
            if number:
                yield b","
            if is_large:
                yield from json_pieces(record, orjson.OPT_SERIALIZE_NUMPY)
            else:
                yield orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY)
        yield b'],"duplicates":%d}' % duplicates

    return Chunked(pieces)


class Journal:
    """A run's rows in ``store``, in order, and its snapshots; ``broken``: a write not persisted."""

    def __init__(self, run: str, store: Store, state: Callable[[], dict[str, Any]]) -> None:
        self.run = run
        self.store = store
        self._state = state
        self.seq = 0
        self.rows_since_snapshot = self.bytes_since_snapshot = 0
        self.restoring = False  # rows applied again are not written again
        self.broken: BaseException | None = None

    def write(self, op: str, request: Any, history: list[tuple[int, Any]] | None = None) -> None:
        """Persist one write (and ``history``: ships' rows by their seq) before it is answered."""
        if self.restoring:
            return
        self.seq += 1
        try:
            written = self.store.append(self.run, self.seq, op, request, history)
        except Exception as exc:
            self.broken = exc
            raise RunBroken(f"run {self.run!r}: the write was applied but could not be persisted: {exc}") from exc
        if not self.store.persistent:
            return
        self.rows_since_snapshot += 1
        self.bytes_since_snapshot += written
        if self.rows_since_snapshot >= SNAPSHOT_EVERY or self.bytes_since_snapshot >= SNAPSHOT_BYTES:
            self.snapshot()

    def snapshot(self) -> None:
        try:
            with arrays_left_as_numpy():  # written by orjson, never as Python lists
                state = self._state()
            self.store.save_snapshot(self.run, self.seq, state)
        except Exception as exc:  # the journal holds everything: a restart replays a longer tail
            trace = not isinstance(exc, OSError | sqlite3.Error)  # a full disk: one line
            logger.error("run %s: snapshot failed (%s)", self.run, reason_of(exc), exc_info=trace)
            return
        self.rows_since_snapshot = self.bytes_since_snapshot = 0


def _positions_of(records: list[dict[str, Any]]) -> int:
    total = 0
    for record in records:
        samples = record.get("samples")
        for sample in samples if isinstance(samples, list) else ():  # (lenient: bad ones set aside)
            mask = sample.get("mask") if isinstance(sample, dict) else None
            if isinstance(mask, (list, np.ndarray)):
                total += len(mask)
    return total


def _parse_sums(sums: Mapping[str, Any]) -> MismatchSums:
    """The posted sums, validated by the library (errors name the field under ``sums``)."""
    if (path := out_of_range(sums, "sums")) is not None:
        raise RecordsInvalid([ErrorItem(field=path, reason="integer out of range")])
    try:
        return MismatchSums.from_dict(sums)
    except ValueError as error:
        item = field_item(error, "sums")
        if item.field != "sums":
            item = item.model_copy(update={"field": f"sums.{item.field}"})
        raise RecordsInvalid([item]) from None


def _lags_by_rollout(shipment: Shipment) -> list[list[list[int]]]:
    """``shipment.lags`` cut per shipped rollout and sample."""
    flat, offsets = shipment.lags.tolist(), shipment.lag_offsets.tolist()
    samples = iter([flat[start:end] for start, end in itertools.pairwise(offsets)])
    return [list(itertools.islice(samples, len(rollout.samples))) for rollout in shipment.rollouts]


@dataclass
class RunExporters:
    """The exporters of one run; ``failures``: the ones that could not start."""

    prometheus: PrometheusExporter
    others: list[Exporter] = field(default_factory=list)
    failures: list[tuple[str, str, BaseException]] = field(default_factory=list)


@dataclass(frozen=True)
class _StepMismatch:
    """The posted sums of one step: how many posts, their total and its keys."""

    posts: int
    total: MismatchSums
    metrics: dict[str, MetricValue]

    def on(self, row: StepRow) -> StepRow:
        """``row`` with these keys and sums in place of the SPEC 11 / 14 keys the ship computed."""
        prefixes = (MISMATCH_KEY_PREFIX, BOUND_KEY_PREFIX)
        kept = {k: v for k, v in row.metrics.items() if not k.startswith(prefixes)}
        merged = {"metrics": {**kept, **self.metrics}, "mismatch": self.total.to_dict()}
        return row.model_copy(update=merged)


class Run:
    """One run of the service: a :class:`StalenessMonitor` and what exactly-once needs."""

    def __init__(self, name: str, config: StalenessConfig, exporters: RunExporters, store: Store | None = None) -> None:
        self.name = name
        self.config = config
        self.registry: CollectorRegistry = exporters.prometheus.registry  # its series for /metrics
        self.monitor = StalenessMonitor(config, [exporters.prometheus, *exporters.others], run=name)
        for exporter, message, exc in exporters.failures:  # reported as the exporters' own errors
            self.monitor.export_errors.register(exporter)
            self.monitor.export_errors.record(exporter, message, exc)
        self._lock = threading.RLock()  # re-entered by the calls made under Run.quick
        self._positions_bound = 0  # added since the queue was last empty: at least what it holds
        self._received: dict[str, bytes] = {}  # rollout id -> digest of the record
        self._duplicates = 0
        self._history: list[StepRow | Any] = []  # as stored until read (a restart validates none)
        self._history_seqs: list[int] = []  # each ship's journal row: its history row's key
        self._damaged: str | None = None  # why a stored history row did not load
        self._answers = Answers("a different ship", ShipResult)
        self._mismatch: dict[int, _StepMismatch] = {}  # the newest steps' sums (older: history)
        self._mismatch_answers = Answers("different mismatch sums", MismatchResult)
        self._closed = False
        self._store = store or Store()
        self._journal = Journal(name, self._store, self.state_dict)
        # how each journalled operation is applied again at restart
        self._ops: dict[str, Callable[[Any], object]] = {
            "add": self._replay_add,
            "sweep": lambda request: self.sweep(int(request["step"])),
            "ship": lambda request: self.ship(ShipRequest.model_validate(request["request"]), request.get("key")),
            "mismatch": lambda request: self.record_mismatch(
                MismatchRequest.model_validate(request["request"]), request.get("key")
            ),
        }

    @property
    def unavailable(self) -> str | None:
        """Why the run takes no requests (a write not persisted, a bad history row), or None."""
        if (broken := self._journal.broken) is not None:
            return f"run {self.name!r} could not persist a write ({broken})"
        return self._damaged

    def _check_open(self) -> None:
        if self._closed:
            raise RunNotFound(f"run {self.name!r} was deleted")
        if self.unavailable is not None:
            raise RunBroken(f"{self.unavailable}; restart the service to reload it")

    @contextmanager
    def quick(self) -> Iterator[bool]:
        """True, holding the run's lock, when it was free at once and the queue is small."""
        if not self._lock.acquire(blocking=False):
            yield False
            return
        try:
            yield (self._positions_bound <= QUICK_MAX_POSITIONS and self.monitor.sink.queued <= QUICK_MAX_ROLLOUTS)
        finally:
            self._lock.release()

    def state_dict(self) -> dict[str, Any]:
        """The run without its history rows (stored apart)."""
        mismatch = self._mismatch.items()
        return {
            "format": RUN_STATE_FORMAT,
            "seq": self._journal.seq,
            "monitor": self.monitor.state_dict(),
            "received": {rid: digest.hex() for rid, digest in self._received.items()},
            "duplicates": self._duplicates,
            "answers": self._answers.to_json(),
            # with the keys published then: SPEC 14's floor and window are of that moment
            "mismatch": [[step, m.posts, m.total.to_dict(), m.metrics] for step, m in mismatch],
            "mismatch_answers": self._mismatch_answers.to_json(),
        }

    def restore(self, stored: StoredRun) -> None:
        """Load the latest snapshot and apply the journal after it again (ships not exported)."""
        self._journal.restoring = True
        try:
            if stored.snapshot is not None:
                where = f"its snapshot (taken at journal row {stored.snapshot_seq})"
                with self._restoring(f"{where} cannot be loaded"):
                    self._load_snapshot(stored.snapshot)
            self._history_seqs, self._history = list(stored.history), list(stored.history.values())
            self._journal.seq = stored.snapshot_seq
            with self.monitor.absorbing():
                for row in stored.tail:
                    self._journal.seq = row.seq  # (a ship's own, for its history row)
                    failed = f"its journal row {row.seq} ({row.op}) cannot be applied again"
                    with self._restoring(failed):
                        self._ops[row.op](row.request)
                    self._journal.rows_since_snapshot += 1
        finally:
            self._journal.restoring = False

    @contextmanager
    def _restoring(self, what: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            raise RestoreFailed(f"run {self.name!r}: {what}: {reason_of(exc)}") from exc

    def _load_snapshot(self, state: Any) -> None:
        if state.get("format") != RUN_STATE_FORMAT:
            raise ValueError(f"unknown stored format {state.get('format')!r}")
        self.monitor.load_state_dict(state["monitor"])
        # The snapshot does not say how many positions its queue holds: none, or too many to tell.
        self._positions_bound = 0 if self.monitor.sink.queued == 0 else QUICK_MAX_POSITIONS + 1
        self._received = {rid: bytes.fromhex(digest) for rid, digest in state["received"].items()}
        self._duplicates = int(state["duplicates"])
        self._answers.load_json(state["answers"])
        for step, posts, sums, *published in state.get("mismatch", []):
            total = MismatchSums.from_dict(sums)
            # A snapshot from before SPEC 14 kept no keys: the SPEC 11 ones, without a floor.
            metrics = dict(published[0]) if published else dict(total.metrics())
            self._mismatch[int(step)] = _StepMismatch(int(posts), total, metrics)
        self._mismatch_answers.load_json(state.get("mismatch_answers", []))

    def _replay_add(self, request: Mapping[str, Any]) -> None:
        self.add(list(request["rollouts"]))
        with self._lock:
            self._duplicates += int(request.get("duplicates", 0))

    def events(self) -> Iterator[dict[str, Any]]:
        """The run's history as SPEC 9 events (its replay reproduces the ships)."""
        if not self._store.persistent:
            raise RunConflict("the service runs without a data directory (--in-memory): no history to export")
        for row in self._store.journal(self.name):
            if row.op == "add":
                for record in row.request["rollouts"]:
                    yield {"type": "rollout", "rollout": record}
            elif row.op == "sweep":
                yield {"type": "sweep", "step": row.request["step"]}
            elif row.op == "ship":
                request = row.request["request"]
                ids = {} if request.get("ids") is None else {"ids": request["ids"]}
                yield {"type": "ship", "step": request["step"], **ids}

    def add(self, records: list[dict[str, Any]]) -> AddResult:
        """Queue the records not received before; all or nothing in a strict run."""
        with self._lock:
            self._check_open()
            fresh: list[dict[str, Any]] = []
            fresh_index: dict[str | None, int] = {}  # (an error naming no rollout finds no index)
            digests: dict[str, bytes] = {}
            duplicates = 0
            conflicts: list[str] = []
            for index, record in enumerate(records):
                rid = record.get("id")
                if not isinstance(rid, str) or not rid:
                    reason = "required non-empty string (the service counts each rollout once by its id)"
                    shown = None if rid is None else str(rid)
                    item = ErrorItem(field="id", reason=reason, rollout_id=shown, index=index)
                    raise RecordsInvalid([item])
                digest = stored_digest(record)
                if isinstance(digest, tuple):  # the journal could not write it
                    field, reason = digest
                    reason += " (the run's journal could not store it)"
                    shown = printable_id(rid)
                    item = ErrorItem(field=field, reason=reason, rollout_id=shown, index=index)
                    raise RecordsInvalid([item])
                if (known := self._received.get(rid, digests.get(rid))) is None:
                    fresh.append(record)
                    fresh_index[rid] = index
                    digests[rid] = digest
                elif known == digest:
                    duplicates += 1
                else:
                    conflicts.append(rid)
            if conflicts:
                what = "rollout ids received before with different content"
                raise RunConflict(f"{what} (ids are unique within a run): {quoted(conflicts, 10)}")
            sink, positions = self.monitor.sink, _positions_of(fresh)
            set_aside_before = len(sink.invalid)
            try:
                self.monitor.add(fresh)
            except TraceError as error:
                rid = error.rollout_id
                raise RecordsInvalid([trace_item(error, fresh_index.get(rid))]) from None
            except OverflowError:
                raise RecordsInvalid([self._range_error(fresh, fresh_index)]) from None
            self._received.update(digests)
            self._duplicates += duplicates
            self._positions_bound += positions
            if fresh or duplicates:
                self._journal.write("add", add_row(fresh, duplicates))
            set_aside = sink.invalid[set_aside_before:]
            invalid = [trace_item(error, fresh_index.get(error.rollout_id)) for error in set_aside]
            return AddResult(
                run=self.name,
                accepted=len(fresh) - len(invalid),
                duplicates=duplicates,
                invalid=invalid,
                queued=sink.queued,
            )

    @staticmethod
    def _range_error(records: list[dict[str, Any]], index_of: dict[str | None, int]) -> ErrorItem:
        for record in records:
            if (path := out_of_range(record, "")) is not None:
                rid = str(record["id"])
                index = index_of.get(rid)
                return ErrorItem(field=path, reason="integer out of range", rollout_id=rid, index=index)
        return ErrorItem(field="rollouts", reason="a number is out of range")

    def _check_step(self, step: int) -> None:
        if step < (latest := self.monitor.sink.step):
            raise RunConflict(f"step {step} is below the run's latest step {latest}: steps never decrease")

    def sweep(self, step: int) -> RunInfo:
        with self._lock:
            self._check_open()
            self._check_step(step)
            self.monitor.sweep(step)
            if self.monitor.sink.queued == 0:
                self._positions_bound = 0
            self._journal.write("sweep", {"step": step})
            return self.info()

    def ship(self, request: ShipRequest, idempotency_key: str | None = None) -> ShipResult:
        """Ship for ``request.step``; a repeated ``idempotency_key`` returns the first answer."""
        fingerprint = [request.step, request.ids, request.include_rollouts]
        with self._lock:
            self._check_open()
            if (replayed := self._answers.replay(idempotency_key, fingerprint)) is not None:
                return replayed
            self._check_step(request.step)
            try:
                shipment = self.monitor.ship(request.step, request.ids)
            except TraceError as error:  # strict run: a version above the trained one
                # the ship swept at its step before it refused: that is journalled
                self._journal.write("sweep", {"step": request.step})
                raise RecordsInvalid([trace_item(error)]) from None
            if self.monitor.sink.queued == 0:
                self._positions_bound = 0
            report, number = shipment.report, len(self._history) + 1
            counts, metrics = counts_of(report.tally), dict(report.metrics)
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
                invalid=[trace_item(error) for error in shipment.invalid],
                metrics=metrics,
                counts=counts,
                rollouts=[r.record() for r in shipment.rollouts] if request.include_rollouts else None,
                lags=_lags_by_rollout(shipment) if request.include_rollouts else None,
            )
            self._answers.remember(idempotency_key, fingerprint, answer)
            stored = self._store.persistent  # the rows are only built for a store that keeps them
            self._journal.write(
                "ship",
                {"request": request.model_dump(mode="json"), "key": idempotency_key} if stored else None,
                [(self._journal.seq + 1, row.model_dump(mode="json"))] if stored else None,
            )
            self._history_seqs.append(self._journal.seq)
            return answer

    def record_mismatch(self, request: MismatchRequest, idempotency_key: str | None = None) -> MismatchResult:
        """Merge trainer-side sums into ``request.step``'s total and publish it; all or nothing."""
        delta = _parse_sums(request.sums)
        if request.env is not None and (at := lone_surrogate(request.env)) is not None:
            raise RecordsInvalid([ErrorItem(field="env", reason=surrogate_reason(request.env, at))])
        digest = record_digest({"env": request.env, "sums": delta.to_dict()})
        fingerprint = [request.step, digest.hex()]
        with self._lock:
            self._check_open()
            replayed = self._mismatch_answers.replay(idempotency_key, fingerprint)
            if replayed is not None:
                return replayed
            known = self._mismatch.get(request.step) or _StepMismatch(0, MismatchSums.zero(), {})
            try:
                total = known.total.merged(delta)
                self.monitor.record_mismatch(request.step, delta, env=request.env)
            except ValueError as error:  # sums that overflow ("sums: ..."), a step never shipped
                raise RecordsInvalid([field_item(error, "step")]) from None
            # the monitor's keys are of this post's env (and the batch): the step's other envs' stay
            metrics = {**known.metrics, **(self.monitor.mismatch_metrics(request.step) or {})}
            merged = self._mismatch[request.step] = _StepMismatch(known.posts + 1, total, metrics)
            # kept for the newest steps, as by the monitor (a late post for an older: from 0)
            folded = []
            while len(self._mismatch) > MISMATCH_STEPS_KEPT:
                if (oldest := min(self._mismatch)) != request.step:
                    folded.append(self._fold(oldest, self._mismatch[oldest]))
                del self._mismatch[oldest]
            answer = MismatchResult(
                run=self.name, step=request.step, posts=merged.posts, tokens=total.covered, metrics=merged.metrics
            )
            self._mismatch_answers.remember(idempotency_key, fingerprint, answer)
            stored = {"step": request.step, "sums": delta.to_dict(), "env": request.env}
            self._journal.write("mismatch", {"request": stored, "key": idempotency_key}, folded)
            return answer

    def _row(self, index: int) -> StepRow:
        """The history row of ship ``index + 1``, validated when first read after a restart."""
        if not isinstance(row := self._history[index], StepRow):
            try:
                row = self._history[index] = StepRow.model_validate(row)
            except Exception as exc:  # (its bytes passed their checksum at the start)
                self._damaged = f"run {self.name!r}: its history row of ship {index + 1} cannot be "
                self._damaged += f"loaded: {reason_of(exc)}; restore the directory from a backup"
                raise RunBroken(self._damaged) from None
        return row

    def _after(self, step: int) -> int:
        """The index of the first ship of a step after ``step`` (steps never decrease)."""
        return bisect_right(range(len(self._history)), step, key=lambda i: self._row(i).step)

    def _fold(self, step: int, posted: _StepMismatch) -> tuple[int, Any]:
        """Put ``posted`` into the last history row of ``step``: ``(its seq, the row)`` to store."""
        index = self._after(step) - 1
        row = self._history[index] = posted.on(self._row(index))
        return self._history_seqs[index], row.model_dump(mode="json")

    def steps(self, since: int = 0) -> list[StepRow]:
        """Every ship with ``step > since``; the last of a step carries its posted mismatch sums."""
        with self._lock:
            self._check_open()
            rows = [self._row(index) for index in range(self._after(since), len(self._history))]
            for step, i in {row.step: i for i, row in enumerate(rows)}.items():  # each step's last
                if (posted := self._mismatch.get(step)) is not None:
                    rows[i] = posted.on(rows[i])
            return rows

    def info(self) -> RunInfo:
        with self._lock:
            self._check_open()
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
        """Snapshot now if anything was journalled since the last one (a faster restart)."""
        with self._lock:
            journal = self._journal  # rows are counted only in a persistent store
            if journal.rows_since_snapshot and journal.broken is None and not self._closed:
                journal.snapshot()

    def refuse_writes(self, refuse: bool = True) -> None:
        """Later requests get :class:`RunNotFound`; a write in progress ends first (its lock)."""
        with self._lock:
            self._closed = refuse

    def close(self) -> None:
        """Refuse later requests, then flush and close the run's exporters (once)."""
        self.refuse_writes()
        self.monitor.close()  # the exporters flush, and finish a W&B run of their own
