"""The queue of a sink (SPEC 4): the rollouts waiting to ship and what the engine keeps of them.

Three growable tables (rollouts, samples, spans) hold one row per queued rollout, sample and span; the
batches the rollouts arrived in are kept whole (their positions are masked in place) until no queued
rollout needs them. The queue registers ids, groups and envs as rollouts enter, lets rows leave (shipped,
dropped, set aside), forgets them in bulk (:meth:`RolloutQueue.compact`), and saves and restores all of
it (:meth:`RolloutQueue.state_dict`, :meth:`RolloutQueue.read_state`): the object that owns the fields
is the one that writes and checks them.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from itertools import chain, repeat
from operator import attrgetter
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..records.columnar import WEIGHT_FIELDS, RolloutBatch
from ..records.plain_values import PositionCopies
from ..records.validation import Verdicts, plain_values_of
from ..state_checks import boolean, fail, integer, join, keys, sequence, string, strings
from .batch_state import check_offsets, decode_batch, decode_table, encode_batch, encode_table
from .decision import NO_MASK
from .segments import expand_ranges
from .spans import PART_LABELLED, PART_UNLABELLED, PART_WHOLE, SpanTable, build_spans
from .table import Table

__all__ = ["COMPACT_MIN_ROWS", "DROPPED", "INVALID", "NEVER", "QUEUED", "SHIPPED", "RolloutQueue"]

IntArray = npt.NDArray[np.int64]

QUEUED, SHIPPED, DROPPED, INVALID = 0, 1, 2, 3  # a rollout row's status
COMPACT_MIN_ROWS = 4096  # below this many rows, forgetting is not worth a copy
# A batch of at most this many positions that is plainly valid is queued at add with a few checks and
# cut into spans later, with every batch added after it, in one pass (at the next sweep, ship or look at
# the tables): the cost of a call follows its work, not a few hundred numpy calls per add.
STAGE_MAX_POSITIONS = 1 << 16
STAGE_FLUSH_POSITIONS = 1 << 20  # staged positions that make an add cut them at once (bounded memory)
NEVER = -1  # the step of a rollout not judged yet
QUEUE_KEYS = (
    "queued", "tokens_entered", "tables", "ids", "seen_ids", "chunks", "chunk_open", "groups", "group_agentic",
    "n_groups", "envs",
)  # fmt: skip


class _Staged(NamedTuple):
    """A small batch queued by :meth:`Sink.add` whose spans are cut later (with the ones after it)."""

    batch: RolloutBatch
    chunk: int
    groups: list[int]
    envs: list[int]
    # The element types of the mask and weight arrays (None: no such array). Batches whose kinds agree
    # wherever both have an array are cut together (:func:`_concatenated` fills the missing ones).
    kind: tuple[str | None, ...]
    n_rollouts: int
    n_samples: int
    n_positions: int


# The ``str`` of each dtype met (``dtype.str`` builds a new string each time: ≈ 0.15 µs, on every small add).
_DTYPE_STRS: dict[np.dtype[Any], str] = {}


def _kind(batch: RolloutBatch) -> tuple[str | None, ...]:
    """The batch's kind: its mask's and weights' element types, as strings (a dtype equals None: float64)."""
    rl, ce, ref_kl, strs = batch.rl_weights, batch.ce_weights, batch.ref_kl_weights, _DTYPE_STRS
    try:  # (written out: this runs once per small add)
        return (
            strs[batch.mask.dtype], None if rl is None else strs[rl.dtype], None if ce is None else strs[ce.dtype],
            None if ref_kl is None else strs[ref_kl.dtype],
        )  # fmt: skip
    except KeyError:
        strs.update((v.dtype, v.dtype.str) for v in (batch.mask, rl, ce, ref_kl) if v is not None)
        return _kind(batch)


def _joined_kind(kind: tuple[str | None, ...], other: tuple[str | None, ...]) -> tuple[str | None, ...] | None:
    """The kind of a group of batches with ``kind`` joined by one with ``other``; None if they differ."""
    if kind == other:  # the usual case, one C-level comparison
        return kind
    if any(a is not None and b is not None and a != b for a, b in zip(kind, other)):
        return None
    return tuple(a if a is not None else b for a, b in zip(kind, other))


def _joined_offsets(
    parts: Sequence[npt.NDArray[np.int64]], counts: Sequence[int], ends: Sequence[int] | None = None
) -> npt.NDArray[np.int64]:
    """Offsets into the concatenation of the parts the offsets ``parts`` index (``counts``: each part's
    entries minus one; ``ends``: each part's last entry, when known)."""
    if len(parts) == 1:
        only: npt.NDArray[np.int64] = parts[0].copy()
        return only
    if ends is None:
        ends = [int(p[-1]) for p in parts]
    if counts.count(1) == len(counts):  # one entry each (a single-sample rollout): the running ends alone
        return np.cumsum([0, *ends], dtype=np.int64)
    bases = np.cumsum([0, *ends])
    # One addition over the joined parts, not one per part (a ship of many single-rollout adds joins dozens).
    starts = np.concatenate([p[:-1] for p in parts])
    starts += np.repeat(bases[:-1], counts).astype(starts.dtype, copy=False)
    return np.concatenate([starts, bases[-1:].astype(starts.dtype, copy=False)])


# Per-position arrays of the staged batches up to this many elements are joined into buffers kept between
# ships (one set per thread, shared by the sinks it runs): memory the process has touched already, where a
# fresh array of a few hundred kB costs more in page faults than the copy itself. Larger joins take fresh
# arrays (bounded memory: a few MB per thread at most).
SCRATCH_MAX_ELEMENTS = 1 << 17
_POSITION_ARRAYS = ("mask", "rl_weights", "ce_weights", "ref_kl_weights", "token_versions")
_NO_TOKENS: IntArray = np.zeros(0, dtype=np.int64)


class _Scratch(threading.local):
    """The buffers the per-position arrays of staged batches are joined into, one per array name (and thread)."""

    def __init__(self) -> None:
        self._buffers: dict[str, npt.NDArray[Any]] = {}

    def join(self, name: str, arrays: list[npt.NDArray[Any]], total: int) -> npt.NDArray[Any]:
        """``np.concatenate(arrays)`` (arrays of one dtype, ``total`` elements in all), in the kept buffer
        of ``name`` when it is small enough. The result is valid until the next join of ``name``."""
        dtype = arrays[0].dtype
        if total > SCRATCH_MAX_ELEMENTS:
            return np.concatenate(arrays)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.dtype != dtype or len(buffer) < total:
            size = min(SCRATCH_MAX_ELEMENTS, max(total, 2 * len(buffer) if buffer is not None else total))
            buffer = self._buffers[name] = np.empty(size, dtype=dtype)
        return np.concatenate(arrays, out=buffer[:total])


_SCRATCH = _Scratch()


class _Gathered:
    """The per-position arrays of a queue's staged batches, copied one after the other as each is staged, so a
    ship cuts them without joining dozens of small arrays. One per thread, lent to one queue at a time (from its
    second staged batch to :meth:`RolloutQueue.build_staged`): memory the process has touched already, like
    :class:`_Scratch`. It holds every staged batch only while they all share one kind, have the same arrays and
    no ``span_offsets`` (the usual stream of single-rollout adds); any other batch ends it (``complete`` False)
    and the staged batches are joined at the ship instead. A batch is copied by the compiled pass that checks its
    positions (:func:`~staleness_metrics.records.validation.plain_values_of`), to where :meth:`into` says."""

    def __init__(self) -> None:
        self.owner: weakref.ref[RolloutQueue] | None = None
        self.buffers: dict[tuple[str, np.dtype[Any]], npt.NDArray[Any]] = {}  # each SCRATCH_MAX_ELEMENTS long
        self.names: tuple[str, ...] = ()
        self.kind: tuple[str | None, ...] = ()
        # (empty arrays: the staged batches have no such array)
        self.targets = PositionCopies((_NO_TOKENS, _NO_TOKENS, _NO_TOKENS, _NO_TOKENS), _NO_TOKENS)
        self.length = 0
        self.complete = False

    def lent_to(self, queue: RolloutQueue) -> bool:
        owner = self.owner() if self.owner is not None else None
        return owner is queue

    def _buffer(self, name: str, dtype: np.dtype[Any]) -> npt.NDArray[Any]:
        buffer = self.buffers.get((name, dtype))
        if buffer is None:  # (pages are touched as they are written: the unused end costs nothing)
            buffer = self.buffers[name, dtype] = np.empty(SCRATCH_MAX_ELEMENTS, dtype=dtype)
        return buffer

    def begin(self, queue: RolloutQueue, batch: RolloutBatch, kind: tuple[str | None, ...]) -> bool:
        """Lend this to ``queue`` for the staged batches from ``batch`` on (copied now); False when another queue
        holds it or ``batch`` does not fit."""
        owner = self.owner() if self.owner is not None else None
        n = len(batch.mask)
        if (owner is not None and owner is not queue) or batch.span_offsets is not None or n > SCRATCH_MAX_ELEMENTS:
            return False
        self.owner, self.kind, self.length, self.complete = weakref.ref(queue), kind, n, True
        self.names = tuple(name for name in _POSITION_ARRAYS if getattr(batch, name) is not None)
        held = {name: self._buffer(name, getattr(batch, name).dtype) for name in self.names}
        for name, buffer in held.items():
            buffer[:n] = getattr(batch, name)
        none = np.zeros(0, dtype=batch.mask.dtype)  # (not copied: the kind says no staged batch has it)
        rl, ce, ref_kl = (held.get(name, none) for name in WEIGHT_FIELDS)
        self.targets = PositionCopies((held["mask"], rl, ce, ref_kl), held.get("token_versions", _NO_TOKENS))
        return True

    def into(self, batch: RolloutBatch, kind: tuple[str | None, ...]) -> PositionCopies | None:
        """Where ``batch``'s positions go when it is staged next (from element :attr:`length` on); None (and
        ``complete`` False) when it does not fit. :meth:`advance` once they are copied."""
        if (
            kind != self.kind
            or batch.span_offsets is not None
            or (batch.token_versions is None) == bool(len(self.targets.token_versions))
            or self.length + len(batch.mask) > SCRATCH_MAX_ELEMENTS
        ):
            self.complete = False
            return None
        return self.targets

    def advance(self, copied: int) -> None:
        self.length += copied

    def release(self) -> dict[str, npt.NDArray[Any]] | None:
        """The held arrays (views valid until the next :meth:`begin`; None when they are not all the staged
        batches), and this free for the next queue."""
        held = None
        if self.complete:
            copies = dict(zip(_POSITION_ARRAYS, (*self.targets.mask_and_weights, self.targets.token_versions)))
            held = {name: copies[name][: self.length] for name in self.names}
        self.owner, self.complete = None, False
        return held


class _GatheredPerThread(threading.local):
    def __init__(self) -> None:
        self.gathered = _Gathered()


_GATHERED = _GatheredPerThread()
# Arrays every staged batch has (plainly_valid checked them): joined without looking for a missing one.
_ALWAYS_GIVEN = frozenset({"mask", "dispatch_version", "completion_version", "frozen", "label_kind"})


class _Joined(NamedTuple):
    """Where the staged batches sit in their concatenation: per batch, its first rollout, sample and position."""

    rollouts: IntArray
    samples: IntArray
    positions: IntArray
    singles: bool  # every batch one rollout of one sample (a trainer adding per rollout): the starts are 0..n


def _joined_starts(staged: Sequence[_Staged]) -> _Joined:
    n = len(staged)
    n_rollouts = list(map(attrgetter("n_rollouts"), staged))
    n_samples = list(map(attrgetter("n_samples"), staged))
    positions = np.cumsum([0, *map(attrgetter("n_positions"), staged)])
    if sum(n_rollouts) == n and sum(n_samples) == n:  # (counts are >= 1: plainly_valid checked them)
        ones = np.arange(n + 1)
        return _Joined(ones, ones, positions, True)
    return _Joined(np.cumsum([0, *n_rollouts]), np.cumsum([0, *n_samples]), positions, False)


def _concatenated(
    staged: Sequence[_Staged],
    ids: list[str],
    starts: _Joined,
    scratch: _Scratch = _SCRATCH,
    held: Mapping[str, npt.NDArray[Any]] | None = None,
) -> RolloutBatch:
    """One batch holding the staged batches one after the other (``ids``: theirs, in order), with the arrays
    cutting spans reads (copies; the per-position ones in ``scratch``, so the batch is valid until the next join
    there, or ``held``: copied at add).

    An array some batches lack is filled with what its absence means to the cut, so each sample's spans
    are those of its own batch: rl weights 1.0 on the mask (0 elsewhere), ce and ref-KL weights 0,
    ``token_versions`` -1 and no ``weight_versions`` spans (those samples' ``label_kind`` says they use
    neither).
    """
    batches = list(map(attrgetter("batch"), staged))
    n_positions = int(starts.positions[-1])
    sample_counts = list(map(attrgetter("n_samples"), staged))

    def joined(name: str, fill: Any = None) -> Any:
        if held is not None and name in _POSITION_ARRAYS:  # copied at add (every batch has it, or none)
            return held.get(name)
        values = list(map(attrgetter(name), batches))  # (C-level passes over the batches, no Python loop)
        missing = 0 if name in _ALWAYS_GIVEN else sum(map(operator.is_, values, repeat(None)))
        if missing == len(values):
            return None
        if missing:
            dtype = next(v for v in values if v is not None).dtype  # the group's (_joined_kind): a fill takes it
            values = [v if v is not None else fill(b).astype(dtype) for v, b in zip(values, batches)]  # exactly
        if name in _POSITION_ARRAYS:
            return scratch.join(name, values, n_positions)
        return np.concatenate(values)

    columns: dict[str, Any] = {
        "rl_weights": joined("rl_weights", lambda b: b.mask),
        **{name: joined(name, lambda b: np.zeros(b.n_positions)) for name in ("ce_weights", "ref_kl_weights")},
        "token_versions": joined("token_versions", lambda b: np.full(b.n_positions, -1, dtype=np.int64)),
    }
    span_offsets = [] if held is not None else list(map(attrgetter("span_offsets"), batches))  # (held: none has)
    if sum(map(operator.is_, span_offsets, repeat(None))) != len(span_offsets):
        none: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        columns["span_offsets"] = _joined_offsets(
            [o if o is not None else np.zeros(b.n_samples + 1, np.int64) for o, b in zip(span_offsets, batches)],
            sample_counts,
        )
        columns.update({name: joined(name, lambda b: none) for name in ("span_versions", "span_starts")})
    if starts.singles:  # (the offsets are the starts themselves)
        sample_offsets, position_offsets = starts.samples, starts.positions
    else:  # (a staged batch's offsets end at its sample and position counts: plainly_valid checked them)
        sample_offsets = _joined_offsets(
            list(map(attrgetter("sample_offsets"), batches)), list(map(attrgetter("n_rollouts"), staged)),
            sample_counts,
        )  # fmt: skip
        position_offsets = _joined_offsets(
            list(map(attrgetter("position_offsets"), batches)), sample_counts,
            list(map(attrgetter("n_positions"), staged)),
        )  # fmt: skip
    # (``agentic``, ``group_ids`` and ``envs`` are not joined: the cut reads none of them)
    return RolloutBatch(
        ids=ids,
        sample_offsets=sample_offsets,
        position_offsets=position_offsets,
        mask=joined("mask"),
        dispatch_version=joined("dispatch_version"),
        completion_version=joined("completion_version"),
        frozen=joined("frozen"),
        label_kind=joined("label_kind"),
        **columns,
    )


def _per_row(values: Sequence[Any], rows: npt.NDArray[np.int64]) -> list[Any]:
    return [values[i] for i in rows.tolist()]


class RolloutQueue:
    """The rows of the queued rollouts (and of those resolved since the last :meth:`compact`), their batches,
    and the ids, groups and envs of the run. ``observe_added`` is told the groups of every rollout whose rows
    are built (the policy's hook)."""

    def __init__(self, observe_added: Callable[[IntArray], None]) -> None:
        self.rollouts = Table(
            chunk=np.int64, index=np.int64, status=np.int8, judged=np.int64, frozen=np.bool_,
            dispatch=np.int64, completion=np.int64, group=np.int64, env=np.int64,
            sample_lo=np.int64, sample_hi=np.int64,
        )  # fmt: skip
        self.samples = Table(
            rollout=np.int64, local=np.int64, span_lo=np.int64, span_hi=np.int64, mask_below=np.int64,
            dropped=np.bool_, had_train=np.bool_, unmaskable=np.bool_, n_sampled=np.int64,
            n_unlabelled=np.int64, max_label=np.int64, max_sampled=np.int64, seq_min=np.int64,
            label_kind=np.int8,
        )  # fmt: skip
        self.spans = Table(
            sample=np.int64, lo=np.int64, hi=np.int64, version=np.int64, labelled=np.bool_,
            sampled=np.int64, live=np.bool_, part=np.int8,
        )  # fmt: skip
        self.ids: list[str] = []  # per rollout row
        self.row_of: dict[str, int] = {}  # queued (and recently resolved) rollouts by id
        self.seen_ids: set[str] = set()  # every id accepted in the run: ids are unique within a run
        self.chunks: list[RolloutBatch | None] = []
        self.chunk_open: list[int] = []  # rollouts of each chunk still queued
        self.closing: list[int] = []  # chunks whose last rollout left: released at the next ship
        self.groups: dict[str, int] = {}
        self.group_agentic = np.zeros(16, dtype=bool)  # per group: a member that ever entered was agentic
        self.n_groups = 0
        self.env_index: dict[str | None, int] = {None: 0}
        self.env_names: dict[int, str] = {0: ""}
        self.queued = 0
        # Conservation: sampled positions of live rollouts accepted = shipped (trained or masked)
        # + dropped + still queued.
        self._tokens_entered = 0
        # Small batches queued (ids, groups, envs and chunks registered) whose table rows are not built yet.
        self._staged: list[_Staged] = []
        self._staged_rollouts = 0
        self._staged_positions = 0
        self._gathered: _Gathered | None = None  # the thread's copies of the staged batches' positions
        self._observe_added = observe_added
        # No row before this one is queued (rows enter at the end and never return to the queue): where
        # :meth:`queued_rows` starts to look, so a ship reads the rows added since, not the table.
        self._first_queued = 0

    @property
    def tracked_rollouts(self) -> int:
        """Rollout rows held in memory: the queue plus those resolved since the last compaction."""
        return len(self.rollouts) + self._staged_rollouts

    @property
    def tokens_entered(self) -> int:
        """Sampled positions of live rollouts accepted so far (set aside at ship: taken back out)."""
        self.build_staged()
        return self._tokens_entered

    @tokens_entered.setter
    def tokens_entered(self, value: int) -> None:
        self.build_staged()
        self._tokens_entered = value

    def env(self, name: str | None) -> int:
        if name not in self.env_index:
            self.env_index[name] = len(self.env_index)
            self.env_names[self.env_index[name]] = name or ""
        return self.env_index[name]

    def _new_groups(self, count: int) -> int:
        """Register ``count`` new groups; returns the index of the first."""
        first = self.n_groups
        self.n_groups += count
        if self.n_groups > len(self.group_agentic):
            grown = np.zeros(2 * self.n_groups, dtype=bool)
            grown[:first] = self.group_agentic[:first]
            self.group_agentic = grown
        return first

    def _groups_of(self, batch: RolloutBatch, rollouts: list[int] | None) -> list[int]:
        """Group index of each rollout (None: every rollout of the batch), registering new groups (one of
        its own without group_id)."""
        assert batch.group_ids is not None and batch.agentic is not None
        names = batch.group_ids if rollouts is None else list(map(batch.group_ids.__getitem__, rollouts))
        count = len(names)
        if names.count(None) == count:  # singletons: one new group each, no lookups
            first = self._new_groups(count)
            groups = list(range(first, self.n_groups))
        else:
            groups = []
            for name in names:
                index = None if name is None else self.groups.get(name)
                if index is None:
                    index = self._new_groups(1)
                    if name is not None:
                        self.groups[name] = index
                groups.append(index)
        agentic = batch.agentic if rollouts is None else batch.agentic[rollouts]
        # (an unbuffered ufunc.at costs more than the whole add of a small batch; a list of a few, less than .any())
        if agentic.any() if count > 8 else any(agentic.tolist()):
            np.logical_or.at(self.group_agentic, groups, agentic)
        return groups

    def admit(self, batch: RolloutBatch, kept_ids: list[int] | None = None) -> tuple[int, list[int], list[int]]:
        """Queue the rollouts ``kept_ids`` of ``batch`` (None: all of them) by id, group and env (their table
        rows come after); returns the batch's chunk and the rollouts' groups and envs (lists: a single-rollout add
        builds no array)."""
        assert batch.envs is not None and batch.group_ids is not None and batch.agentic is not None
        chunk = len(self.chunks)
        row_base = len(self.rollouts) + self._staged_rollouts
        if kept_ids is None and len(batch.ids) == 1:  # (a single-rollout add, the way some trainers add: no lists)
            rid, env_name = batch.ids[0], batch.envs[0]
            env = self.env_index.get(env_name)
            self.chunks.append(batch)
            self.chunk_open.append(1)
            self.row_of[rid] = row_base
            self.ids.append(rid)
            self.seen_ids.add(rid)
            self.queued += 1
            own_group = batch.group_ids[0] is None and not batch.agentic[0]
            groups = [self._new_groups(1)] if own_group else self._groups_of(batch, None)
            return chunk, groups, [self.env(env_name) if env is None else env]
        if kept_ids is not None and len(kept_ids) == len(batch.ids):
            kept_ids = None
        self.chunks.append(batch)
        # Per-rollout lists are read through C-level map/zip, never an interpreted loop per rollout.
        ids = batch.ids if kept_ids is None else list(map(batch.ids.__getitem__, kept_ids))
        env_names = batch.envs if kept_ids is None else list(map(batch.envs.__getitem__, kept_ids))
        count = len(ids)
        self.chunk_open.append(count)
        groups = self._groups_of(batch, kept_ids)
        if count == 1:
            envs = [self.env(env_names[0])]
        else:
            env_index = {name: self.env(name) for name in set(env_names)}
            envs = [*env_index.values()] * count if len(env_index) == 1 else list(map(env_index.__getitem__, env_names))
        self.row_of.update(zip(ids, range(row_base, row_base + count)))
        self.ids.extend(ids)
        self.seen_ids.update(ids)
        self.queued += count
        return chunk, groups, envs

    def stage(self, batch: RolloutBatch) -> int | None:
        """Queue a small batch :func:`~staleness_metrics.records.validation.plainly_valid` passed (its positions
        not yet read) once its positions are plain too: how many rollouts it queued, or None (nothing queued) when
        they are not, and the exact checks are to say why. Its table rows are built by :meth:`build_staged`."""
        kind = _kind(batch)
        if len(self._staged) == 1:  # (a lone staged batch is cut as it is: copied from the second one on)
            first, lent = self._staged[0], _GATHERED.gathered
            self._gathered = lent if lent.begin(self, first.batch, first.kind) else None
        gathered = self._gathered
        into = gathered.into(batch, kind) if gathered is not None and gathered.complete else None
        if not plain_values_of(batch, into, gathered.length if gathered is not None else 0):
            return None
        n_rollouts, n_samples, n_positions = len(batch.ids), len(batch.position_offsets) - 1, len(batch.mask)
        if gathered is not None and into is not None:
            gathered.advance(n_positions)
        chunk, groups, envs = self.admit(batch)
        self._staged.append(_Staged(batch, chunk, groups, envs, kind, n_rollouts, n_samples, n_positions))
        self._staged_rollouts += n_rollouts
        self._staged_positions += n_positions
        if self._staged_positions > STAGE_FLUSH_POSITIONS:
            self.build_staged()
        return n_rollouts

    def build_staged(self) -> None:
        """Cut the staged batches into spans and append their rows: consecutive batches with the same
        arrays in one pass over their concatenation (spans never cross a sample, so each sample's spans
        are what its own batch would give), in the order they were added."""
        staged, self._staged = self._staged, []
        self._staged_rollouts = self._staged_positions = 0
        gathered, self._gathered = self._gathered, None
        held = gathered.release() if gathered is not None and gathered.lent_to(self) else None
        if held is not None and len(staged) > 1:  # every staged batch, of one kind, copied one after the other
            self._append_staged(staged, held)
            return
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

    def _append_staged(self, staged: list[_Staged], held: dict[str, npt.NDArray[Any]] | None = None) -> None:
        if len(staged) == 1:  # one batch (a replay's add between two ships): its own rows, nothing to shift
            only = staged[0]
            batch = only.batch
            verdicts = Verdicts(batch)
            spans = build_spans(batch, verdicts)
            assert not verdicts.errors, "a plainly valid batch was refused"  # plainly_valid may only err towards no
            keep = np.arange(len(batch.ids))
            groups, envs = np.array(only.groups, dtype=np.int64), np.array(only.envs, dtype=np.int64)
            self.append_rows(batch, spans, keep, np.full(len(keep), only.chunk), keep, groups, envs)
            return
        starts = _joined_starts(staged)
        first = len(self.rollouts)  # (the staged rollouts' ids are the last ones admitted)
        batch = _concatenated(staged, self.ids[first : first + int(starts.rollouts[-1])], starts, held=held)
        verdicts = Verdicts(batch)
        spans = build_spans(batch, verdicts)
        assert not verdicts.errors, "a plainly valid batch was refused"  # plainly_valid may only err towards no
        keep = np.arange(len(batch.ids))
        chunks = np.fromiter(map(attrgetter("chunk"), staged), dtype=np.int64, count=len(staged))
        if starts.singles:  # (a rollout per batch: each the first of its own)
            index, position_base = np.zeros(len(staged), dtype=np.int64), starts.positions[:-1]
        else:
            n_rollouts = np.diff(starts.rollouts)
            index = keep - np.repeat(starts.rollouts[:-1], n_rollouts)
            chunks = np.repeat(chunks, n_rollouts)
            position_base = np.repeat(starts.positions[:-1], n_rollouts)
        n = len(keep)
        groups = np.fromiter(chain.from_iterable(map(attrgetter("groups"), staged)), dtype=np.int64, count=n)
        envs = np.fromiter(chain.from_iterable(map(attrgetter("envs"), staged)), dtype=np.int64, count=n)
        # (spans at positions of the concatenation: ``position_base`` takes them back to their own batch's)
        self.append_rows(batch, spans, keep, chunks, index, groups, envs, position_base)

    def append_rows(
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
        every = len(keep) == len(batch.ids)  # (then the rows are the batch's own: no selection to build)
        if every:
            self._append_every(batch, spans, chunk, index, groups, envs, position_base)
            return
        offsets = batch.sample_offsets
        sample_lo, sample_hi = offsets[keep], offsets[keep + 1]
        samples = expand_ranges(sample_lo, sample_hi)
        span_lo, span_hi = spans.span_offsets[samples], spans.span_offsets[samples + 1]
        kept_spans = expand_ranges(span_lo, span_hi)
        sample_base, span_base, row_base = len(self.samples), len(self.spans), len(self.rollouts)
        new_sample_offsets = sample_base + np.concatenate(([0], np.cumsum(sample_hi - sample_lo)))
        new_span_offsets = span_base + np.concatenate(([0], np.cumsum(span_hi - span_lo)))
        frozen = batch.frozen[keep]
        self.rollouts.append(
            chunk=chunk, index=index, status=QUEUED, judged=NEVER, frozen=frozen,
            dispatch=batch.dispatch_version[keep], completion=spans.completion[keep], group=groups,
            env=envs, sample_lo=new_sample_offsets[:-1], sample_hi=new_sample_offsets[1:],
        )  # fmt: skip
        sample_rollout = np.repeat(np.arange(len(keep)), sample_hi - sample_lo)
        n_sampled = spans.n_sampled[samples]
        self.samples.append(
            rollout=row_base + sample_rollout, local=samples - sample_lo[sample_rollout],
            span_lo=new_span_offsets[:-1], span_hi=new_span_offsets[1:], mask_below=NO_MASK, dropped=False,
            had_train=spans.had_train[samples], unmaskable=spans.unmaskable[samples], n_sampled=n_sampled,
            n_unlabelled=spans.n_unlabelled[samples], max_label=spans.max_label[samples],
            max_sampled=spans.max_sampled_version[samples], seq_min=spans.seq_min_version[samples],
            label_kind=batch.label_kind[samples],
        )  # fmt: skip
        lo, hi = spans.lo[kept_spans], spans.hi[kept_spans]
        span_sample = np.repeat(np.arange(len(samples)), span_hi - span_lo)
        if position_base is not None:
            base = position_base[sample_rollout[span_sample]]
            lo, hi = lo - base, hi - base
        self.spans.append(
            sample=sample_base + span_sample, lo=lo, hi=hi,
            version=spans.version[kept_spans], labelled=spans.label[kept_spans] >= 0,
            sampled=spans.sampled[kept_spans], live=spans.live[kept_spans], part=spans.part[kept_spans],
        )  # fmt: skip
        self._tokens_entered += int(n_sampled[~frozen[sample_rollout]].sum())
        self._observe_added(groups)

    def _append_every(
        self,
        batch: RolloutBatch,
        spans: SpanTable,
        chunk: IntArray,
        index: IntArray,
        groups: IntArray,
        envs: IntArray,
        position_base: IntArray | None,
    ) -> None:
        """:meth:`append_rows` of every rollout of ``batch``: the batch's arrays as they are (spans moved by
        their rollout's ``position_base``, when given)."""
        assert batch.frozen is not None and batch.label_kind is not None
        offsets, n_rollouts = batch.sample_offsets, len(batch.ids)
        sample_base, span_base, row_base = len(self.samples), len(self.spans), len(self.rollouts)
        new_sample_offsets = sample_base + offsets  # (offsets start at 0: checked)
        new_span_offsets = span_base + spans.span_offsets
        frozen = batch.frozen
        self.rollouts.append(
            chunk=chunk, index=index, status=QUEUED, judged=NEVER, frozen=frozen, dispatch=batch.dispatch_version,
            completion=spans.completion, group=groups, env=envs, sample_lo=new_sample_offsets[:-1],
            sample_hi=new_sample_offsets[1:],
        )  # fmt: skip
        n_samples = batch.n_samples
        if n_samples != n_rollouts:
            one_each = False
        elif n_rollouts <= 64:  # (a short list compared in Python costs less than numpy calls)
            one_each = offsets.tolist() == list(range(n_rollouts + 1))
        else:
            one_each = bool((offsets == np.arange(n_rollouts + 1)).all())
        if one_each:  # (a sample per rollout, the usual record: no repeat to build)
            sample_rollout = np.arange(n_rollouts)
            local: IntArray | int = 0
        else:
            sample_rollout = np.repeat(np.arange(n_rollouts), offsets[1:] - offsets[:-1])
            local = np.arange(n_samples) - offsets[:-1][sample_rollout]
        n_sampled = spans.n_sampled
        self.samples.append(
            rollout=row_base + sample_rollout, local=local, span_lo=new_span_offsets[:-1],
            span_hi=new_span_offsets[1:], mask_below=NO_MASK, dropped=False, had_train=spans.had_train,
            unmaskable=spans.unmaskable, n_sampled=n_sampled, n_unlabelled=spans.n_unlabelled,
            max_label=spans.max_label, max_sampled=spans.max_sampled_version, seq_min=spans.seq_min_version,
            label_kind=batch.label_kind,
        )  # fmt: skip
        lo, hi = spans.lo, spans.hi
        if position_base is not None:
            base = position_base[sample_rollout[spans.sample]]
            lo, hi = lo - base, hi - base
        self.spans.append(
            sample=sample_base + spans.sample, lo=lo, hi=hi, version=spans.version, labelled=spans.label >= 0,
            sampled=spans.sampled, live=spans.live, part=spans.part,
        )  # fmt: skip
        if n_samples <= 64:  # (Python over short lists costs less than numpy calls)
            if True in frozen.tolist():
                self._tokens_entered += int(n_sampled[~frozen[sample_rollout]].sum())
            else:
                self._tokens_entered += sum(n_sampled.tolist())
        else:
            self._tokens_entered += int(n_sampled[~frozen[sample_rollout]].sum())
        self._observe_added(groups)

    def queued_rows(self) -> IntArray:
        """The rows of the queued rollouts, ascending (staged ones not included: :meth:`build_staged` first)."""
        start = self._first_queued
        rows = np.flatnonzero(self.rollouts["status"][start:] == QUEUED)
        if start:
            rows += start
        self._first_queued = int(rows[0]) if len(rows) else len(self.rollouts)
        return rows

    def queued_tokens(self, rows: IntArray) -> int:
        r, s = self.rollouts, self.samples
        sample_rows = expand_ranges(r["sample_lo"][rows], r["sample_hi"][rows])
        live = ~r["frozen"][s["rollout"][sample_rows]] & ~s["dropped"][sample_rows]
        return int(s["n_sampled"][sample_rows][live].sum())

    def leave(self, rows: IntArray, status: int) -> None:
        self.rollouts["status"][rows] = status
        self.queued -= len(rows)
        chunks = self.rollouts["chunk"][rows]
        chunk_open, closing = self.chunk_open, self.closing
        if len(chunks) <= 256:  # (a few rollouts: one step each over a list, where numpy's sort costs more)
            listed = chunks.tolist()
            if listed and listed.count(listed[0]) == len(listed):  # (one chunk: a ship of one batch)
                chunk = listed[0]
                chunk_open[chunk] -= len(listed)
                if not chunk_open[chunk]:
                    closing.append(chunk)
                return
            for chunk in listed:  # (each rollout of its own chunk: a ship of single-rollout adds)
                left = chunk_open[chunk] - 1
                chunk_open[chunk] = left
                if not left:
                    closing.append(chunk)
            return
        for chunk, count in zip(*(a.tolist() for a in np.unique(chunks, return_counts=True))):
            chunk_open[chunk] -= count
            if not chunk_open[chunk]:
                closing.append(chunk)

    def release_chunks(self) -> None:
        """Let go of the batches no queued rollout needs: only those that closed since the last ship, so a
        ship costs nothing per batch ever added."""
        for chunk in self.closing:
            self.chunks[chunk] = None
        self.closing = []

    def compact(self) -> None:
        """Forget rollouts that left the sink: the tables keep only queued ones (bounded memory)."""
        self.rollouts, self.samples, self.spans, self.chunks, self.chunk_open, self.ids = self.compacted()
        self.row_of = {rid: row for row, rid in enumerate(self.ids)}
        self._first_queued = 0  # (renumbered)
        self.closing = []  # chunks closing now have no queued rollout: they are not kept

    def compacted(self) -> tuple[Table, Table, Table, list[RolloutBatch | None], list[int], list[str]]:
        """The tables, chunks, open counts and ids of the queued rollouts only, renumbered: new objects (the
        sink is not changed, so a checkpoint may take them at any moment)."""
        r, s = self.rollouts, self.samples
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
        spans = self.spans.take(span_rows, sample=np.repeat(np.arange(len(sample_rows)), span_counts))
        return (
            rollouts, samples, spans, [self.chunks[c] for c in chunks.tolist()],
            [self.chunk_open[c] for c in chunks.tolist()], [self.ids[row] for row in keep.tolist()],
        )  # fmt: skip

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The queue as plain data: a compacted copy (the queued rollouts only, renumbered, with the batches they
        need); the queue is left as it was."""
        self.build_staged()
        rollouts, samples, spans, chunks, chunk_open, ids = self.compacted()
        envs = sorted(self.env_index.items(), key=lambda item: item[1])
        return {
            "queued": self.queued,
            "tokens_entered": self._tokens_entered,
            "tables": {
                "rollouts": encode_table(rollouts),
                "samples": encode_table(samples),
                "spans": encode_table(spans),
            },
            "ids": ids,
            "seen_ids": sorted(self.seen_ids),
            "chunks": [encode_batch(batch) for batch in chunks if batch is not None],  # a queued rollout's never is
            "chunk_open": chunk_open,
            "groups": [list(item) for item in sorted(self.groups.items(), key=lambda item: item[1])],
            "group_agentic": self.group_agentic[: self.n_groups].tolist(),
            "n_groups": self.n_groups,
            "envs": [name for name, _ in envs],
        }

    def read_state(self, state: Mapping[str, Any], path: str = "", step: int = 0) -> RolloutQueue:
        """A new queue holding :meth:`state_dict`'s ``state`` (the :data:`QUEUE_KEYS` of it), checked: structure,
        dtypes, ranges, and that ids, rows, chunks and counts agree, so no later write can stray. ``step`` is the
        latest step of the sink that saved it (no row was judged after it). This queue is not changed (its tables
        only lend their column dtypes); a bad state raises ``ConfigError`` naming the key path."""
        tables = keys(state["tables"], join(path, "tables"), ("rollouts", "samples", "spans"))
        r = decode_table(tables["rollouts"], self.rollouts, join(path, "tables.rollouts"))
        s = decode_table(tables["samples"], self.samples, join(path, "tables.samples"))
        n = decode_table(tables["spans"], self.spans, join(path, "tables.spans"))
        rows, where_r, where_s, where_n = (
            len(r),
            join(path, "tables.rollouts"),
            join(path, "tables.samples"),
            join(path, "tables.spans"),
        )
        ids = strings(state["ids"], join(path, "ids"), unique=True)
        if len(ids) != rows:
            fail(join(path, "ids"), f"{len(ids)} ids for {rows} rollout rows")
        queued = integer(state["queued"], join(path, "queued"), 0)
        if queued != rows:
            fail(join(path, "queued"), f"{queued}, but the checkpoint holds {rows} queued rollouts")
        seen = strings(state["seen_ids"], join(path, "seen_ids"), unique=True)
        seen_ids = set(seen)
        if not seen_ids.issuperset(ids):
            fail(join(path, "seen_ids"), f"lacks the queued id {next(i for i in ids if i not in seen_ids)!r}")

        where = join(path, "chunks")
        chunks = [decode_batch(c, join(where, i)) for i, c in enumerate(sequence(state["chunks"], where))]
        open_ = sequence(state["chunk_open"], join(path, "chunk_open"), len(chunks))
        chunk_open = [integer(v, join(join(path, "chunk_open"), i), 1) for i, v in enumerate(open_)]

        n_groups = integer(state["n_groups"], join(path, "n_groups"), 0)
        agentic = sequence(state["group_agentic"], join(path, "group_agentic"), n_groups)
        group_agentic = np.zeros(max(16, 2 * n_groups), dtype=bool)
        group_agentic[:n_groups] = [boolean(v, join(join(path, "group_agentic"), i)) for i, v in enumerate(agentic)]
        groups: dict[str, int] = {}
        for i, pair in enumerate(sequence(state["groups"], join(path, "groups"))):
            name, index = sequence(pair, join(join(path, "groups"), i), 2)
            name = string(name, join(join(join(path, "groups"), i), 0))
            index = integer(index, join(join(join(path, "groups"), i), 1), 0, n_groups - 1)
            if name in groups:
                fail(join(join(path, "groups"), i), f"group {name!r} appears twice")
            groups[name] = index
        if len(set(groups.values())) != len(groups):
            fail(join(path, "groups"), "two group names share an index")
        envs = strings(state["envs"], join(path, "envs"), optional=True, unique=True)
        if not envs or envs[0] is not None:
            fail(join(path, "envs"), "the first env is null (rollouts without one)")

        # Rollout rows: queued, each one rollout of a chunk, agreeing with what that chunk says of it.
        status = r["status"]
        if (status != QUEUED).any():
            fail(join(where_r, "status"), "a checkpoint holds queued rollouts only")
        chunk, index = r["chunk"], r["index"]
        if ((chunk < 0) | (chunk >= len(chunks))).any():
            fail(join(where_r, "chunk"), f"values are chunk numbers, 0..{len(chunks) - 1}")
        if np.bincount(chunk, minlength=len(chunks)).tolist() != chunk_open:
            fail(join(path, "chunk_open"), "does not count the queued rollouts of each chunk")
        for name, values, high in (("judged", r["judged"], step), ("group", r["group"], n_groups - 1),
                                   ("env", r["env"], len(envs) - 1)):  # fmt: skip
            low = NEVER if name == "judged" else 0
            if rows and (int(values.min()) < low or int(values.max()) > high):
                fail(join(where_r, name), f"values lie in {low}..{high}")
        check_offsets(np.concatenate((r["sample_lo"][:1], r["sample_hi"])) if rows else np.zeros(1, dtype=np.int64),
                 join(where_r, "sample_hi"), rows + 1, len(s))  # fmt: skip
        if (r["sample_lo"][1:] != r["sample_hi"][:-1]).any():
            fail(join(where_r, "sample_lo"), "each rollout's samples start where the previous one's end")
        sample_counts = r["sample_hi"] - r["sample_lo"]
        sample_owner = np.repeat(np.arange(rows), sample_counts)
        if not np.array_equal(s["rollout"], sample_owner):
            fail(join(where_s, "rollout"), "does not name the rollout row each sample belongs to")
        expected_local = np.arange(len(s)) - r["sample_lo"][sample_owner]
        if not np.array_equal(s["local"], expected_local):
            fail(join(where_s, "local"), "samples are numbered 0, 1, ... within their rollout")
        sample_in_batch = np.zeros(len(s), dtype=np.int64)
        position_lo = np.zeros(len(s), dtype=np.int64)
        position_hi = np.zeros(len(s), dtype=np.int64)
        has_tokens = np.zeros(len(s), dtype=bool)
        seen_pairs: set[tuple[int, int]] = set()
        # Rows and samples grouped by chunk once (stable: in row order), not one scan of all rows per chunk.
        row_order = np.argsort(chunk, kind="stable")
        row_bounds = np.searchsorted(chunk[row_order], np.arange(len(chunks) + 1))
        sample_chunk = chunk[sample_owner]
        sample_order = np.argsort(sample_chunk, kind="stable")
        sample_bounds = np.searchsorted(sample_chunk[sample_order], np.arange(len(chunks) + 1))
        for c, batch in enumerate(chunks):
            mine = row_order[row_bounds[c] : row_bounds[c + 1]]
            k = index[mine]
            if ((k < 0) | (k >= batch.n_rollouts)).any():
                fail(join(where_r, "index"), f"chunk {c} holds rollouts 0..{batch.n_rollouts - 1}")
            if len(np.unique(k)) != len(k):
                fail(join(where_r, "index"), f"one rollout of chunk {c} is queued twice")
            seen_pairs.update(zip([c] * len(k), k.tolist()))
            assert batch.frozen is not None and batch.group_ids is not None and batch.envs is not None
            assert batch.label_kind is not None
            checks = (
                ("id", _per_row(batch.ids, k), _per_row(ids, mine)),
                ("frozen", batch.frozen[k].tolist(), r["frozen"][mine].tolist()),
                ("dispatch", batch.dispatch_version[k].tolist(), r["dispatch"][mine].tolist()),
                ("env", _per_row(batch.envs, k), [envs[e] for e in r["env"][mine].tolist()]),
                (
                    "sample_hi",
                    np.diff(batch.sample_offsets)[k].tolist(),
                    (r["sample_hi"] - r["sample_lo"])[mine].tolist(),
                ),
            )
            for name, theirs, ours in checks:
                if theirs != ours:
                    row = int(mine[next(i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b)])
                    key = "ids" if name == "id" else f"tables.rollouts.{name}"
                    fail(join(path, key), f"row {row} disagrees with rollout {int(index[row])} of chunk {c}")
            for row, name in zip(mine.tolist(), _per_row(batch.group_ids, k)):
                if name is not None and groups.get(name) != int(r["group"][row]):
                    fail(join(where_r, "group"), f"row {row} is not in the group of {name!r}")
            owned = sample_order[sample_bounds[c] : sample_bounds[c + 1]]
            sample_in_batch[owned] = batch.sample_offsets[index[sample_owner[owned]]] + s["local"][owned]
            position_lo[owned] = batch.position_offsets[sample_in_batch[owned]]
            position_hi[owned] = batch.position_offsets[sample_in_batch[owned] + 1]
            has_tokens[owned] = batch.token_versions is not None
            if not np.array_equal(s["label_kind"][owned], batch.label_kind[sample_in_batch[owned]]):
                fail(join(where_s, "label_kind"), f"disagrees with chunk {c}")
            mask = batch.mask[expand_ranges(position_lo[owned], position_hi[owned])]
            if ((mask != 0) & (mask != 1)).any():
                fail(join(join(where, c), "mask"), "the mask values of queued rollouts are 0 or 1")

        # Samples and spans: spans tile each sample's rows and stay inside its positions in the batch.
        check_offsets(np.concatenate((s["span_lo"][:1], s["span_hi"])) if len(s) else np.zeros(1, dtype=np.int64),
                 join(where_s, "span_hi"), len(s) + 1, len(n))  # fmt: skip
        if (s["span_lo"][1:] != s["span_hi"][:-1]).any():
            fail(join(where_s, "span_lo"), "each sample's spans start where the previous one's end")
        if ((s["mask_below"] < NO_MASK) | (s["mask_below"] > max(step, 0))).any():
            fail(join(where_s, "mask_below"), f"thresholds lie in {NO_MASK}..{step}")
        if ((s["n_sampled"] < 0) | (s["n_unlabelled"] < 0) | (s["n_unlabelled"] > s["n_sampled"])).any():
            fail(join(where_s, "n_unlabelled"), "counts are 0..n_sampled")
        if (s["n_sampled"] > position_hi - position_lo).any():
            fail(join(where_s, "n_sampled"), "more sampled positions than the sample has")
        span_owner = np.repeat(np.arange(len(s)), s["span_hi"] - s["span_lo"])
        if not np.array_equal(n["sample"], span_owner):
            fail(join(where_n, "sample"), "does not name the sample row each span belongs to")
        lo, hi, part = n["lo"], n["hi"], n["part"]
        if ((lo < position_lo[span_owner]) | (hi < lo) | (hi > position_hi[span_owner])).any():
            fail(join(where_n, "lo"), "a span reaches outside its sample's positions")
        if ((n["sampled"] < 0) | (n["sampled"] > hi - lo)).any():
            fail(join(where_n, "sampled"), "more sampled positions than the span has")
        if ((part != PART_WHOLE) & (part != PART_LABELLED) & (part != PART_UNLABELLED)).any():
            fail(join(where_n, "part"), "values are 0 (whole), 1 (labelled) and 2 (unlabelled)")
        first, second = np.flatnonzero(part == PART_LABELLED), np.flatnonzero(part == PART_UNLABELLED)
        if not np.array_equal(first + 1, second) or not np.array_equal(
            span_owner[first], span_owner[second[: len(first)]]
        ):
            fail(join(where_n, "part"), "a labelled part is followed by its unlabelled part, in the same sample")
        if ((part != PART_WHOLE) & ~has_tokens[span_owner]).any():
            fail(join(where_n, "part"), "a mixed span in a batch without token versions")
        if len(seen_pairs) != rows:  # pragma: no cover - follows from the per-chunk uniqueness
            fail(join(where_r, "index"), "one rollout is queued twice")
        tokens_entered = integer(state["tokens_entered"], join(path, "tokens_entered"), 0)

        queue = RolloutQueue(self._observe_added)
        queue.rollouts, queue.samples, queue.spans = r, s, n
        queue.ids, queue.row_of, queue.seen_ids = ids, {rid: row for row, rid in enumerate(ids)}, seen_ids
        queue.chunks, queue.chunk_open = list(chunks), chunk_open
        queue.groups, queue.n_groups, queue.group_agentic = groups, n_groups, group_agentic
        queue.env_index = {name: i for i, name in enumerate(envs)}
        queue.env_names = {i: name or "" for i, name in enumerate(envs)}
        queue.queued, queue._tokens_entered = queued, tokens_entered
        return queue

    def load_state_dict(self, state: Mapping[str, Any], path: str = "", step: int = 0) -> None:
        """Continue from :meth:`state_dict`: all of it (:meth:`read_state` checks it first), or nothing."""
        checked = self.read_state(state, path, step)
        vars(self).update(vars(checked))
