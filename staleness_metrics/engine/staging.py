"""Batching small adds: a batch the quick checks pass is queued at add and *staged*, its spans cut
later with every batch staged after it in one pass over their concatenation (:func:`joined`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..records.columnar import WEIGHT_FIELDS, RolloutBatch
from .segments import IntArray

STAGE_MAX_POSITIONS = 1 << 16  # a longer batch is cut at its add
STAGE_FLUSH_POSITIONS = 1 << 20  # staged positions beyond it are cut at once (bounded memory)

Kind = tuple[str | None, ...]


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
