"""The queue of a sink (SPEC 4): typed growable tables of the queued rollouts, samples and spans,
and the batches they arrived in (masked in place). Small valid adds are staged, cut in one pass."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar, overload

import numpy as np
import numpy.typing as npt

from ..errors import TraceError
from ..records.columnar import PER_POSITION_FLOATS, PER_ROLLOUT_ARRAYS, WEIGHT_FIELDS, RolloutBatch
from ..records.validation import Verdicts, plain_values_of
from .cuts import SpanTable
from .decision import NO_MASK
from .segments import IntArray, expand_ranges
from .spans import build_spans

QUEUED, SHIPPED, DROPPED, INVALID = 0, 1, 2, 3  # a rollout row's status
PENDING = 4  # a read-ahead window's rollout whose add has not come (the last rows)
COMPACT_MIN_ROWS = 4096  # below this many rows, forgetting is not worth a copy
NEVER = -1  # the step of a rollout not judged yet
STAGE_MAX_POSITIONS = 1 << 16  # a longer batch is cut at its add
STAGE_FLUSH_POSITIONS = 1 << 20  # staged positions beyond it are cut at once (bounded memory)

Kind = tuple[str | None, ...]
ScalarT = TypeVar("ScalarT", bound=np.generic)
TableT = TypeVar("TableT", bound="Table")


class Column(Generic[ScalarT]):
    """A :class:`Table` column: ``table.name`` is a view of its live rows (written in place)."""

    def __init__(self, dtype: type[ScalarT]) -> None:
        self.dtype = np.dtype(dtype)
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, table: None, owner: type) -> Column[ScalarT]: ...
    @overload
    def __get__(self, table: Table, owner: type) -> npt.NDArray[ScalarT]: ...
    def __get__(self, table: Table | None, owner: type) -> Column[ScalarT] | npt.NDArray[ScalarT]:
        return self if table is None else table.arrays[self.name][: len(table)]


class Table:
    """Columns of equal length (:class:`Column` attributes), grown by appending arrays."""

    columns: ClassVar[dict[str, np.dtype[Any]]] = {}

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        cls.columns = {name: c.dtype for name, c in vars(cls).items() if isinstance(c, Column)}

    def __init__(self) -> None:
        self._capacity = 16
        self.arrays: dict[str, npt.NDArray[Any]] = {name: np.zeros(16, dtype=d) for name, d in self.columns.items()}
        self._size = 0
        self._set_views()

    def __len__(self) -> int:
        return self._size

    def append(self, **values: npt.ArrayLike) -> int:
        """Append equal-length arrays (or scalars) for every column; the first new row."""
        columns = self.arrays
        n = next(len(v) for v in values.values() if isinstance(v, np.ndarray) and v.ndim)
        start = self._size
        needed = start + n
        if needed > self._capacity:  # (every column has the same capacity: recorded once all grew)
            capacity = max(needed, 2 * self._capacity)
            columns = {name: np.pad(c[:start], (0, capacity - start)) for name, c in columns.items()}
            self.arrays, self._capacity = columns, capacity
        for name, column in columns.items():
            column[start:needed] = values[name]
        self._size = needed
        self._set_views()
        return start

    def _set_views(self) -> None:
        # each column's live rows as a plain attribute, which a read finds before the Column
        vars(self).update({name: column[: self._size] for name, column in self.arrays.items()})

    def truncate(self, size: int) -> None:
        """Forget the rows from ``size`` on."""
        self._size = size
        self._set_views()

    def take(self: TableT, rows: npt.NDArray[np.int64], **replace: npt.ArrayLike) -> TableT:
        """A new table of the given rows; ``replace`` gives new values for columns."""
        taken = type(self)()
        taken.append(**{name: replace.get(name, getattr(self, name)[rows]) for name in self.arrays})
        return taken


class RolloutRows(Table):
    """One row per rollout: where it arrived, where it is, and what the policies read of it."""

    chunk = Column(np.int64)  # the batch it arrived in (the queue's ``chunks``)
    index = Column(np.int64)  # its rollout number in that batch
    status = Column(np.int8)  # queue.QUEUED, SHIPPED, DROPPED, INVALID or PENDING
    judged = Column(np.int64)  # the last step that judged it (queue.NEVER: none yet)
    frozen = Column(np.bool_)
    dispatch = Column(np.int64)
    completion = Column(np.int64)
    group = Column(np.int64)  # the queue's group index
    env = Column(np.int64)  # the queue's env index (0: none)
    sample_lo = Column(np.int64)  # its sample rows
    sample_hi = Column(np.int64)


class SampleRows(Table):
    """One row per sample: its spans, its masking threshold and what the cut found in it."""

    rollout = Column(np.int64)  # its rollout row
    local = Column(np.int64)  # its number within its rollout
    span_lo = Column(np.int64)  # its span rows
    span_hi = Column(np.int64)
    mask_below = Column(np.int64)  # versions below this are masked (decision.NO_MASK: none)
    dropped = Column(np.bool_)
    had_train = Column(np.bool_)
    unmaskable = Column(np.bool_)
    n_sampled = Column(np.int64)
    n_unlabelled = Column(np.int64)
    max_label = Column(np.int64)
    max_sampled = Column(np.int64)
    seq_min = Column(np.int64)
    label_kind = Column(np.int8)


class SpanRows(Table):
    """One row per span: a range of positions of one version label and one mask value."""

    sample = Column(np.int64)  # its sample row
    lo = Column(np.int64)  # positions in its rollout's batch
    hi = Column(np.int64)
    version = Column(np.int64)
    labelled = Column(np.bool_)
    sampled = Column(np.int64)
    live = Column(np.bool_)
    part = Column(np.int8)  # spans.PART_WHOLE, PART_LABELLED or PART_UNLABELLED


class Ahead(NamedTuple):
    """The pending rows of a read-ahead window (:meth:`RolloutQueue.add_part`)."""

    batch: RolloutBatch
    first: int  # the window's rollout of the first row appended
    row: int  # that row
    tokens: IntArray  # live sampled positions before each rollout from ``first`` on (cumulative)
    next: int  # the rollout whose add comes next


class Staged(NamedTuple):
    """A batch queued by an add whose spans are not cut yet."""

    batch: RolloutBatch
    chunk: int
    groups: list[int]
    envs: list[int]
    kind: Kind  # the element types of the mask and weight arrays (None: none)


# (``dtype.str`` builds a new string each time)
_DTYPE_STRS: dict[np.dtype[Any], str] = {}


def kind_of(batch: RolloutBatch) -> Kind:
    arrays = (batch.mask, batch.rl_weights, batch.ce_weights, batch.ref_kl_weights)
    try:
        return tuple(None if a is None else _DTYPE_STRS[a.dtype] for a in arrays)
    except KeyError:
        _DTYPE_STRS.update((a.dtype, a.dtype.str) for a in arrays if a is not None)
        return kind_of(batch)


def _joined_kind(kind: Kind, other: Kind) -> Kind | None:
    """The kind of a run of ``kind`` joined by a batch of ``other``; None if they differ."""
    if kind == other:  # (the usual case)
        return kind
    if any(a is not None and b is not None and a != b for a, b in zip(kind, other)):
        return None
    return tuple(a if a is not None else b for a, b in zip(kind, other))


def runs_of(staged: Sequence[Staged]) -> list[Sequence[Staged]]:
    """The staged batches in runs that can be cut together (kinds that agree), in order."""
    runs: list[Sequence[Staged]] = []
    start = 0
    while start < len(staged):
        end, kind = start + 1, staged[start].kind
        while end < len(staged) and (next_kind := _joined_kind(kind, staged[end].kind)) is not None:
            kind, end = next_kind, end + 1
        runs.append(staged[start:end])
        start = end
    return runs


def _joined_offsets(parts: Sequence[IntArray], counts: Sequence[int], ends: Sequence[int]) -> IntArray:
    """Offsets into the concatenation of the parts ``parts`` index."""
    bases = np.cumsum([0, *ends])
    if list(counts) == [1] * len(counts):
        return bases.astype(np.int64)
    starts = np.concatenate([p[:-1] for p in parts])
    starts += np.repeat(bases[:-1], counts).astype(starts.dtype, copy=False)
    return np.concatenate([starts, bases[-1:].astype(starts.dtype, copy=False)])


def rollouts_of(batch: RolloutBatch, rollouts: IntArray, mask: npt.NDArray[Any] | None = None) -> RolloutBatch:
    """The ``rollouts`` of ``batch`` as a new batch (views where consecutive; ``mask``: read instead)."""
    samples = expand_ranges(batch.sample_offsets[rollouts], batch.sample_offsets[rollouts + 1])
    positions = _items_of(batch.position_offsets, samples)
    part = copy.copy(batch)  # (checked and converted already: no __post_init__ again)
    part.mask = (batch.mask if mask is None else mask)[positions]
    part.ids = [batch.ids[i] for i in rollouts.tolist()]
    part.sample_offsets = _offsets(batch.sample_offsets, rollouts)
    part.position_offsets = _offsets(batch.position_offsets, samples)
    for name in PER_ROLLOUT_ARRAYS:
        if (values := getattr(batch, name)) is not None:
            setattr(part, name, values[rollouts] if isinstance(values, np.ndarray) else
                    [values[i] for i in rollouts.tolist()])  # fmt: skip
    for name in (*PER_POSITION_FLOATS, "token_versions"):
        if (values := getattr(batch, name)) is not None:
            setattr(part, name, values[positions])
    if batch.label_kind is not None:
        part.label_kind = batch.label_kind[samples]
    if batch.span_offsets is not None and batch.span_versions is not None and batch.span_starts is not None:
        spans = _items_of(batch.span_offsets, samples)
        part.span_offsets = _offsets(batch.span_offsets, samples)
        part.span_versions, part.span_starts = batch.span_versions[spans], batch.span_starts[spans]
    part.present = {name: flags[samples] for name, flags in batch.present.items()}
    if batch.padded is not None and not np.array_equal(rollouts, np.arange(batch.n_rollouts)):
        part.padded = None  # (the rows of a padded batch are kept only when all of it is)
    return part


def _items_of(offsets: IntArray, groups: IntArray) -> slice | npt.NDArray[Any]:
    """What indexes the items ``offsets[g]:offsets[g + 1]`` of each of ``groups`` in turn."""
    if not len(groups):
        return slice(0, 0)
    first, last = int(groups[0]), int(groups[-1])
    if last - first + 1 == len(groups) and (np.diff(groups) == 1).all():
        return slice(int(offsets[first]), int(offsets[last + 1]))
    if (np.diff(groups) > 0).all():
        chosen = np.zeros(len(offsets) - 1, dtype=bool)
        chosen[groups] = True
        return np.repeat(chosen, np.diff(offsets))
    return expand_ranges(offsets[groups], offsets[groups + 1])


def _offsets(offsets: IntArray, items: IntArray) -> IntArray:
    return np.concatenate(([0], np.cumsum(offsets[items + 1] - offsets[items]))).astype(np.int64)


class Joined(NamedTuple):
    batch: RolloutBatch
    chunk: IntArray  # per rollout: its batch's chunk
    number: IntArray  # per rollout: its index in its own batch
    position_base: IntArray  # per rollout: where its own batch starts in the joined positions
    groups: IntArray
    envs: IntArray


def joined(run: Sequence[Staged], ids: list[str]) -> Joined:
    """The staged batches of ``run`` as one batch of the arrays the cut reads."""
    batches = [item.batch for item in run]
    n_rollouts = [b.n_rollouts for b in batches]
    n_samples = [b.n_samples for b in batches]
    n_positions = [b.n_positions for b in batches]

    def join(name: str, fill: Any = None) -> Any:
        values = [getattr(b, name) for b in batches]
        given = [v for v in values if v is not None]
        if not given:
            return None
        if len(given) < len(values):  # filled exactly, in the run's dtype (_joined_kind)
            values = [v if v is not None else fill(b).astype(given[0].dtype) for v, b in zip(values, batches)]
        return np.concatenate(values)

    columns: dict[str, Any] = {
        "rl_weights": join("rl_weights", lambda b: b.mask),
        **{name: join(name, lambda b: np.zeros(b.n_positions)) for name in WEIGHT_FIELDS[1:]},
        "token_versions": join("token_versions", lambda b: np.full(b.n_positions, -1, dtype=np.int64)),
    }
    if any(b.span_offsets is not None for b in batches):
        span_offsets = [b.span_offsets if b.span_offsets is not None else np.zeros(b.n_samples + 1, np.int64)
                        for b in batches]  # fmt: skip
        columns["span_offsets"] = _joined_offsets(span_offsets, n_samples, [int(o[-1]) for o in span_offsets])
        columns.update({name: join(name, lambda b: np.zeros(0, np.int64)) for name in ("span_versions", "span_starts")})
    batch = RolloutBatch(
        ids=ids,
        sample_offsets=_joined_offsets([b.sample_offsets for b in batches], n_rollouts, n_samples),
        position_offsets=_joined_offsets([b.position_offsets for b in batches], n_samples, n_positions),
        mask=join("mask"),
        dispatch_version=join("dispatch_version"),
        completion_version=join("completion_version"),
        frozen=join("frozen"),
        label_kind=join("label_kind"),
        **columns,
    )
    index = np.concatenate([np.arange(n) for n in n_rollouts])
    position_base = np.repeat(np.cumsum([0, *n_positions[:-1]]), n_rollouts)
    return Joined(
        batch, np.repeat([item.chunk for item in run], n_rollouts).astype(np.int64), index, position_base,
        np.array([g for item in run for g in item.groups], dtype=np.int64),
        np.array([e for item in run for e in item.envs], dtype=np.int64),
    )  # fmt: skip


class RolloutQueue:
    """The rows of the queued rollouts, their batches, and the ids, groups and envs of the run."""

    def __init__(self, observe_added: Callable[[IntArray], None]) -> None:
        self.rollouts = RolloutRows()
        self.samples = SampleRows()
        self.spans = SpanRows()
        self.ids: list[str] = []  # per rollout row
        self.row_of: dict[str, int] = {}  # queued (and recently resolved) rollouts by id
        self.seen_ids: set[str] = set()  # every id accepted in the run: ids are unique within a run
        self.chunks: list[RolloutBatch | None] = []
        self.windows: set[int] = set()  # chunks of replay's read-ahead windows (its copies)
        self.chunk_open: list[int] = []  # rollouts of each chunk still queued
        self.closing: list[int] = []  # chunks whose last rollout left: released at the next ship
        self.groups: dict[str, int] = {}
        self.group_agentic = np.zeros(16, dtype=bool)
        self.n_groups = 0
        self.env_index: dict[str | None, int] = {None: 0}
        self.env_names: dict[int, str] = {0: ""}
        self.queued = 0
        self._tokens_entered = 0  # (conservation: = shipped + dropped + queued)
        self._staged: list[Staged] = []  # small batches queued, their rows not built yet
        self.refused: list[tuple[TraceError, str | None]] = []  # staged, changed since: set aside
        self._ahead: Ahead | None = None
        self._staged_positions = 0
        self._observe_added = observe_added
        self._first_queued = 0  # no row before this one is queued

    @property
    def tracked_rollouts(self) -> int:
        return len(self.ids)  # (every row but the pending ones, and the staged rollouts)

    @property
    def tokens_entered(self) -> int:
        self.build_staged()
        return self._tokens_entered

    @property
    def tokens_queued(self) -> int:
        self.build_staged()
        return self.queued_tokens(np.flatnonzero(self.rollouts.status == QUEUED))

    def env(self, name: str | None) -> int:
        if name not in self.env_index:
            self.env_index[name] = len(self.env_index)
            self.env_names[self.env_index[name]] = name or ""
        return self.env_index[name]

    def rows_named(self, ids: Iterable[str]) -> IntArray:
        self.build_staged()
        row_of = self.row_of
        rows: IntArray = np.unique(np.array([row_of[i] for i in ids if i in row_of], dtype=np.int64))
        queued: IntArray = rows[self.rollouts.status[rows] == QUEUED]
        return queued

    def batches_of(self, chunks: Iterable[int]) -> dict[int, RolloutBatch]:
        found = {c: self.chunks[c] for c in chunks}
        assert None not in found.values(), "a queued rollout's batch is kept"
        return found  # type: ignore[return-value]

    def named_groups(self) -> IntArray:
        """The named groups' indices in order: a checkpoint's groups ``0, 1, ...``."""
        return np.array(sorted(self.groups.values()), dtype=np.int64)

    def _new_groups(self, count: int) -> int:
        first = self.n_groups
        self.n_groups += count
        if self.n_groups > len(self.group_agentic):
            self.group_agentic = np.pad(self.group_agentic[:first], (0, 2 * self.n_groups - first))
        return first

    def _groups_of(self, batch: RolloutBatch, rollouts: list[int] | None) -> list[int]:
        """Group index of each rollout (None: all), registering new ones."""
        assert batch.group_ids is not None and batch.agentic is not None
        names = batch.group_ids if rollouts is None else list(map(batch.group_ids.__getitem__, rollouts))
        if names.count(None) == len(names):  # singletons: one new group each, no lookups
            first = self._new_groups(len(names))
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
        if agentic.any():  # (an unbuffered ufunc.at costs more than the whole add of a small batch)
            np.logical_or.at(self.group_agentic, groups, agentic)
        return groups

    def admit(self, batch: RolloutBatch, kept_ids: list[int] | None = None) -> tuple[int, list[int], list[int]]:
        """Register the rollouts ``kept_ids`` of ``batch``: its chunk, their groups and envs."""
        assert batch.envs is not None and batch.group_ids is not None and batch.agentic is not None
        if kept_ids is not None and len(kept_ids) == len(batch.ids):
            kept_ids = None
        chunk, row_base = len(self.chunks), len(self.ids)
        self.chunks.append(batch)
        ids = batch.ids if kept_ids is None else list(map(batch.ids.__getitem__, kept_ids))
        env_names = batch.envs if kept_ids is None else list(map(batch.envs.__getitem__, kept_ids))
        count = len(ids)
        self.chunk_open.append(count)
        if count == 1 and kept_ids is None and batch.group_ids[0] is None and not batch.agentic[0]:
            groups = [self._new_groups(1)]  # (the usual single add: no look-ups)
        else:
            groups = self._groups_of(batch, kept_ids)
        env = self.env_index.get(env_names[0])
        if env is not None and env_names.count(env_names[0]) == count:
            envs = [env] * count
        else:
            envs = list(map(self.env, env_names))
        self.row_of.update(zip(ids, range(row_base, row_base + count)))
        self.ids.extend(ids)
        self.seen_ids.update(ids)
        self.queued += count
        return chunk, groups, envs

    def add_checked(self, batch: RolloutBatch, spans: SpanTable, kept_ids: list[int] | None = None) -> None:
        self.build_staged()  # (rows are built in the order rollouts entered)
        self.drop_ahead()
        chunk, groups, envs = self.admit(batch, kept_ids)
        kept = np.arange(batch.n_rollouts) if kept_ids is None else np.array(kept_ids, dtype=np.int64)
        # one append per run of consecutive rollouts kept (one run unless some were refused)
        starts = [0, *(np.flatnonzero(np.diff(kept) != 1) + 1).tolist()] if len(kept) else []
        for a, b in zip(starts, [*starts[1:], len(kept)]):
            first, stop = int(kept[a]), int(kept[b - 1]) + 1
            rows = (np.full(b - a, chunk), np.arange(first, stop), np.array(groups[a:b]), np.array(envs[a:b]))
            self.append_rows(batch, spans, (first, stop), rows)
        self._observe_added(np.array(groups, dtype=np.int64))

    def add_part(self, batch: RolloutBatch, spans: SpanTable, part: tuple[int, int]) -> None:
        """Queue the rollouts ``part`` of a read-ahead window's ``batch`` (all valid): its rows from
        ``part`` on are appended once, pending, and each part's add queues its own."""
        first, stop = part
        ahead = self._ahead
        if ahead is None or ahead.batch is not batch or ahead.next != first:
            self.build_staged()
            self.drop_ahead()
            n, zero = batch.n_rollouts, np.zeros(batch.n_rollouts - first, np.int64)
            tokens = self.append_rows(batch, spans, (first, n), (zero, np.arange(first, n), zero, zero), status=PENDING)
            ahead = Ahead(batch, first, len(self.rollouts) - (n - first), tokens, first)
        chunk, groups, envs = self.admit(batch, list(range(first, stop)))
        self.windows.add(chunk)
        lo, hi = ahead.row + first - ahead.first, ahead.row + stop - ahead.first
        r = self.rollouts
        r.chunk[lo:hi], r.group[lo:hi], r.env[lo:hi], r.status[lo:hi] = chunk, groups, envs, QUEUED
        self._tokens_entered += int(ahead.tokens[stop - ahead.first] - ahead.tokens[first - ahead.first])
        self._first_queued = min(self._first_queued, lo)
        self._ahead = ahead._replace(next=stop) if stop < batch.n_rollouts else None
        self._observe_added(np.array(groups, dtype=np.int64))

    def drop_ahead(self) -> None:
        """Forget a read-ahead window's pending rows (its next part appends them again)."""
        if self._ahead is None:
            return
        row = self._ahead.row + self._ahead.next - self._ahead.first
        sample = int(self.rollouts.sample_lo[row])
        self.spans.truncate(int(self.samples.span_lo[sample]))
        self.samples.truncate(sample)
        self.rollouts.truncate(row)
        self._ahead = None

    def stage(self, batch: RolloutBatch) -> int | None:
        """Queue a plainly valid batch, its rows built later: how many rollouts, or None."""
        if not plain_values_of(batch):
            return None
        self.drop_ahead()
        chunk, groups, envs = self.admit(batch)
        self._staged.append(Staged(batch, chunk, groups, envs, kind_of(batch)))
        self._staged_positions += batch.n_positions
        if self._staged_positions > STAGE_FLUSH_POSITIONS:
            self.build_staged()
        return batch.n_rollouts

    def build_staged(self) -> None:
        """Cut the staged batches into spans and append their rows, a run that agrees at a time,
        each whole or not at all: interrupted (Ctrl-C too), the runs not built stay staged."""
        tables, built, first = (self.rollouts, self.samples, self.spans), 0, len(self.rollouts)
        try:
            for run in runs_of(self._staged):  # (the staged rollouts' ids are the last admitted)
                sizes = [len(table) for table in tables]
                counts = self._tokens_entered, self.queued, len(self.closing), len(self.refused)
                try:
                    if len(run) == 1:  # (one batch: its own arrays, nothing to join or shift)
                        (only,), base = run, None
                        batch, count = only.batch, only.batch.n_rollouts
                        rows = (np.full(count, only.chunk), np.arange(count), np.array(only.groups),
                                np.array(only.envs))  # fmt: skip
                    else:
                        count = sum(item.batch.n_rollouts for item in run)
                        found = joined(run, self.ids[first : first + count])
                        batch, base = found.batch, found.position_base
                        rows = (found.chunk, found.number, found.groups, found.envs)
                    verdicts = Verdicts(batch)
                    self.append_rows(batch, build_spans(batch, verdicts), (0, count), rows, base)
                    for i, error in sorted(verdicts.errors.items()):  # (changed by its caller since)
                        self.set_aside(np.array([first + i]))
                        self.refused.append((error, self.env_names[int(self.rollouts.env[first + i])]))
                    built, first = built + len(run), first + count
                except BaseException:  # (the run's rows undone, and those set aside)
                    for table, size in zip(tables, sizes):
                        table.truncate(size)
                    self._tokens_entered, self.queued, n_closing, n_refused = counts
                    del self.closing[n_closing:], self.refused[n_refused:]
                    for item in run:  # (staged: admitted whole)
                        self.chunk_open[item.chunk] = item.batch.n_rollouts
                    raise
                self._observe_added(rows[2])  # (once built: a run undone told it nothing)
        finally:
            del self._staged[:built]
            self._staged_positions = sum(item.batch.n_positions for item in self._staged)

    def append_rows(
        self,
        batch: RolloutBatch,
        spans: SpanTable,
        rollouts: tuple[int, int],
        rows: tuple[IntArray, IntArray, IntArray, IntArray],
        position_base: IntArray | None = None,
        status: int = QUEUED,
    ) -> IntArray:
        """Append the rows of the rollouts ``rollouts[0]..rollouts[1] - 1`` of ``batch``: their live
        sampled positions before each (cumulative; PENDING rows are not counted in yet)."""
        chunk, index, groups, envs = rows
        first, stop = rollouts
        offsets = batch.sample_offsets[first : stop + 1]
        s0, s1 = int(offsets[0]), int(offsets[-1])
        span_offsets = spans.span_offsets[s0 : s1 + 1]
        samples, kept_spans = slice(s0, s1), slice(int(span_offsets[0]), int(span_offsets[-1]))
        assert batch.frozen is not None and batch.label_kind is not None
        sample_rollout = np.repeat(np.arange(stop - first), np.diff(offsets))
        sample_base, span_base, row_base = len(self.samples), len(self.spans), len(self.rollouts)
        new_sample_offsets = sample_base + (offsets - s0)
        new_span_offsets = span_base + (span_offsets - span_offsets[0])
        frozen = batch.frozen[first:stop]
        self.rollouts.append(
            chunk=chunk, index=index, status=status, judged=NEVER, frozen=frozen,
            dispatch=batch.dispatch_version[first:stop], completion=spans.completion[first:stop],
            group=groups, env=envs,
            sample_lo=new_sample_offsets[:-1], sample_hi=new_sample_offsets[1:],
        )  # fmt: skip
        n_sampled = spans.n_sampled[samples]
        self.samples.append(
            rollout=row_base + sample_rollout, local=np.arange(s0, s1) - offsets[:-1][sample_rollout],
            span_lo=new_span_offsets[:-1], span_hi=new_span_offsets[1:], mask_below=NO_MASK,
            dropped=False, had_train=spans.had_train[samples], unmaskable=spans.unmaskable[samples],
            n_sampled=n_sampled, n_unlabelled=spans.n_unlabelled[samples], max_label=spans.max_label[samples],
            max_sampled=spans.max_sampled_version[samples], seq_min=spans.seq_min_version[samples],
            label_kind=batch.label_kind[samples],
        )  # fmt: skip
        span_sample = spans.sample[kept_spans] - s0
        lo, hi = spans.lo[kept_spans], spans.hi[kept_spans]
        if position_base is not None:
            base = position_base[first:stop][sample_rollout[span_sample]]
            lo, hi = lo - base, hi - base
        self.spans.append(
            sample=sample_base + span_sample, lo=lo, hi=hi, version=spans.version[kept_spans],
            labelled=spans.label[kept_spans] >= 0, sampled=spans.sampled[kept_spans], live=spans.live[kept_spans],
            part=spans.part[kept_spans],
        )  # fmt: skip
        live = np.concatenate(([0], np.cumsum(np.where(frozen[sample_rollout], 0, n_sampled))))
        tokens: IntArray = live[offsets - s0]
        if status == QUEUED:  # (the caller tells the policy)
            self._tokens_entered += int(tokens[-1])
        return tokens

    def queued_rows(self) -> IntArray:
        self.build_staged()
        start = self._first_queued
        rows = np.flatnonzero(self.rollouts.status[start:] == QUEUED)
        if start:
            rows += start
        self._first_queued = int(rows[0]) if len(rows) else len(self.rollouts)
        return rows

    def queued_tokens(self, rows: IntArray) -> int:
        r, s = self.rollouts, self.samples
        sample_rows = expand_ranges(r.sample_lo[rows], r.sample_hi[rows])
        live = ~r.frozen[s.rollout[sample_rows]] & ~s.dropped[sample_rows]
        return int(s.n_sampled[sample_rows][live].sum())

    def leave(self, rows: IntArray, status: int) -> None:
        self.rollouts.status[rows] = status
        self.queued -= len(rows)
        if not len(rows):
            return
        chunks = self.rollouts.chunk[rows]
        low = int(chunks.min())
        counts = np.bincount(chunks - low)
        chunk_open = self.chunk_open
        for offset in np.flatnonzero(counts).tolist():
            chunk = low + offset
            chunk_open[chunk] -= int(counts[offset])
            if not chunk_open[chunk]:
                self.closing.append(chunk)

    def set_aside(self, rows: IntArray) -> None:
        """Queued ``rows`` leave as invalid: their positions never entered after all."""
        self._tokens_entered -= self.queued_tokens(rows)
        self.leave(rows, INVALID)

    def release_chunks(self) -> None:
        for chunk in self.closing:
            self.chunks[chunk] = None
        self.closing = []

    def compact(self) -> None:
        """Forget the rows that left: built on a copy taken over at once (interrupted: not done)."""
        self.build_staged()
        self.drop_ahead()
        new, r, s = copy.copy(self), self.rollouts, self.samples
        keep = np.flatnonzero(r.status == QUEUED)
        sample_counts = r.sample_hi[keep] - r.sample_lo[keep]
        sample_rows = expand_ranges(r.sample_lo[keep], r.sample_hi[keep])
        span_counts = s.span_hi[sample_rows] - s.span_lo[sample_rows]
        span_rows = expand_ranges(s.span_lo[sample_rows], s.span_hi[sample_rows])
        chunks = np.unique(r.chunk[keep]).tolist()
        sample_offsets = np.concatenate(([0], np.cumsum(sample_counts)))
        span_offsets = np.concatenate(([0], np.cumsum(span_counts)))
        new.rollouts = r.take(
            keep, chunk=np.searchsorted(chunks, r.chunk[keep]), sample_lo=sample_offsets[:-1],
            sample_hi=sample_offsets[1:],
        )  # fmt: skip
        new.samples = s.take(
            sample_rows, rollout=np.repeat(np.arange(len(keep)), sample_counts),
            span_lo=span_offsets[:-1], span_hi=span_offsets[1:],
        )  # fmt: skip
        span_owners = np.repeat(np.arange(len(sample_rows)), span_counts)
        new.spans = self.spans.take(span_rows, sample=span_owners)
        new.chunks = [self.chunks[c] for c in chunks]
        new.chunk_open = [self.chunk_open[c] for c in chunks]
        new.windows = {i for i, old in enumerate(chunks) if old in self.windows}
        new._repack_windows()
        new.ids = [self.ids[row] for row in keep.tolist()]
        new.row_of = {rid: row for row, rid in enumerate(new.ids)}
        new._first_queued = 0  # (renumbered)
        new.closing = []  # chunks closing now have no queued rollout: they are not kept
        vars(self).update(vars(new))

    def _repack_windows(self) -> None:
        """Replace each window mostly left by a copy of its queued rollouts (a read-ahead window
        holds many rollouts: one queued for long would keep all of their arrays alive)."""
        r, s, n = self.rollouts, self.samples, self.spans
        order = np.argsort(r.chunk, kind="stable")
        bounds = np.searchsorted(r.chunk[order], np.arange(len(self.chunks) + 1))
        for chunk in self.windows:
            batch, rows = self.chunks[chunk], order[bounds[chunk] : bounds[chunk + 1]]
            assert batch is not None
            part = rollouts_of(batch, r.index[rows])
            if 2 * part.n_positions > batch.n_positions:
                continue
            samples = expand_ranges(r.sample_lo[rows], r.sample_hi[rows])  # (in order)
            old = batch.sample_offsets[r.index[s.rollout[samples]]] + s.local[samples]
            spans = expand_ranges(s.span_lo[samples], s.span_hi[samples])
            counts = s.span_hi[samples] - s.span_lo[samples]
            shift = np.repeat(part.position_offsets[:-1] - batch.position_offsets[old], counts)
            n.lo[spans], n.hi[spans] = n.lo[spans] + shift, n.hi[spans] + shift
            r.index[rows] = np.arange(len(rows))
            self.chunks[chunk] = copy.deepcopy(part)  # (no view of the window's arrays)

    def restore(self, observe_added: Callable[[IntArray], None] | None = None, **fields: Any) -> None:
        """Take a checked saved state's fields (:mod:`.queue_state`), and the policy's hook."""
        self._tokens_entered = fields.pop("tokens_entered", self._tokens_entered)
        vars(self).update(fields)
        self.row_of = {rid: row for row, rid in enumerate(self.ids)}
        self.env_names = {i: name or "" for name, i in self.env_index.items()}
        if observe_added is not None:
            self._observe_added = observe_added
