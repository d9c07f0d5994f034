"""Checkpoints of formats 1 and 2 (SPEC 13), whose queue was its tables and batches: read back
checked (structure, dtypes, ranges, and that ids, rows, chunks and counts agree, so no write can
stray) into a queue, which a sink of today saves as the rollouts it holds (:mod:`.queue_state`,
format 3). The converter from the old format."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..records.columnar import RolloutBatch
from ..state_checks import fail, integer, join, keys, sequence, strings
from .batch_state import check_offsets, decode_batch, decode_table
from .decision import NO_MASK
from .queue import NEVER, QUEUED, RolloutQueue
from .queue_state import Registry, read_registry
from .rows import RolloutRows, SampleRows, SpanRows
from .segments import expand_ranges
from .spans import PART_LABELLED, PART_UNLABELLED, PART_WHOLE

__all__ = ["LAYOUT_KEYS", "read_layout"]

LAYOUT_KEYS = (
    "queued", "tokens_entered", "tables", "ids", "seen_ids", "chunks", "chunk_open", "groups", "group_agentic",
    "n_groups", "envs",
)  # fmt: skip


def _per_row(values: Sequence[Any], rows: npt.NDArray[np.int64]) -> list[Any]:
    return [values[i] for i in rows.tolist()]


def read_layout(
    state: Mapping[str, Any],
    observe_added: Callable[[npt.NDArray[np.int64]], None],
    path: str = "",
    step: int = 0,
) -> RolloutQueue:
    """A new queue holding an old checkpoint's ``state`` (the :data:`LAYOUT_KEYS` of it), checked:
    structure, dtypes, ranges, and that ids, rows, chunks and counts agree, so no later write can
    stray. ``step`` is the latest step of the sink that saved it (no row was judged after it);
    ``observe_added``: the policy's hook. A bad state raises ``ConfigError`` naming the key path."""
    queue = RolloutQueue(observe_added)
    tables = keys(state["tables"], join(path, "tables"), ("rollouts", "samples", "spans"))
    r = decode_table(tables["rollouts"], queue.rollouts, join(path, "tables.rollouts"))
    s = decode_table(tables["samples"], queue.samples, join(path, "tables.samples"))
    n = decode_table(tables["spans"], queue.spans, join(path, "tables.spans"))
    rows = len(r)
    ids = strings(state["ids"], join(path, "ids"), unique=True)
    if len(ids) != rows:
        fail(join(path, "ids"), f"{len(ids)} ids for {rows} rollout rows")
    queued = integer(state["queued"], join(path, "queued"), 0)
    if queued != rows:
        fail(join(path, "queued"), f"{queued}, but the checkpoint holds {rows} queued rollouts")
    registry = read_registry(state, path)
    if not registry.seen_ids.issuperset(ids):
        fail(
            join(path, "seen_ids"),
            f"lacks the queued id {next(i for i in ids if i not in registry.seen_ids)!r}",
        )

    where = join(path, "chunks")
    chunks = [decode_batch(c, join(where, i)) for i, c in enumerate(sequence(state["chunks"], where))]
    open_ = sequence(state["chunk_open"], join(path, "chunk_open"), len(chunks))
    chunk_open = [integer(v, join(join(path, "chunk_open"), i), 1) for i, v in enumerate(open_)]

    position_lo, position_hi, has_tokens = _rows_agree((r, s), (chunks, chunk_open), ids, registry, (path, step))
    _spans_agree((s, n), (position_lo, position_hi, has_tokens), path, step)
    tokens_entered = integer(state["tokens_entered"], join(path, "tokens_entered"), 0)

    queue.restore(
        rollouts=r, samples=s, spans=n, ids=ids, seen_ids=registry.seen_ids, chunks=list(chunks),
        chunk_open=chunk_open, queued=queued, tokens_entered=tokens_entered, **registry.fields(),
    )  # fmt: skip
    return queue


def _rows_agree(
    tables: tuple[RolloutRows, SampleRows],
    batches: tuple[list[RolloutBatch], list[int]],
    ids: list[str],
    registry: Registry,
    at: tuple[str, int],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Rollout rows: queued, each one rollout of a chunk, agreeing with what that chunk says of it;
    returns each sample's positions in its chunk and whether that chunk has token versions."""
    (r, s), (chunks, chunk_open), (path, step) = tables, batches, at
    rows, where_r, where_s = len(r), join(path, "tables.rollouts"), join(path, "tables.samples")
    groups, n_groups, envs = registry.groups, registry.n_groups, registry.envs
    where = join(path, "chunks")
    status = r.status
    if (status != QUEUED).any():
        fail(join(where_r, "status"), "a checkpoint holds queued rollouts only")
    chunk, index = r.chunk, r.index
    if ((chunk < 0) | (chunk >= len(chunks))).any():
        fail(join(where_r, "chunk"), f"values are chunk numbers, 0..{len(chunks) - 1}")
    if np.bincount(chunk, minlength=len(chunks)).tolist() != chunk_open:
        fail(join(path, "chunk_open"), "does not count the queued rollouts of each chunk")
    for name, values, high in (("judged", r.judged, step), ("group", r.group, n_groups - 1),
                               ("env", r.env, len(envs) - 1)):  # fmt: skip
        low = NEVER if name == "judged" else 0
        if rows and (int(values.min()) < low or int(values.max()) > high):
            fail(join(where_r, name), f"values lie in {low}..{high}")
    check_offsets(np.concatenate((r.sample_lo[:1], r.sample_hi)) if rows else np.zeros(1, dtype=np.int64),
             join(where_r, "sample_hi"), rows + 1, len(s))  # fmt: skip
    if (r.sample_lo[1:] != r.sample_hi[:-1]).any():
        fail(join(where_r, "sample_lo"), "each rollout's samples start where the previous one's end")
    sample_counts = r.sample_hi - r.sample_lo
    sample_owner = np.repeat(np.arange(rows), sample_counts)
    if not np.array_equal(s.rollout, sample_owner):
        fail(join(where_s, "rollout"), "does not name the rollout row each sample belongs to")
    expected_local = np.arange(len(s)) - r.sample_lo[sample_owner]
    if not np.array_equal(s.local, expected_local):
        fail(join(where_s, "local"), "samples are numbered 0, 1, ... within their rollout")
    sample_in_batch = np.zeros(len(s), dtype=np.int64)
    position_lo = np.zeros(len(s), dtype=np.int64)
    position_hi = np.zeros(len(s), dtype=np.int64)
    has_tokens = np.zeros(len(s), dtype=bool)
    seen_pairs: set[tuple[int, int]] = set()
    # Rows and samples grouped by chunk once (stable: in row order), not one
    # scan of all rows per chunk.
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
            ("frozen", batch.frozen[k].tolist(), r.frozen[mine].tolist()),
            ("dispatch", batch.dispatch_version[k].tolist(), r.dispatch[mine].tolist()),
            ("env", _per_row(batch.envs, k), [envs[e] for e in r.env[mine].tolist()]),
            (
                "sample_hi",
                np.diff(batch.sample_offsets)[k].tolist(),
                (r.sample_hi - r.sample_lo)[mine].tolist(),
            ),
        )
        for name, theirs, ours in checks:
            if theirs != ours:
                row = int(mine[next(i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b)])
                key = "ids" if name == "id" else f"tables.rollouts.{name}"
                fail(
                    join(path, key),
                    f"row {row} disagrees with rollout {int(index[row])} of chunk {c}",
                )
        for row, name in zip(mine.tolist(), _per_row(batch.group_ids, k)):
            if name is not None and groups.get(name) != int(r.group[row]):
                fail(join(where_r, "group"), f"row {row} is not in the group of {name!r}")
        owned = sample_order[sample_bounds[c] : sample_bounds[c + 1]]
        sample_in_batch[owned] = batch.sample_offsets[index[sample_owner[owned]]] + s.local[owned]
        position_lo[owned] = batch.position_offsets[sample_in_batch[owned]]
        position_hi[owned] = batch.position_offsets[sample_in_batch[owned] + 1]
        has_tokens[owned] = batch.token_versions is not None
        if not np.array_equal(s.label_kind[owned], batch.label_kind[sample_in_batch[owned]]):
            fail(join(where_s, "label_kind"), f"disagrees with chunk {c}")
        mask = batch.mask[expand_ranges(position_lo[owned], position_hi[owned])]
        if ((mask != 0) & (mask != 1)).any():
            fail(join(join(where, c), "mask"), "the mask values of queued rollouts are 0 or 1")

    if len(seen_pairs) != rows:  # pragma: no cover - follows from the per-chunk uniqueness
        fail(join(where_r, "index"), "one rollout is queued twice")
    return position_lo, position_hi, has_tokens


def _spans_agree(
    tables: tuple[SampleRows, SpanRows],
    positions: tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.bool_]],
    path: str,
    step: int,
) -> None:
    """Samples and spans: spans tile each sample's rows and stay inside its
    positions in the batch."""
    (s, n), (position_lo, position_hi, has_tokens) = tables, positions
    where_s, where_n = join(path, "tables.samples"), join(path, "tables.spans")
    check_offsets(np.concatenate((s.span_lo[:1], s.span_hi)) if len(s) else np.zeros(1, dtype=np.int64),
             join(where_s, "span_hi"), len(s) + 1, len(n))  # fmt: skip
    if (s.span_lo[1:] != s.span_hi[:-1]).any():
        fail(join(where_s, "span_lo"), "each sample's spans start where the previous one's end")
    if ((s.mask_below < NO_MASK) | (s.mask_below > max(step, 0))).any():
        fail(join(where_s, "mask_below"), f"thresholds lie in {NO_MASK}..{step}")
    if ((s.n_sampled < 0) | (s.n_unlabelled < 0) | (s.n_unlabelled > s.n_sampled)).any():
        fail(join(where_s, "n_unlabelled"), "counts are 0..n_sampled")
    if (s.n_sampled > position_hi - position_lo).any():
        fail(join(where_s, "n_sampled"), "more sampled positions than the sample has")
    span_owner = np.repeat(np.arange(len(s)), s.span_hi - s.span_lo)
    if not np.array_equal(n.sample, span_owner):
        fail(join(where_n, "sample"), "does not name the sample row each span belongs to")
    lo, hi, part = n.lo, n.hi, n.part
    if ((lo < position_lo[span_owner]) | (hi < lo) | (hi > position_hi[span_owner])).any():
        fail(join(where_n, "lo"), "a span reaches outside its sample's positions")
    if ((n.sampled < 0) | (n.sampled > hi - lo)).any():
        fail(join(where_n, "sampled"), "more sampled positions than the span has")
    if ((part != PART_WHOLE) & (part != PART_LABELLED) & (part != PART_UNLABELLED)).any():
        fail(join(where_n, "part"), "values are 0 (whole), 1 (labelled) and 2 (unlabelled)")
    first, second = np.flatnonzero(part == PART_LABELLED), np.flatnonzero(part == PART_UNLABELLED)
    if not np.array_equal(first + 1, second) or not np.array_equal(span_owner[first], span_owner[second[: len(first)]]):
        fail(
            join(where_n, "part"),
            "a labelled part is followed by its unlabelled part, in the same sample",
        )
    if ((part != PART_WHOLE) & ~has_tokens[span_owner]).any():
        fail(join(where_n, "part"), "a mixed span in a batch without token versions")
