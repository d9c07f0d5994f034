"""TRL's asynchronous GRPO (``trl.experimental.async_grpo``): its rollout samples, shipped before it trains them.

Built from TRL's own source (release 1.16.0), with no import of it:

- ``trl/experimental/async_grpo/async_rollout_worker.py``: a ``RolloutSample`` (a slotted dataclass) is one
  training row of one conversation: ``input_ids``, ``completion_mask`` (1 on the tokens the loss is taken
  over), ``old_log_probs`` (the generator's log-probability of each token, aligned with ``input_ids``),
  ``advantage``, ``group_id`` (the prompt group) and ``model_version``: the worker's policy version when
  the group was dispatched. A sample carries no per-token version.
- ``trl/experimental/async_grpo/async_grpo_trainer.py``: the worker fills ``rollout_queue``;
  ``RolloutQueueDataset.__iter__`` takes one sample at a time, drops it when ``version -
  sample.model_version > max_staleness`` (``version`` = the trainer's ``self.model_version``, bumped after
  every weight sync in ``_sync_weight_merged``: 0 before the first, 1 after it), logs
  ``sample/staleness_mean`` / ``sample/staleness_max`` / ``sample/dropped_stale_total``, and yields a dict
  without ``model_version``; the batchers fold the dicts into ``packing.TreeRow`` prefix tries, and
  ``TreeRow.pack`` lays out one loss term per trained token (``token_index``, ``old_log_probs``,
  ``segment_id``).

So the hook is the rollout queue, before ``RolloutQueueDataset`` loses ``model_version``: :func:`ship`
takes a list of samples, and :class:`ShippingQueue` wraps ``trainer.rollout_queue`` so the dataset only
ever sees shipped samples. Mapping: each sample is one rollout with one sample (``dispatch_version`` =
``model_version``; every completion token is unlabelled and takes it), ``group_id`` is its group.

The SPEC 11 lag of every loss term of a packed row (:func:`packed_staleness_lag`, or
:func:`with_staleness_lag` around TRL's collator) comes from the samples' shipped lags, in
``TreeRow.pack``'s order, so it lines up with ``old_log_probs`` and the trainer's ``log_probs`` in
``compute_loss``.
"""

from __future__ import annotations

import queue
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..errors import TraceError
from ..records.columnar import RolloutBatch
from ._ship import TrainerNames, new_tensor_like, ship_rows

if TYPE_CHECKING:
    from ..monitor import StalenessMonitor

__all__ = ["ShippingQueue", "packed_staleness_lag", "ship", "staleness_lag_of", "with_staleness_lag"]


# Lags of shipped samples, by the identity of their completion_mask array (RolloutSample has __slots__
# and RolloutQueueDataset passes that very array on; the weak reference keeps a reused id from matching).
_lags: dict[int, tuple[weakref.ref[Any], npt.NDArray[np.int64]]] = {}


NAMES = TrainerNames(
    "TRL",
    "self.model_version (the weights about to be trained: 0 before the first weight sync, 1 after it)",
    {
        "dispatch_version": "samples[{row}].model_version",
        "mask": "samples[{row}].completion_mask",
        "logprobs": "samples[{row}].old_log_probs",
    },
)


def _numpy(value: Any) -> npt.NDArray[Any]:
    if getattr(value, "detach", None) is not None:
        value = value.detach().cpu()
    return np.asarray(value)


def _read(samples: Sequence[Any]) -> RolloutBatch:
    """One rollout of one sample per ``RolloutSample``: its mask, ``model_version`` and ``group_id``."""
    prefix = uuid.uuid4().hex[:12]
    ids = [f"trl-{prefix}/{k}" for k in range(len(samples))]
    masks, logprobs, versions, groups = [], [], [], []
    for row, (rid, sample) in enumerate(zip(ids, samples, strict=True)):
        version = getattr(sample, "model_version", None)
        if version is None:
            raise TraceError(rid, f"samples[{row}].model_version", "missing or None on the RolloutSample")
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
            raise TraceError(rid, f"samples[{row}].model_version", f"expected an integer >= 0, got {version!r}")
        mask = _numpy(getattr(sample, "completion_mask", None))
        if mask.ndim != 1:
            raise TraceError(rid, f"samples[{row}].completion_mask", f"expected one row, got shape {mask.shape}")
        old = getattr(sample, "old_log_probs", None)
        old_values = np.full(len(mask), np.nan) if old is None else _numpy(old).astype(np.float64)
        if old_values.shape != mask.shape:
            reason = f"length {len(old_values)} differs from completion_mask's {len(mask)}"
            raise TraceError(rid, f"samples[{row}].old_log_probs", reason)
        masks.append(mask)
        logprobs.append(old_values)
        versions.append(int(version))
        group = getattr(sample, "group_id", None)
        groups.append(None if group is None else f"trl-group-{group}")
    lengths = np.array([len(m) for m in masks], dtype=np.int64)
    return RolloutBatch(
        ids=ids,
        sample_offsets=np.arange(len(samples) + 1, dtype=np.int64),
        position_offsets=np.concatenate(([0], np.cumsum(lengths))).astype(np.int64),
        mask=np.concatenate(masks).astype(np.int64) if masks else np.zeros(0, dtype=np.int64),
        dispatch_version=np.array(versions, dtype=np.int64),
        group_ids=groups,
        logprobs=np.concatenate(logprobs) if logprobs else np.zeros(0),
    )


def _write_mask(sample: Any, values: npt.NDArray[Any]) -> None:
    """The shipped mask into the sample's own ``completion_mask`` (same object, same dtype)."""
    target = sample.completion_mask
    if isinstance(target, np.ndarray):
        target[...] = values
    else:  # a tensor
        target.copy_(new_tensor_like(target, values.astype(np.int64)).to(dtype=target.dtype))


def _remember_lag(sample: Any, lag: npt.NDArray[np.int64]) -> None:
    mask = sample.completion_mask
    key = id(mask)
    _lags[key] = (weakref.ref(mask, lambda _: _lags.pop(key, None)), lag)


def staleness_lag_of(completion_mask: Any) -> npt.NDArray[np.int64]:
    """The SPEC 11 lag of each position of a shipped sample (or of the dict ``RolloutQueueDataset`` made
    of it), found by its ``completion_mask``: ``T - model_version`` on completion tokens, -1 elsewhere."""
    found = _lags.get(id(completion_mask))
    if found is None or found[0]() is not completion_mask:
        raise KeyError("completion_mask: this sample did not come through staleness_metrics.adapters.trl.ship")
    return found[1]


def ship(monitor: StalenessMonitor, samples: Sequence[Any], *, version: int) -> list[Any]:
    """Ship TRL ``RolloutSample`` s at the trainer's ``version`` (its ``self.model_version``).

    The samples are added and shipped at step ``version + 1``; the shipped mask is written into each
    sample's own ``completion_mask``; the samples dropped for staleness (or held back) are left out, and
    the returned list holds the same objects, in ship order, samples held by an earlier call included once a
    ship takes them. Each returned sample's lag is kept for :func:`staleness_lag_of` /
    :func:`packed_staleness_lag` (the slotted ``RolloutSample`` takes no new attribute).
    """
    batch = _read(samples)
    result = ship_rows(monitor, batch, list(samples), version=version, names=NAMES)
    out: list[Any] = []
    for part in result.parts:
        offsets = part.batch.position_offsets
        for row, lag in zip(part.rows.tolist(), part.lags, strict=True):  # one sample per row
            sample = part.source[row]
            _write_mask(sample, part.batch.mask[int(offsets[row]) : int(offsets[row + 1])])
            _remember_lag(sample, lag)
            out.append(sample)
    return out


def packed_staleness_lag(row: Any) -> npt.NDArray[np.int64]:
    """The lag of every loss term of a ``TreeRow`` (its ``samples`` are the dicts ``RolloutQueueDataset``
    yields), in ``TreeRow.pack``'s order: per sample, each position ``p >= 1`` with ``completion_mask[p]``."""
    parts = []
    for sample in row.samples:
        mask = sample["completion_mask"]
        lag = staleness_lag_of(mask)
        trained = _numpy(mask)[1:] != 0
        parts.append(lag[1:][trained])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def with_staleness_lag(collator: Callable[[list[Any]], dict[str, Any]]) -> Callable[[list[Any]], dict[str, Any]]:
    """TRL's ``DataCollatorForRollout`` plus ``staleness_lag``: per row, the lag of each loss term, padded
    with -1 like ``token_index``, so ``inputs["staleness_lag"][selected]`` lines up with ``old_log_probs``."""

    def collate(examples: list[Any]) -> dict[str, Any]:
        batch = collator(examples)
        (rows,) = examples
        index = batch["token_index"]
        lag = np.full(tuple(index.shape), -1, dtype=np.int64)
        for r, row in enumerate(rows):
            values = packed_staleness_lag(row)
            lag[r, : len(values)] = values
        batch["staleness_lag"] = new_tensor_like(index, lag)
        return batch

    return collate


class ShippingQueue:
    """``trainer.rollout_queue`` as ``RolloutQueueDataset`` reads it, handing out shipped samples only.

    ``get`` takes the samples waiting in the queue (at least one, waiting as ``queue.get`` does), at most
    as many as the current optimizer step still takes (``samples_per_step``, TRL's
    ``per_device_train_batch_size * gradient_accumulation_steps * num_processes``), ships them at
    ``version()`` and returns them one by one, so one ship never spans two optimizer steps. When a ship keeps
    nothing, ``get`` raises ``queue.Empty``, as an empty queue does, and TRL asks again.

    A sample is judged when the dataloader pulls it, not when it is trained: accelerate's
    ``DataLoaderDispatcher`` pulls the next micro-batch before handing out the current one, so a micro-batch
    pulled at version ``v`` trains at ``v + 1`` when a weight sync ends the step in between (up to ``v + 2``
    behind ``TokenBudgetBatcher``, which pulls the sample that closes a micro-batch one micro-batch earlier).
    The README's TRL section gives the gap and the bound that keeps trained rows within ``max_staleness``.
    """

    def __init__(
        self, rollout_queue: Any, monitor: StalenessMonitor, version: Callable[[], int], *, samples_per_step: int
    ) -> None:
        if samples_per_step < 1:
            raise ValueError(f"samples_per_step: expected an integer >= 1, got {samples_per_step!r}")
        self.queue = rollout_queue
        self.monitor = monitor
        self.version = version
        self.samples_per_step = samples_per_step
        self._ready: deque[Any] = deque()
        self._handed = 0  # samples returned at the current version
        self._version: int | None = None

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        version = self.version()
        if version != self._version:
            self._version, self._handed = version, 0
        if not self._ready:
            room = self.samples_per_step - self._handed % self.samples_per_step
            taken = [self.queue.get(block, timeout)]
            while len(taken) < room:
                try:
                    taken.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            self._ready.extend(ship(self.monitor, taken, version=version))
            if not self._ready:
                raise queue.Empty
        self._handed += 1
        return self._ready.popleft()

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def qsize(self) -> int:
        return int(self.queue.qsize()) + len(self._ready)

    def empty(self) -> bool:
        return not self._ready and bool(self.queue.empty())

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        self.queue.put(item, block, timeout)

    def put_nowait(self, item: Any) -> None:
        self.queue.put_nowait(item)
