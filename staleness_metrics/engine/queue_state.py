"""The queue in a checkpoint (SPEC 13): what it means, not how it is laid out.

A saved queue is the queued rollouts as they arrived (SPEC 3's columns, a batch per batch they came
in), what judging did to them (last judged step, each sample's threshold and drop) and the run's
registry (ids seen, groups, envs) and conservation count. Loading adds the rollouts back through the
add path (every check of an add runs on them) and masks again what the thresholds masked, so a new
column of the queue's tables is not a change of format. Positions masked in place are saved with
mask 1 (their weights stay 0: only read below the threshold, where nothing trains again).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from itertools import pairwise
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..state_checks import boolean, fail, integer, join, keys, sequence, string, strings
from .batch_state import decode_batch, encode_batch, queued_part
from .decision import NO_MASK
from .judging import judgement_of, mask_positions
from .queue import NEVER, QUEUED, RolloutQueue
from .segments import expand_ranges
from .spans import checked_spans

__all__ = ["QUEUE_KEYS", "Registry", "read_queue", "read_registry", "save_queue"]

IntArray = npt.NDArray[np.int64]

QUEUE_KEYS = (
    "batches",
    "judged",
    "mask_below",
    "dropped",
    "seen_ids",
    "groups",
    "group_agentic",
    "envs",
    "tokens_entered",
)


def save_queue(queue: RolloutQueue) -> dict[str, Any]:
    """The queue as plain data (see the module); the queue is left as it was."""
    queue.build_staged()
    r, s = queue.rollouts, queue.samples
    rows = np.flatnonzero(r.status == QUEUED)
    batches = []
    if len(rows):
        chunk = r.chunk[rows]
        bounds = [0, *(np.flatnonzero(np.diff(chunk)) + 1).tolist(), len(rows)]
        for start, stop in pairwise(bounds):  # runs of one batch, in queue order
            mine = rows[start:stop]
            sample_rows = expand_ranges(r.sample_lo[mine], r.sample_hi[mine])
            batch = queue.batches_of([int(chunk[start])])[int(chunk[start])]
            batches.append(encode_batch(queued_part(batch, r.index[mine], _masked_in_place(queue, sample_rows))))
    sample_rows = expand_ranges(r.sample_lo[rows], r.sample_hi[rows])
    return {
        "batches": batches,
        "judged": r.judged[rows].tolist(),
        "mask_below": s.mask_below[sample_rows].tolist(),
        "dropped": s.dropped[sample_rows].tolist(),
        "seen_ids": sorted(queue.seen_ids),
        "groups": [list(item) for item in sorted(queue.groups.items(), key=lambda item: item[1])],
        "group_agentic": queue.group_agentic[: queue.n_groups].tolist(),
        "envs": [name for name, _ in sorted(queue.env_index.items(), key=lambda item: item[1])],
        "tokens_entered": queue.tokens_entered,
    }


def _masked_in_place(queue: RolloutQueue, sample_rows: IntArray) -> tuple[IntArray, IntArray]:
    """The position ranges of the spans of ``sample_rows`` a raise may have masked in place:
    sampled, and of a version below their sample's threshold."""
    s, n = queue.samples, queue.spans
    raised = sample_rows[s.mask_below[sample_rows] > NO_MASK]
    span_rows = expand_ranges(s.span_lo[raised], s.span_hi[raised])
    below = np.repeat(s.mask_below[raised], s.span_hi[raised] - s.span_lo[raised])
    masked = span_rows[(n.sampled[span_rows] > 0) & (n.version[span_rows] < below)]
    return n.lo[masked], n.hi[masked]


class Registry(NamedTuple):
    """The ids, groups and envs of a run, as a checkpoint holds them."""

    seen_ids: set[str]
    groups: dict[str, int]
    n_groups: int
    group_agentic: npt.NDArray[np.bool_]
    envs: list[str | None]

    def fields(self) -> dict[str, Any]:
        """What :meth:`RolloutQueue.restore` takes of it (but the ids: the caller's)."""
        env_index = {name: i for i, name in enumerate(self.envs)}
        return {"groups": dict(self.groups), "n_groups": self.n_groups, "group_agentic": self.group_agentic.copy(),
                "env_index": env_index}  # fmt: skip


def read_registry(state: Mapping[str, Any], path: str) -> Registry:
    """The ``seen_ids``, ``groups``, ``group_agentic`` (and, in the old format, ``n_groups``) and
    ``envs`` of ``state``, checked."""
    seen_ids = set(strings(state["seen_ids"], join(path, "seen_ids"), unique=True))
    where = join(path, "group_agentic")
    if "n_groups" in state:  # (formats 1 and 2)
        agentic = sequence(state["group_agentic"], where, integer(state["n_groups"], join(path, "n_groups"), 0))
    else:
        agentic = sequence(state["group_agentic"], where)
    n_groups = len(agentic)
    group_agentic = np.zeros(max(16, 2 * n_groups), dtype=bool)
    group_agentic[:n_groups] = [boolean(v, join(where, i)) for i, v in enumerate(agentic)]
    groups: dict[str, int] = {}
    for i, pair in enumerate(sequence(state["groups"], join(path, "groups"))):
        where = join(join(path, "groups"), i)
        name, index = sequence(pair, where, 2)
        name, index = string(name, join(where, 0)), integer(index, join(where, 1), 0, n_groups - 1)
        if name in groups:
            fail(where, f"group {name!r} appears twice")
        groups[name] = index
    if len(set(groups.values())) != len(groups):
        fail(join(path, "groups"), "two group names share an index")
    envs = strings(state["envs"], join(path, "envs"), optional=True, unique=True)
    if not envs or envs[0] is not None:
        fail(join(path, "envs"), "the first env is null (rollouts without one)")
    return Registry(seen_ids, groups, n_groups, group_agentic, envs)


def _ints(value: Any, path: str, length: int, low: int, high: int) -> IntArray:
    """A list of ``length`` integers in ``low..high``."""
    items = sequence(value, path, length)
    if set(map(type, items)) <= {int}:  # the usual case, at C speed
        values = np.asarray(items, dtype=object if items and max(map(abs, items)) >= 2**63 else np.int64)
        if values.dtype == np.int64 and (not len(values) or (values.min() >= low and values.max() <= high)):
            return values
    for i, item in enumerate(items):  # the loop names the offending entry
        integer(item, join(path, i), low, high)
    raise AssertionError("unreachable: an entry failed its check")  # pragma: no cover


def read_queue(
    state: Mapping[str, Any],
    observe_added: Callable[[IntArray], None],
    path: str = "",
    step: int = 0,
) -> RolloutQueue:
    """A new queue holding :func:`save_queue`'s ``state``, checked: every rollout as an add checks
    it, the judging state by range and length (``step``: the saving sink's latest). The policy's
    hook ``observe_added`` is not told of the rollouts loaded. A bad state raises ``ConfigError``
    naming the key path."""
    found = keys(state, path, QUEUE_KEYS)
    registry = read_registry(found, path)
    queue = RolloutQueue(lambda groups: None)
    queue.restore(**registry.fields())
    where = join(path, "batches")
    for i, encoded in enumerate(sequence(found["batches"], where)):
        batch = decode_batch(encoded, join(where, i))
        verdicts, spans = checked_spans(batch, queue.seen_ids)
        if verdicts.errors:
            fail(join(where, i), str(verdicts.errors[min(verdicts.errors)]))
        queue.add_checked(batch, spans)
    for key, ours, saved in (
        ("envs", queue.env_index, registry.envs),
        ("groups", queue.groups, registry.groups),
    ):
        if len(ours) != len(saved):  # (an add registers what the registry lacks)
            name = next(reversed(ours))
            fail(join(path, key), f"lacks the {key[:-1]} {name!r} of a queued rollout")
    if not registry.seen_ids.issuperset(queue.seen_ids):
        unknown = min(queue.seen_ids - registry.seen_ids)
        fail(join(path, "seen_ids"), f"lacks the queued id {unknown!r}")
    rollouts, samples = len(queue.rollouts), len(queue.samples)
    judged = _ints(found["judged"], join(path, "judged"), rollouts, NEVER, step)
    mask_below = _ints(found["mask_below"], join(path, "mask_below"), samples, NO_MASK, max(step, 0))
    where = join(path, "dropped")
    dropped = np.array([boolean(v, join(where, i)) for i, v in enumerate(sequence(found["dropped"], where, samples))])
    _judged_as_saved(queue, judged, mask_below, dropped.astype(bool))
    tokens_entered = integer(found["tokens_entered"], join(path, "tokens_entered"), 0)
    queue.restore(seen_ids=registry.seen_ids, tokens_entered=tokens_entered, observe_added=observe_added)
    return queue


def _judged_as_saved(
    queue: RolloutQueue, judged: IntArray, mask_below: IntArray, dropped: npt.NDArray[np.bool_]
) -> None:
    """Mask again what the thresholds masked, and set the judging state."""
    rows = np.arange(len(queue.rollouts))
    raised = mask_below > NO_MASK
    if raised.any():
        mask_positions(queue, judgement_of(queue, rows, 0), mask_below, raised)
    queue.rollouts.judged = judged
    queue.samples.mask_below = mask_below
    queue.samples.dropped = dropped
