"""Checkpoints of formats 1 and 2 (SPEC 13), whose queue was its tables and batches: the converter.
The tables are checked as far as reading them back needs, then saved as today's format saves a
queue and read as that is (:mod:`.queue_state`: every rollout as an add checks it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from ..records.columnar import RolloutBatch
from ..state_checks import fail, integer, join, keys, sequence, strings
from .batch_state import check_offsets, decode_batch, decode_table
from .queue import QUEUED, RolloutQueue
from .queue_state import read_queue, read_registry, save_queue
from .rows import RolloutRows, SampleRows, SpanRows

__all__ = ["LAYOUT_KEYS", "read_layout"]

LAYOUT_KEYS = (
    "queued", "tokens_entered", "tables", "ids", "seen_ids", "chunks", "chunk_open", "groups", "group_agentic",
    "n_groups", "envs",
)  # fmt: skip


def read_layout(
    state: Mapping[str, Any],
    observe_added: Callable[[npt.NDArray[np.int64]], None],
    path: str = "",
    step: int = 0,
) -> RolloutQueue:
    """A new queue holding an old checkpoint's ``state`` (the :data:`LAYOUT_KEYS` of it), checked.
    ``step`` is the latest step of the sink that saved it; ``observe_added``: the policy's hook. A
    bad state raises ``ConfigError`` naming the key path."""
    queue = RolloutQueue(observe_added)
    tables = keys(state["tables"], join(path, "tables"), ("rollouts", "samples", "spans"))
    r = decode_table(tables["rollouts"], queue.rollouts, join(path, "tables.rollouts"))
    s = decode_table(tables["samples"], queue.samples, join(path, "tables.samples"))
    n = decode_table(tables["spans"], queue.spans, join(path, "tables.spans"))
    ids = strings(state["ids"], join(path, "ids"), unique=True)
    if len(ids) != len(r):
        fail(join(path, "ids"), f"{len(ids)} ids for {len(r)} rollout rows")
    queued = integer(state["queued"], join(path, "queued"), 0)
    if queued != len(r):
        fail(join(path, "queued"), f"{queued}, but the checkpoint holds {len(r)} queued rollouts")
    registry = read_registry(state, path)
    where = join(path, "chunks")
    chunks = [decode_batch(c, join(where, i)) for i, c in enumerate(sequence(state["chunks"], where))]
    sequence(state["chunk_open"], join(path, "chunk_open"), len(chunks))
    _rows_agree((r, s, n), chunks, ids, path)
    tokens_entered = integer(state["tokens_entered"], join(path, "tokens_entered"), 0)
    queue.restore(
        rollouts=r, samples=s, spans=n, ids=ids, seen_ids=registry.seen_ids, chunks=list(chunks),
        chunk_open=np.bincount(r.chunk, minlength=len(chunks)).tolist(), queued=queued,
        tokens_entered=tokens_entered, **registry.fields(),
    )  # fmt: skip
    return read_queue(save_queue(queue), observe_added, path, step)


def _rows_agree(
    tables: tuple[RolloutRows, SampleRows, SpanRows],
    chunks: list[RolloutBatch],
    ids: list[str],
    path: str,
) -> None:
    """Rollout rows that are queued rollouts of their chunk (by id and sample count), sample and
    span rows in order, and spans inside their chunk's positions: what saving them reads."""
    r, s, n = tables
    where_r, where_s = join(path, "tables.rollouts"), join(path, "tables.samples")
    if (r.status != QUEUED).any():
        fail(join(where_r, "status"), "a checkpoint holds queued rollouts only")
    if ((r.chunk < 0) | (r.chunk >= len(chunks))).any():
        fail(join(where_r, "chunk"), f"values are chunk numbers, 0..{len(chunks) - 1}")
    _in_order(r.sample_lo, r.sample_hi, join(where_r, "sample"), len(s))
    _in_order(s.span_lo, s.span_hi, join(where_s, "span"), len(n))
    counts = r.sample_hi - r.sample_lo
    for c, batch in enumerate(chunks):
        mine = np.flatnonzero(r.chunk == c)
        k = r.index[mine]
        if ((k < 0) | (k >= batch.n_rollouts)).any():
            fail(join(where_r, "index"), f"chunk {c} holds rollouts 0..{batch.n_rollouts - 1}")
        if len(np.unique(k)) != len(k):
            fail(join(where_r, "index"), f"one rollout of chunk {c} is queued twice")
        if [batch.ids[i] for i in k.tolist()] != [ids[i] for i in mine.tolist()]:
            fail(join(path, "ids"), f"disagrees with the rollouts of chunk {c}")
        if not np.array_equal(np.diff(batch.sample_offsets)[k], counts[mine]):
            fail(join(where_r, "sample_hi"), f"disagrees with the samples of chunk {c}")
    span_chunk = np.repeat(np.repeat(r.chunk, counts), s.span_hi - s.span_lo)
    positions = np.array([batch.n_positions for batch in chunks], dtype=np.int64)[span_chunk]
    if ((n.lo < 0) | (n.hi < n.lo) | (n.hi > positions)).any():
        fail(join(path, "tables.spans.lo"), "a span reaches outside its chunk's positions")


def _in_order(lo: npt.NDArray[np.int64], hi: npt.NDArray[np.int64], where: str, end: int) -> None:
    """Ranges ``[lo, hi)`` (the columns ``{where}_lo``, ``{where}_hi``) that tile ``0..end``."""
    offsets = np.concatenate((lo[:1], hi)) if len(lo) else np.zeros(1, dtype=np.int64)
    check_offsets(offsets, f"{where}_hi", len(lo) + 1, end)
    if (lo[1:] != hi[:-1]).any():
        fail(f"{where}_lo", "each range starts where the previous one ends")
