"""The train sink of an async orchestrator (SPEC 4): queue, sweep, ship.

Rollouts enter with :meth:`Sink.add`, are judged by the policy at :meth:`Sink.sweep` and
:meth:`Sink.ship`, and leave as shipped, dropped or (lenient mode) invalid. The sink keeps three
growable tables (rollouts, samples, spans); positions stay in the arrays they arrived in and are
written only where the policy masks them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from ..config import StalenessConfig
from ..errors import FieldError, FieldTypeError, TraceError
from ..metrics.bound import BoundTracker, ShipBound, env_tracker_config
from ..metrics.compute import WindowCounts, compute_report
from ..metrics.mismatch import MismatchSums
from ..metrics.report import MetricValue, StepReport, Tally
from ..records.columnar import LABELS_SPANS, LABELS_TOKENS, WEIGHT_FIELDS, RolloutBatch
from ..records.model import ParsedRollout, Rollout, UnparsedRollout, pack, parse_or_error
from ..records.validation import Verdicts, plainly_valid
from .decision import NO_MASK, Decision, Judgement
from .masking import mask_spans
from .policies import Policy, policy_for
from .segments import expand_ranges, segment_sum
from .shipped_positions import NOT_SAMPLED, ShippedSpans
from .spans import PART_LABELLED, PART_UNLABELLED, SpanTable, build_spans, checked_spans
from .table import Table

__all__ = ["Shipment", "ShippedRollout", "Sink"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

QUEUED, SHIPPED, DROPPED, INVALID = 0, 1, 2, 3
MAX_STEP = 2**53
COMPACT_MIN_ROWS = 4096  # below this many rows, forgetting is not worth a copy
# A batch of at most this many positions that is plainly valid is queued at add with a few checks and
# cut into spans later, with every batch added after it, in one pass (at the next sweep, ship or look at
# the tables): the cost of a call follows its work, not a few hundred numpy calls per add.
STAGE_MAX_POSITIONS = 1 << 16
STAGE_FLUSH_POSITIONS = 1 << 20  # staged positions that make an add cut them at once (bounded memory)
NEVER = -1


@dataclass(frozen=True)
class ShippedRollout:
    """One shipped rollout: its arrays are views of the arrays it arrived in, masked in place."""

    id: str
    batch: RolloutBatch
    index: int  # rollout index within ``batch``
    samples: tuple[int, ...]  # indices (within the rollout) of the samples shipped

    def record(self, arrays: bool = False) -> dict[str, Any]:
        """The rollout as a SPEC 3 record: masked arrays, dropped samples removed.

        Per-position fields are lists, or with ``arrays`` numpy arrays of the same values (for an
        encoder that writes arrays natively).
        """
        batch, index = self.batch, self.index
        if batch.echo is not None:
            record = dict(batch.echo[index])
        else:
            record = {"id": self.id}
            for name, values in (("group_id", batch.group_ids), ("env", batch.envs)):
                if values is not None and values[index] is not None:
                    record[name] = values[index]
            assert batch.frozen is not None and batch.agentic is not None and batch.completion_version is not None
            if batch.frozen[index]:
                record["source"] = "frozen"
            if batch.dispatch_version[index] >= 0:
                record["dispatch_version"] = int(batch.dispatch_version[index])
            if batch.completion_version[index] >= 0:
                record["completion_version"] = int(batch.completion_version[index])
            if batch.agentic[index]:
                record["agentic"] = True
        first = int(batch.sample_offsets[index])
        record["samples"] = [_sample_record(batch, first + k, arrays) for k in self.samples]
        return record


def _sample_record(batch: RolloutBatch, sample: int, arrays: bool = False) -> dict[str, Any]:
    lo, hi = int(batch.position_offsets[sample]), int(batch.position_offsets[sample + 1])

    def out_of(values: npt.NDArray[Any]) -> Any:
        return values if arrays else values.tolist()

    out: dict[str, Any] = {"mask": out_of(batch.mask[lo:hi].astype(np.int64))}
    assert batch.label_kind is not None
    if batch.label_kind[sample] == LABELS_SPANS:
        assert batch.span_offsets is not None and batch.span_versions is not None
        assert batch.span_starts is not None
        a, b = int(batch.span_offsets[sample]), int(batch.span_offsets[sample + 1])
        # a few pairs: Python lists cost less than a stacked array, and encode to the same JSON
        out["weight_versions"] = [
            list(pair) for pair in zip(batch.span_versions[a:b].tolist(), batch.span_starts[a:b].tolist())
        ]
    elif batch.label_kind[sample] == LABELS_TOKENS:
        assert batch.token_versions is not None
        out["token_versions"] = out_of(np.ascontiguousarray(batch.token_versions[lo:hi], dtype=np.int64))
    for name in WEIGHT_FIELDS:
        values = getattr(batch, name)
        if values is not None and batch.present[name][sample]:
            out[name] = out_of(values[lo:hi].astype(np.float64, copy=False))  # a view unless float32
    if batch.logprobs is not None and batch.present["logprobs"][sample]:
        out["logprobs"] = out_of(batch.logprobs[lo:hi].astype(np.float64, copy=False))
    if batch.trainer_logprobs is not None and batch.present["trainer_logprobs"][sample]:
        values = batch.trainer_logprobs[lo:hi].astype(np.float64)
        # missing values are null; orjson writes a non-finite float of an array as null by itself
        out["trainer_logprobs"] = values if arrays else [v if math.isfinite(v) else None for v in values.tolist()]
    return out


@dataclass(frozen=True)
class _Staged:
    """A small batch queued by :meth:`Sink.add` whose spans are cut later (with the ones after it)."""

    batch: RolloutBatch
    chunk: int
    groups: npt.NDArray[np.int64]
    envs: npt.NDArray[np.int64]
    # The element types of the mask and weight arrays (None: no such array). Batches whose kinds agree
    # wherever both have an array are cut together (:func:`_concatenated` fills the missing ones).
    kind: tuple[str | None, ...]


def _kind(batch: RolloutBatch) -> tuple[str | None, ...]:
    arrays = (batch.mask, batch.rl_weights, batch.ce_weights, batch.ref_kl_weights)
    return tuple(None if a is None else a.dtype.str for a in arrays)  # (a dtype equals None: float64)


def _joined_kind(kind: tuple[str | None, ...], other: tuple[str | None, ...]) -> tuple[str | None, ...] | None:
    """The kind of a group of batches with ``kind`` joined by one with ``other``; None if they differ."""
    if any(a is not None and b is not None and a != b for a, b in zip(kind, other)):
        return None
    return tuple(a if a is not None else b for a, b in zip(kind, other))


def _joined_offsets(parts: Sequence[npt.NDArray[np.int64]]) -> npt.NDArray[np.int64]:
    """Offsets into the concatenation of the parts the offsets ``parts`` index."""
    bases = np.cumsum([0, *(int(p[-1]) for p in parts)])
    return np.concatenate([*(p[:-1] + base for p, base in zip(parts, bases[:-1].tolist())), bases[-1:]])


def _concatenated(batches: Sequence[RolloutBatch]) -> RolloutBatch:
    """One batch holding ``batches`` one after the other, with the arrays cutting spans reads (copies).

    An array some batches lack is filled with what its absence means to the cut, so each sample's spans
    are those of its own batch: rl weights 1.0 on the mask (0 elsewhere), ce and ref-KL weights 0,
    ``token_versions`` -1 and no ``weight_versions`` spans (those samples' ``label_kind`` says they use
    neither).
    """

    def joined(name: str, fill: Any = None) -> Any:
        values = [getattr(b, name) for b in batches]
        given = [v for v in values if v is not None]
        if not given:
            return None
        dtype = given[0].dtype  # the group's (_joined_kind): a fill takes it, exactly (0, 1, -1)
        return np.concatenate([v if v is not None else fill(b).astype(dtype) for v, b in zip(values, batches)])

    columns: dict[str, Any] = {
        "rl_weights": joined("rl_weights", lambda b: b.mask),
        **{name: joined(name, lambda b: np.zeros(b.n_positions)) for name in ("ce_weights", "ref_kl_weights")},
        "token_versions": joined("token_versions", lambda b: np.full(b.n_positions, -1, dtype=np.int64)),
    }
    if any(b.span_offsets is not None for b in batches):
        none: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        columns["span_offsets"] = _joined_offsets(
            [b.span_offsets if b.span_offsets is not None else np.zeros(b.n_samples + 1, np.int64) for b in batches]
        )
        columns.update({name: joined(name, lambda b: none) for name in ("span_versions", "span_starts")})
    return RolloutBatch(
        ids=[rid for b in batches for rid in b.ids],
        sample_offsets=_joined_offsets([b.sample_offsets for b in batches]),
        position_offsets=_joined_offsets([b.position_offsets for b in batches]),
        mask=joined("mask"),
        dispatch_version=joined("dispatch_version"),
        completion_version=joined("completion_version"),
        frozen=joined("frozen"),
        agentic=joined("agentic"),
        label_kind=joined("label_kind"),
        **columns,
    )


@dataclass(frozen=True)
class Shipment:
    """A shipped batch with its metrics, and what left the sink for staleness in its window.

    ``rollouts`` is built on first access: an orchestrator that trains on its own (masked in place)
    arrays never pays for per-rollout objects.
    """

    step: int
    report: StepReport
    dropped_rollouts: tuple[str, ...]
    dropped_samples: tuple[tuple[str, int], ...]
    held: tuple[str, ...]
    invalid: tuple[TraceError, ...] = field(default=())
    _build_rollouts: Callable[[], tuple[ShippedRollout, ...]] = field(default=tuple, repr=False, compare=False)
    _spans: ShippedSpans | None = field(default=None, repr=False, compare=False)

    @cached_property
    def rollouts(self) -> tuple[ShippedRollout, ...]:
        """The shipped rollouts, in ship order, with their kept samples."""
        return self._build_rollouts()

    @cached_property
    def lags(self) -> npt.NDArray[np.int64]:
        """The lag ``T - v`` of every shipped position (SPEC 11), aligned with the shipped samples' arrays
        concatenated in ship order (:attr:`rollouts`, then their samples); ``-1`` where a position is not
        a sampled position of a live rollout. Send it with the batch to a trainer that computes
        :func:`~staleness_metrics.mismatch_sums` from its own log-probabilities."""
        return self._spans.lags() if self._spans is not None else np.zeros(0, dtype=np.int64)

    @cached_property
    def lag_offsets(self) -> npt.NDArray[np.int64]:
        """Where each shipped sample starts in :attr:`lags` (one more entry than shipped samples)."""
        return self._spans.lag_offsets() if self._spans is not None else np.zeros(1, dtype=np.int64)

    @property
    def metrics(self) -> Mapping[str, MetricValue]:
        """The SPEC 6 metrics dict of this ship."""
        return self.report.metrics

    @property
    def ids(self) -> list[str]:
        return [r.id for r in self.rollouts]

    def batches_line(self, arrays: bool = False) -> dict[str, Any]:
        """The ``--batches-out`` line of this ship (SPEC 9); ``arrays`` as in :meth:`ShippedRollout.record`."""
        return {
            "step": self.step,
            "shipped": [r.record(arrays) for r in self.rollouts],
            "dropped_rollouts": list(self.dropped_rollouts),
            "dropped_samples": [list(s) for s in self.dropped_samples],
            "held": list(self.held),
        }


class Sink:
    """Queue of finished rollouts, judged by one policy (SPEC 4 and 5)."""

    def __init__(
        self,
        config: StalenessConfig | None = None,
        *,
        policy: Policy | None = None,
        compact_min_rows: int = COMPACT_MIN_ROWS,
        env_reports: bool = True,
    ) -> None:
        """``env_reports=False``: a ship's report covers the whole batch only (no ``env_metrics`` or
        ``env_tally``, and no per-env keys), for a caller that reads the totals alone (what-if)."""
        self.config = config or StalenessConfig()
        self.compact_min_rows = compact_min_rows
        self.env_reports = env_reports
        self.policy = policy or policy_for(self.config)
        self._rollouts = Table(
            chunk=np.int64, index=np.int64, status=np.int8, judged=np.int64, frozen=np.bool_,
            dispatch=np.int64, completion=np.int64, group=np.int64, env=np.int64,
            sample_lo=np.int64, sample_hi=np.int64,
        )  # fmt: skip
        self._samples = Table(
            rollout=np.int64, local=np.int64, span_lo=np.int64, span_hi=np.int64, mask_below=np.int64,
            dropped=np.bool_, had_train=np.bool_, unmaskable=np.bool_, n_sampled=np.int64,
            n_unlabelled=np.int64, max_label=np.int64, max_sampled=np.int64, seq_min=np.int64,
            label_kind=np.int8,
        )  # fmt: skip
        self._spans = Table(
            sample=np.int64, lo=np.int64, hi=np.int64, version=np.int64, labelled=np.bool_,
            sampled=np.int64, live=np.bool_, part=np.int8,
        )  # fmt: skip
        self._ids: list[str] = []  # per rollout row
        self._row_of: dict[str, int] = {}  # queued (and recently resolved) rollouts by id
        self._seen_ids: set[str] = set()  # every id accepted in the run: ids are unique within a run
        self._chunks: list[RolloutBatch | None] = []
        self._chunk_open: list[int] = []  # rollouts of each chunk still queued
        self._closing: list[int] = []  # chunks whose last rollout left: released at the next ship
        self._groups: dict[str, int] = {}
        self._group_agentic = np.zeros(16, dtype=bool)  # per group: a member that ever entered was agentic
        self._n_groups = 0
        self._env_index: dict[str | None, int] = {None: 0}
        self._env_names: dict[int, str] = {0: ""}
        self._step = 0
        self._queued = 0
        self._window = WindowCounts()
        self._invalid: list[TraceError] = []
        self.totals = Tally()
        self.bound_tracker = BoundTracker(self.config)  # SPEC 14: the floor, the cost window, the adaptive bound
        self.env_trackers: dict[str, BoundTracker] = {}  # the same per env (env breakdown), without adaptation
        # Conservation: sampled positions of live rollouts accepted = shipped (trained or masked)
        # + dropped + still queued.
        self._tokens_entered = 0
        # Small batches queued (ids, groups, envs and chunks registered) whose table rows are not built yet.
        self._staged: list[_Staged] = []
        self._staged_rollouts = 0
        self._staged_positions = 0

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The sink's state as plain JSON-serialisable data (SPEC 13); see :mod:`.checkpoint`. Taking it at any
        moment changes nothing in the sink."""
        self._build_staged()
        from .checkpoint import save_sink  # loaded by the first checkpoint, not by every import of the sink

        return save_sink(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`. All or nothing: a state that fails a check (or was taken under
        another policy or bound) raises ``ConfigError`` naming the key path, and the sink stays as it was."""
        from .checkpoint import load_sink

        self._build_staged()  # a refused state leaves the sink as it was: staged rollouts now in its tables
        load_sink(self, state)

    # ------------------------------------------------------------------ add
    @property
    def queued(self) -> int:
        """How many rollouts wait in the queue."""
        return self._queued

    @property
    def tracked_rollouts(self) -> int:
        """Rollout rows held in memory: the queue plus those resolved since the last compaction."""
        return len(self._rollouts) + self._staged_rollouts

    @property
    def tokens_queued(self) -> int:
        """Sampled positions of live rollouts still queued (samples not dropped)."""
        self._build_staged()
        return self._queued_tokens(np.flatnonzero(self._rollouts["status"] == QUEUED))

    @property
    def tokens_entered(self) -> int:
        """Sampled positions of live rollouts accepted so far (set aside at ship: taken back out)."""
        self._build_staged()
        return self._tokens_entered

    @tokens_entered.setter
    def tokens_entered(self, value: int) -> None:
        self._build_staged()
        self._tokens_entered = value

    def _queued_tokens(self, rows: IntArray) -> int:
        r, s = self._rollouts, self._samples
        sample_rows = expand_ranges(r["sample_lo"][rows], r["sample_hi"][rows])
        live = ~r["frozen"][s["rollout"][sample_rows]] & ~s["dropped"][sample_rows]
        return int(s["n_sampled"][sample_rows][live].sum())

    @property
    def step(self) -> int:
        """The latest step a sweep or ship used (0 before any)."""
        return self._step

    @property
    def invalid(self) -> tuple[TraceError, ...]:
        """Errors of the rollouts set aside in lenient mode, oldest first."""
        return tuple(self._invalid)

    def add(self, rollouts: RolloutBatch | Rollout | Mapping[str, Any] | Iterable[Mapping[str, Any] | Rollout]) -> int:
        """Queue finished rollouts: records (dicts or :class:`Rollout`), an iterable of them, or a
        :class:`RolloutBatch`.

        Strict mode raises :class:`TraceError` for the first invalid rollout and adds nothing;
        lenient mode sets invalid rollouts aside (counted) and queues the rest. Returns how many
        rollouts were queued.

        A :class:`RolloutBatch`'s arrays belong to the sink from now on (it masks them in place): a small
        batch that passes a quick check is queued at once and its positions are read at the next sweep or
        ship, together with the batches added after it, so the cost of an add follows its size.
        """
        if isinstance(rollouts, RolloutBatch):
            return self._add_batch(rollouts)
        records = [rollouts] if isinstance(rollouts, (Mapping, Rollout)) else rollouts
        items = []
        for item in records:
            parsed = parse_or_error(item.to_record() if isinstance(item, Rollout) else item)
            if isinstance(parsed, UnparsedRollout) and self.config.strict:
                raise parsed.error
            items.append(parsed)
        return self.add_parsed(items)

    def add_parsed(
        self,
        items: Sequence[ParsedRollout | UnparsedRollout],
        packed: RolloutBatch | None = None,
        checked: tuple[Verdicts, SpanTable] | None = None,
    ) -> int:
        """Queue records already type-checked by :func:`~staleness_metrics.records.model.parse_or_error` (in
        order, as :meth:`add` would): refused ones raise (strict) or are set aside (lenient).

        ``packed``: the parsed ones of ``items`` already packed (:func:`~staleness_metrics.records.model.pack`),
        a batch this sink may keep and mask in place. ``checked``: the batch's verdicts and spans as
        :func:`check_batch` and :func:`build_spans` found them for a sink that had accepted the same ids
        (:func:`~staleness_metrics.replay.stream.pack_once`: what-if runs one stream at several bounds)."""
        parsed: list[ParsedRollout] = []
        for item in items:
            if isinstance(item, UnparsedRollout):
                if self.config.strict:
                    raise item.error
                self._set_aside(item.error, item.env)
            else:
                parsed.append(item)
        if not parsed:
            return 0
        return self._add_batch(packed if packed is not None else pack(parsed), checked)

    def _set_aside(self, error: TraceError, env: str | None) -> None:
        self._invalid.append(error)
        self._window.add(np.array([self._env(env)]), "rollouts_invalid")

    def _env(self, name: str | None) -> int:
        if name not in self._env_index:
            self._env_index[name] = len(self._env_index)
            self._env_names[self._env_index[name]] = name or ""
        return self._env_index[name]

    def _new_groups(self, count: int) -> int:
        """Register ``count`` new groups; returns the index of the first."""
        first = self._n_groups
        self._n_groups += count
        if self._n_groups > len(self._group_agentic):
            grown = np.zeros(2 * self._n_groups, dtype=bool)
            grown[:first] = self._group_agentic[:first]
            self._group_agentic = grown
        return first

    def _groups_of(self, batch: RolloutBatch, rollouts: list[int]) -> IntArray:
        """Group index of each rollout, registering new groups (one of its own without group_id)."""
        assert batch.group_ids is not None and batch.agentic is not None
        names = (
            batch.group_ids if len(rollouts) == batch.n_rollouts else list(map(batch.group_ids.__getitem__, rollouts))
        )
        if names.count(None) == len(names):  # singletons: one new group each, no lookups
            first = self._new_groups(len(rollouts))
            groups = np.arange(first, self._n_groups, dtype=np.int64)
        else:
            groups = np.empty(len(rollouts), dtype=np.int64)
            for k, name in enumerate(names):
                index = None if name is None else self._groups.get(name)
                if index is None:
                    index = self._new_groups(1)
                    if name is not None:
                        self._groups[name] = index
                groups[k] = index
        agentic = batch.agentic if len(rollouts) == batch.n_rollouts else batch.agentic[rollouts]
        if agentic.any():  # (an unbuffered ufunc.at costs more than the whole add of a small batch)
            np.logical_or.at(self._group_agentic, groups, agentic)
        return groups

    def _add_batch(self, batch: RolloutBatch, checked: tuple[Verdicts, SpanTable] | None = None) -> int:
        if checked is None and batch.n_positions <= STAGE_MAX_POSITIONS and plainly_valid(batch, self._seen_ids):
            return self._stage(batch)
        self._build_staged()
        if checked is not None:
            verdicts, spans = checked
        else:
            verdicts, spans = checked_spans(batch, self._seen_ids)
        if verdicts.errors and self.config.strict:
            raise verdicts.errors[min(verdicts.errors)]
        invalid = verdicts.invalid
        for index, error in sorted(verdicts.errors.items()):
            env = batch.envs[index] if batch.envs is not None else None
            self._set_aside(error, env if isinstance(env, str) and env else None)  # a bad env counts under none
        keep = np.flatnonzero(~invalid)
        kept_ids = keep.tolist()
        if len(keep) == 0:
            return 0
        assert batch.frozen is not None and batch.agentic is not None and batch.group_ids is not None
        assert batch.envs is not None and batch.label_kind is not None

        chunk, groups, envs = self._admit(batch, kept_ids)
        self._append_rows(batch, spans, keep, np.full(len(keep), chunk), keep, groups, envs)
        return len(keep)

    def _admit(self, batch: RolloutBatch, kept_ids: list[int]) -> tuple[int, IntArray, IntArray]:
        """Queue the rollouts ``kept_ids`` of ``batch`` by id, group and env (their table rows come after);
        returns the batch's chunk and the rollouts' groups and envs."""
        assert batch.envs is not None
        chunk = len(self._chunks)
        self._chunks.append(batch)
        self._chunk_open.append(len(kept_ids))
        row_base = len(self._rollouts) + self._staged_rollouts
        # Per-rollout lists are read through C-level map/zip, never an interpreted loop per rollout.
        every = len(kept_ids) == batch.n_rollouts
        ids = batch.ids if every else list(map(batch.ids.__getitem__, kept_ids))
        env_names = batch.envs if every else list(map(batch.envs.__getitem__, kept_ids))
        groups = self._groups_of(batch, kept_ids)
        env_index = {name: self._env(name) for name in set(env_names)}
        if len(env_index) == 1:
            envs = np.full(len(kept_ids), next(iter(env_index.values())), dtype=np.int64)
        else:
            envs = np.fromiter(map(env_index.__getitem__, env_names), dtype=np.int64, count=len(kept_ids))
        self._row_of.update(zip(ids, range(row_base, row_base + len(kept_ids))))
        self._ids.extend(ids)
        self._seen_ids.update(ids)
        self._queued += len(kept_ids)
        return chunk, groups, envs

    def _stage(self, batch: RolloutBatch) -> int:
        """Queue a plainly valid small batch now; its table rows are built by :meth:`_build_staged`."""
        chunk, groups, envs = self._admit(batch, list(range(batch.n_rollouts)))
        self._staged.append(_Staged(batch, chunk, groups, envs, _kind(batch)))
        self._staged_rollouts += batch.n_rollouts
        self._staged_positions += batch.n_positions
        if self._staged_positions > STAGE_FLUSH_POSITIONS:
            self._build_staged()
        return batch.n_rollouts

    def _build_staged(self) -> None:
        """Cut the staged batches into spans and append their rows: consecutive batches with the same
        arrays in one pass over their concatenation (spans never cross a sample, so each sample's spans
        are what its own batch would give), in the order they were added."""
        staged, self._staged = self._staged, []
        self._staged_rollouts = self._staged_positions = 0
        start = 0
        while start < len(staged):
            end = start + 1
            kind = staged[start].kind
            while end < len(staged):
                joined = _joined_kind(kind, staged[end].kind)
                if joined is None:
                    break
                kind, end = joined, end + 1
            self._append_staged(staged[start:end])
            start = end

    def _append_staged(self, staged: list[_Staged]) -> None:
        batch = staged[0].batch if len(staged) == 1 else _concatenated([item.batch for item in staged])
        verdicts = Verdicts(batch)
        spans = build_spans(batch, verdicts)
        assert not verdicts.errors, "a plainly valid batch was refused"  # plainly_valid may only err towards no
        n_rollouts = [item.batch.n_rollouts for item in staged]
        rollout_base = np.repeat(np.cumsum([0, *n_rollouts[:-1]]), n_rollouts)
        chunks = np.repeat([item.chunk for item in staged], n_rollouts)
        # spans at positions of the concatenation: back to their own batch's
        position_base = np.repeat(np.cumsum([0, *(item.batch.n_positions for item in staged[:-1])]), n_rollouts)
        groups = np.concatenate([item.groups for item in staged]) if len(staged) > 1 else staged[0].groups
        envs = np.concatenate([item.envs for item in staged]) if len(staged) > 1 else staged[0].envs
        keep = np.arange(batch.n_rollouts)
        self._append_rows(batch, spans, keep, chunks, keep - rollout_base, groups, envs, position_base)

    def _append_rows(
        self,
        batch: RolloutBatch,
        spans: SpanTable,
        keep: IntArray,
        chunk: IntArray,
        index: IntArray,
        groups: IntArray,
        envs: IntArray,
        position_base: IntArray | None = None,
    ) -> None:
        """The table rows of rollouts ``keep`` of ``batch`` (cut into ``spans``): their chunks, their index in
        it, and (``position_base``, per rollout) where their chunk starts in ``batch``'s positions."""
        assert batch.frozen is not None and batch.label_kind is not None
        sample_lo, sample_hi = batch.sample_offsets[keep], batch.sample_offsets[keep + 1]
        samples = expand_ranges(sample_lo, sample_hi)
        sample_base = len(self._samples)
        span_base = len(self._spans)
        row_base = len(self._rollouts)
        new_sample_offsets = np.concatenate(([0], np.cumsum(sample_hi - sample_lo)))
        self._rollouts.append(
            chunk=chunk, index=index, status=np.full(len(keep), QUEUED),
            judged=np.full(len(keep), NEVER), frozen=batch.frozen[keep], dispatch=batch.dispatch_version[keep],
            completion=spans.completion[keep], group=groups, env=envs,
            sample_lo=sample_base + new_sample_offsets[:-1], sample_hi=sample_base + new_sample_offsets[1:],
        )  # fmt: skip
        sample_rollout = np.repeat(np.arange(len(keep)), sample_hi - sample_lo)
        span_lo, span_hi = spans.span_offsets[samples], spans.span_offsets[samples + 1]
        kept_spans = expand_ranges(span_lo, span_hi)
        new_span_offsets = np.concatenate(([0], np.cumsum(span_hi - span_lo)))
        self._samples.append(
            rollout=row_base + sample_rollout, local=samples - batch.sample_offsets[keep][sample_rollout],
            span_lo=span_base + new_span_offsets[:-1], span_hi=span_base + new_span_offsets[1:],
            mask_below=np.full(len(samples), NO_MASK), dropped=np.zeros(len(samples), dtype=bool),
            had_train=spans.had_train[samples], unmaskable=spans.unmaskable[samples],
            n_sampled=spans.n_sampled[samples], n_unlabelled=spans.n_unlabelled[samples],
            max_label=spans.max_label[samples], max_sampled=spans.max_sampled_version[samples],
            seq_min=spans.seq_min_version[samples], label_kind=batch.label_kind[samples],
        )  # fmt: skip
        span_sample_local = np.repeat(np.arange(len(samples)), span_hi - span_lo)
        lo, hi = spans.lo[kept_spans], spans.hi[kept_spans]
        if position_base is not None:
            base = position_base[sample_rollout[span_sample_local]]
            lo, hi = lo - base, hi - base
        self._spans.append(
            sample=sample_base + span_sample_local, lo=lo, hi=hi,
            version=spans.version[kept_spans], labelled=spans.label[kept_spans] >= 0,
            sampled=spans.sampled[kept_spans], live=spans.live[kept_spans], part=spans.part[kept_spans],
        )  # fmt: skip
        live_samples = ~batch.frozen[keep][sample_rollout]
        self._tokens_entered += int(spans.n_sampled[samples][live_samples].sum())
        self.policy.observe_added(groups)

    # ------------------------------------------------------------------ judge
    def _advance(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 1 <= step <= MAX_STEP:
            raise FieldError("step", f"must be an integer in 1..{MAX_STEP}, got {step!r}")
        if step < self._step:
            raise FieldError("step", f"{step} is below the previous step {self._step}: steps never decrease")
        self._step = int(step)

    def _with_groups(self, rows: IntArray) -> IntArray:
        """``rows`` plus every queued member of their groups (for policies that judge groups)."""
        if not self.policy.judges_groups or len(rows) == 0:
            return rows
        queued = np.flatnonzero(self._rollouts["status"] == QUEUED)
        members = queued[np.isin(self._rollouts["group"][queued], self._rollouts["group"][rows])]
        return np.union1d(rows, members)

    def _slice(self, rows: IntArray, step: int) -> Judgement:
        r, s, n = self._rollouts, self._samples, self._spans
        sample_rows = expand_ranges(r["sample_lo"][rows], r["sample_hi"][rows])
        span_rows = expand_ranges(s["span_lo"][sample_rows], s["span_hi"][sample_rows])
        sample_counts = r["sample_hi"][rows] - r["sample_lo"][rows]
        span_counts = s["span_hi"][sample_rows] - s["span_lo"][sample_rows]
        group = r["group"][rows]
        return Judgement(
            step=step, rows=rows, frozen=r["frozen"][rows], env=r["env"][rows], dispatch=r["dispatch"][rows],
            completion=r["completion"][rows], group=group, group_agentic=self._group_agentic[group],
            sample_offsets=np.concatenate(([0], np.cumsum(sample_counts))),
            sample_rows=sample_rows, sample_rollout=np.repeat(np.arange(len(rows)), sample_counts),
            mask_below=s["mask_below"][sample_rows], dropped=s["dropped"][sample_rows],
            had_train=s["had_train"][sample_rows], unmaskable=s["unmaskable"][sample_rows],
            n_sampled=s["n_sampled"][sample_rows], n_unlabelled=s["n_unlabelled"][sample_rows],
            max_sampled_version=s["max_sampled"][sample_rows], seq_min_version=s["seq_min"][sample_rows],
            span_offsets=np.concatenate(([0], np.cumsum(span_counts))),
            span_sample=np.repeat(np.arange(len(sample_rows)), span_counts), version=n["version"][span_rows],
            labelled=n["labelled"][span_rows], sampled=n["sampled"][span_rows], live=n["live"][span_rows],
        )  # fmt: skip

    def _judge(self, rows: IntArray, step: int) -> tuple[Judgement, Decision]:
        """Apply the policy at ``step`` to queued ``rows``; returns the slice and the decision."""
        judgement = self._slice(rows, step)
        decision = self.policy.decide(judgement)
        self._apply(judgement, decision)
        self._rollouts["judged"][rows] = step
        return judgement, decision

    def _apply(self, judgement: Judgement, decision: Decision) -> None:
        samples = self._samples
        rows, sample_rows = judgement.rows, judgement.sample_rows
        raised = decision.mask_below > judgement.mask_below
        if raised.any():
            self._mask_positions(judgement, np.maximum(decision.mask_below, judgement.mask_below), raised)
        samples["mask_below"][sample_rows] = np.maximum(judgement.mask_below, decision.mask_below)

        drop_rollout = decision.drop_rollout & ~judgement.frozen
        drop_sample = (decision.drop_sample | drop_rollout[judgement.sample_rollout]) & ~judgement.dropped
        if drop_sample.any():
            local = np.flatnonzero(drop_sample)
            samples["dropped"][sample_rows[local]] = True
            env = judgement.env[judgement.sample_rollout[local]]
            self._window.add(env, "samples_dropped")
            self._window.add(env, "tokens_dropped", judgement.n_sampled[local])
            self._window.add_dropped_lengths(env, judgement.n_sampled[local])
            ids = self._ids
            self._window.dropped_samples.extend(
                (ids[rows[judgement.sample_rollout[i]]], int(samples["local"][sample_rows[i]])) for i in local
            )
        if drop_rollout.any():
            gone = rows[drop_rollout]
            self._window.add(judgement.env[drop_rollout], "rollouts_dropped")
            self._window.dropped_rollouts.extend(self._ids[i] for i in gone)
            self._leave(gone, DROPPED)

    def _mask_positions(self, judgement: Judgement, mask_below: IntArray, raised: BoolArray) -> None:
        """Zero newly stale sampled positions in mask and the three weight arrays, in place."""
        old = judgement.mask_below[judgement.span_sample]
        new = mask_below[judgement.span_sample]
        stale = judgement.version < new
        hit = raised[judgement.span_sample] & stale & (judgement.version >= old) & (judgement.sampled > 0)
        if not hit.any():
            return
        s = self._samples
        span_rows = expand_ranges(s["span_lo"][judgement.sample_rows], s["span_hi"][judgement.sample_rows])
        part = self._spans["part"][span_rows]
        # The two parts of a mixed span are adjacent rows: when both are stale now, the whole range goes.
        partner = np.arange(len(part)) + (part == PART_LABELLED) - (part == PART_UNLABELLED)
        whole = stale[partner]
        hit &= ~((part == PART_UNLABELLED) & hit[partner])  # its labelled part fills the range already
        rows = span_rows[hit]
        chunk_of = self._rollouts["chunk"][judgement.rows][judgement.sample_rollout[judgement.span_sample[hit]]]
        spans = self._spans
        count = judgement.sampled[hit]  # sampled positions are the whole span or part: mask-0 ones are never hit
        mask_spans(self._chunks, chunk_of, spans["lo"][rows], spans["hi"][rows], part[hit], whole[hit], count)

    def _leave(self, rows: IntArray, status: int) -> None:
        self._rollouts["status"][rows] = status
        self._queued -= len(rows)
        chunks, counts = np.unique(self._rollouts["chunk"][rows], return_counts=True)
        for chunk, count in zip(chunks.tolist(), counts.tolist()):
            self._chunk_open[chunk] -= count
            if self._chunk_open[chunk] == 0:
                self._closing.append(chunk)

    def _release_chunks(self) -> None:
        """Let go of the batches no queued rollout needs: only those that closed since the last ship, so a
        ship costs nothing per batch ever added."""
        for chunk in self._closing:
            self._chunks[chunk] = None
        self._closing = []

    def observe_mismatch(self, step: int, total: MismatchSums, *, merge: bool = False) -> ShipBound | None:
        """Give SPEC 14's tracker a ship's SPEC 11 sums (``merge``: the trainer's total of a step so far, which
        replaces what it gave for the step before); returns the ship's floor, curve and advice. An adapted bound
        judges from the next sweep or ship."""
        bound = self.bound_tracker.observe(step, total, merge=merge)
        self.sync_bound()
        return bound

    def observe_env_mismatch(
        self, step: int, env: str, total: MismatchSums, *, merge: bool = False, bound: int | None = None
    ) -> ShipBound | None:
        """The same for one env's sums (the env breakdown): its own floor, window and advice at the run's bound;
        the bound adapts on the batch only."""
        tracker = self.env_trackers.get(env)
        if tracker is None:
            tracker = self.env_trackers[env] = BoundTracker(env_tracker_config(self.config))
        return tracker.observe(step, total, merge=merge, bound=self.bound_tracker.bound if bound is None else bound)

    def sync_bound(self) -> None:
        """Let the policy judge with the tracker's bound (it moves only when the bound adapts)."""
        if self.bound_tracker.adaptive:
            self.policy.max_staleness = self.bound_tracker.bound

    def sweep(self, step: int) -> None:
        """Judge every queued rollout not yet judged at ``step``; drops leave the queue now."""
        self._advance(step)
        self._build_staged()
        r = self._rollouts
        rows = np.flatnonzero((r["status"] == QUEUED) & (r["judged"] < step))
        if len(rows):
            self._judge(self._with_groups(rows), step)

    # ------------------------------------------------------------------ ship
    def ship(self, step: int, ids: Iterable[str] | None = None) -> Shipment:
        """Sweep at ``step``, then ship the named queued rollouts (all when ``ids`` is None).

        Versions above the trained one are checked on the rollouts the ship takes, after its sweep
        (a rollout the sweep drops is never taken): strict mode raises :class:`TraceError`, lenient
        mode sets them aside.
        """
        if isinstance(ids, str):
            raise FieldTypeError("ids", "must be a collection of rollout ids, not one string")
        self._advance(step)
        self._build_staged()
        r = self._rollouts
        if ids is None:
            taken = np.flatnonzero(r["status"] == QUEUED)
        else:
            named = [self._row_of[i] for i in ids if i in self._row_of]
            taken = np.unique(np.array(named, dtype=np.int64))
            taken = taken[r["status"][taken] == QUEUED]
        self.sweep(step)
        taken = self._check_versions(taken[r["status"][taken] == QUEUED], step)
        hold = np.zeros(len(taken), dtype=bool)
        if len(taken) and self.policy.holds:
            # The sweep judged everything at this step already; judging again only decides the holds.
            judgement, decision = self._judge(self._with_groups(taken), step)
            taken = taken[r["status"][taken] == QUEUED]
            hold = np.isin(taken, judgement.rows[decision.hold_rollout])
        held, shipped = taken[hold], taken[~hold]
        self._window.add(r["env"][held], "rollouts_held")
        self._window.held.extend(self._ids[i] for i in held)
        self._leave(shipped, SHIPPED)

        shipped_slice = self._slice(shipped, step)
        spans = self._shipped_spans(shipped_slice)
        mismatch = spans.mismatch(self.config.mismatch_band) if spans.carries_trainer_logprobs() else None
        judged_with = self.bound_tracker.bound  # the bound of this ship's sweep (adaptation moves the next one)
        env_costs: dict[str, tuple[MismatchSums, ShipBound | None]] = {}
        if mismatch is not None and self.config.env_breakdown and spans.env is not None:
            for env in np.unique(spans.env[spans.lag >= 0]).tolist():
                name = self._env_names[env]
                if name:  # SPEC 11 and 14 per env, from the records (rollouts without an env have no keys)
                    sums = spans.mismatch(self.config.mismatch_band, env)
                    env_costs[name] = (sums, self.observe_env_mismatch(step, name, sums, bound=judged_with))
        bound = None if mismatch is None else self.observe_mismatch(step, mismatch)
        report = compute_report(
            shipped_slice, self._window, judged_with, self._env_names, self.config.env_breakdown, mismatch, bound,
            env_costs,
            per_env=self.env_reports,
        )  # fmt: skip
        shipment = Shipment(
            step=step,
            report=report,
            dropped_rollouts=tuple(self._window.dropped_rollouts),
            dropped_samples=tuple(self._window.dropped_samples),
            held=tuple(self._window.held),
            invalid=tuple(self._invalid),
            _build_rollouts=self._shipped_rollouts(shipped),
            _spans=spans,
        )
        self.totals = self.totals + report.tally
        self._window = WindowCounts()
        self._invalid = []
        self._release_chunks()
        if len(self._rollouts) > max(self.compact_min_rows, 2 * self._queued):
            self._compact()
        return shipment

    def _compact(self) -> None:
        """Forget rollouts that left the sink: the tables keep only queued ones (bounded memory)."""
        self._rollouts, self._samples, self._spans, self._chunks, self._chunk_open, self._ids = self._compacted()
        self._row_of = {rid: row for row, rid in enumerate(self._ids)}
        self._closing = []  # chunks closing now have no queued rollout: they are not kept

    def _compacted(self) -> tuple[Table, Table, Table, list[RolloutBatch | None], list[int], list[str]]:
        """The tables, chunks, open counts and ids of the queued rollouts only, renumbered: new objects (the
        sink is not changed, so a checkpoint may take them at any moment)."""
        r, s = self._rollouts, self._samples
        keep = np.flatnonzero(r["status"] == QUEUED)
        sample_counts = r["sample_hi"][keep] - r["sample_lo"][keep]
        sample_rows = expand_ranges(r["sample_lo"][keep], r["sample_hi"][keep])
        span_counts = s["span_hi"][sample_rows] - s["span_lo"][sample_rows]
        span_rows = expand_ranges(s["span_lo"][sample_rows], s["span_hi"][sample_rows])
        chunks = np.unique(r["chunk"][keep])
        sample_offsets = np.concatenate(([0], np.cumsum(sample_counts)))
        span_offsets = np.concatenate(([0], np.cumsum(span_counts)))
        rollouts = r.take(
            keep, chunk=np.searchsorted(chunks, r["chunk"][keep]),
            sample_lo=sample_offsets[:-1], sample_hi=sample_offsets[1:],
        )  # fmt: skip
        samples = s.take(
            sample_rows, rollout=np.repeat(np.arange(len(keep)), sample_counts),
            span_lo=span_offsets[:-1], span_hi=span_offsets[1:],
        )  # fmt: skip
        spans = self._spans.take(span_rows, sample=np.repeat(np.arange(len(sample_rows)), span_counts))
        return (
            rollouts, samples, spans, [self._chunks[c] for c in chunks.tolist()],
            [self._chunk_open[c] for c in chunks.tolist()], [self._ids[row] for row in keep.tolist()],
        )  # fmt: skip

    def _shipped_rollouts(self, rows: IntArray) -> Callable[[], tuple[ShippedRollout, ...]]:
        """Capture what the shipped rollouts are now; build the objects only when asked."""
        r, s = self._rollouts, self._samples
        counts = r["sample_hi"][rows] - r["sample_lo"][rows]
        sample_rows = expand_ranges(r["sample_lo"][rows], r["sample_hi"][rows])
        kept = ~s["dropped"][sample_rows]
        owner = np.repeat(np.arange(len(rows)), counts)[kept]
        local = s["local"][sample_rows][kept]
        ids = [self._ids[row] for row in rows.tolist()]
        chunk = r["chunk"][rows]
        batches = {c: self._chunks[c] for c in np.unique(chunk).tolist()}
        index = r["index"][rows]

        def build() -> tuple[ShippedRollout, ...]:
            bounds = np.searchsorted(owner, np.arange(len(ids) + 1))
            out = []
            for i, (rid, c, k) in enumerate(zip(ids, chunk.tolist(), index.tolist())):
                batch = batches[c]
                assert batch is not None
                out.append(ShippedRollout(rid, batch, k, tuple(local[bounds[i] : bounds[i + 1]].tolist())))
            return tuple(out)

        return build

    def _shipped_spans(self, shipped: Judgement) -> ShippedSpans:
        """The spans of the shipped, kept samples in ship order, with each one's lag (SPEC 11)."""
        s, n = self._samples, self._spans
        span_rows = expand_ranges(s["span_lo"][shipped.sample_rows], s["span_hi"][shipped.sample_rows])
        kept_sample = ~shipped.dropped
        part = n["part"][span_rows]
        kept = kept_sample[shipped.span_sample] & (part != PART_UNLABELLED)  # a mixed span once, by its first row
        span_rollout = shipped.sample_rollout[shipped.span_sample]
        in_population = ~shipped.frozen[span_rollout] & (shipped.sampled > 0)
        lag = np.where(in_population, shipped.trained_version - shipped.version, NOT_SAMPLED)
        masked = shipped.version < shipped.mask_below[shipped.span_sample]
        partner = np.minimum(np.arange(len(part)) + 1, max(len(part) - 1, 0))  # the unlabelled part follows
        chunks = self._rollouts["chunk"][shipped.rows]
        used = np.unique(chunks)
        batches = [self._chunks[c] for c in used.tolist()]
        assert all(b is not None for b in batches)
        spans_per_sample = segment_sum(kept.astype(np.int64), shipped.span_offsets)[kept_sample]
        return ShippedSpans(
            batches=batches,
            chunk=np.searchsorted(used, chunks[span_rollout])[kept],
            lo=n["lo"][span_rows][kept],
            hi=n["hi"][span_rows][kept],
            lag=lag[kept],
            masked=masked[kept],
            sample_offsets=np.concatenate(([0], np.cumsum(spans_per_sample))),
            mixed=(part == PART_LABELLED)[kept],
            unlabelled_lag=lag[partner][kept],
            unlabelled_masked=masked[partner][kept],
            env=shipped.env[span_rollout][kept],
        )

    def _check_versions(self, rows: IntArray, step: int) -> IntArray:
        """Ship-time rule: no version above the trained one. Returns the rows that pass."""
        trained = step - 1
        r, s = self._rollouts, self._samples
        bad_dispatch = r["dispatch"][rows] > trained  # frozen rollouts too: every version is checked
        sample_rows = expand_ranges(r["sample_lo"][rows], r["sample_hi"][rows])
        counts = r["sample_hi"][rows] - r["sample_lo"][rows]
        bad_sample = s["max_label"][sample_rows] > trained
        bad_label = np.bincount(np.repeat(np.arange(len(rows)), counts)[bad_sample], minlength=len(rows)) > 0
        bad = bad_dispatch | bad_label
        if not bad.any():
            return rows
        errors = []
        for local in np.flatnonzero(bad):
            row = int(rows[local])
            if bad_dispatch[local]:
                version, field_name = int(r["dispatch"][row]), "dispatch_version"
            else:
                lo = int(r["sample_lo"][row])
                k = int(np.flatnonzero(s["max_label"][lo : int(r["sample_hi"][row])] > trained)[0])
                kind = "weight_versions" if s["label_kind"][lo + k] == LABELS_SPANS else "token_versions"
                version, field_name = int(s["max_label"][lo + k]), f"samples[{k}].{kind}"
            errors.append(
                TraceError(self._ids[row], field_name, f"version {version} is above the trained version {trained}")
            )
        if self.config.strict:
            raise errors[0]
        for local, error in zip(np.flatnonzero(bad), errors):
            self._set_aside(error, self._env_names[int(r["env"][rows[local]])] or None)
        self._tokens_entered -= self._queued_tokens(rows[bad])  # set aside: they never entered after all
        self._leave(rows[bad], INVALID)
        return rows[~bad]
