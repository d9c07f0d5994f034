"""TRL's asynchronous GRPO (``trl.experimental.async_grpo``): its rollout samples,
shipped as it trains them.

Built from TRL's own source (release 1.16.0), with no import of it:

- ``trl/experimental/async_grpo/async_rollout_worker.py``: a ``RolloutSample`` (a slotted dataclass)
  is one training row of one conversation: ``input_ids``, ``completion_mask`` (1 on the tokens the
  loss is taken over), ``old_log_probs`` (the generator's log-probability of each token, aligned
  with ``input_ids``), ``advantage``, ``group_id`` (the prompt group) and ``model_version``: the
  worker's policy version when the group was dispatched. A sample carries no per-token version.
- ``trl/experimental/async_grpo/async_grpo_trainer.py``: the worker fills ``rollout_queue``;
  ``RolloutQueueDataset.__iter__`` takes one sample at a time, drops it when
  ``version - sample.model_version > max_staleness`` (``version`` = the trainer's
  ``self.model_version``, bumped after every weight sync in ``_sync_weight_merged``: 0 before the
  first, 1 after it), logs ``sample/staleness_mean`` / ``sample/staleness_max`` /
  ``sample/dropped_stale_total``, and yields a dict without ``model_version``; the batchers fold the
  dicts into ``packing.TreeRow`` prefix tries, and ``TreeRow.pack`` lays out one loss term per
  trained token (``token_index``, ``old_log_probs``, ``segment_id``).

The samples must be judged at the version that trains them, not when the dataset pulls them:
accelerate's ``DataLoaderDispatcher`` pulls the next micro-batch before handing out the current one,
across the weight sync that ends a step (``TokenBudgetBatcher`` pulls the sample that closes a
micro-batch one micro-batch earlier still). So :func:`ship_at_train_time` ships in
``training_step``, one ship per optimizer step (``get_batch_samples`` fetches a step's micro-batches
together), and voids what the ship leaves out in the packed tensors of each micro-batch; it notes
each sample's ``model_version`` at the rollout queue, where the sample still has it. :func:`ship` is
the lower-level call on a list of samples. Mapping: each sample is one rollout with one sample
(``dispatch_version`` = ``model_version``; every completion token is unlabelled and takes it),
``group_id`` is its group.

The SPEC 11 lag of every loss term is in each micro-batch's ``staleness_lag`` (padded like
``token_index``), so ``inputs["staleness_lag"][selected]`` lines up with ``old_log_probs`` and the
trainer's ``log_probs`` in ``compute_loss``; :func:`packed_staleness_lag` gives it for a ``TreeRow``
of samples shipped with :func:`ship`.
"""

from __future__ import annotations

import importlib
import itertools
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError, FieldError, MissingFieldError, TraceError
from ..records.columnar import RolloutBatch
from ._ship import TrainerNames, new_tensor_like, ship_rows

if TYPE_CHECKING:
    from ..monitor import StalenessMonitor

__all__ = [
    "TrainTimeShipping",
    "packed_staleness_lag",
    "ship",
    "ship_at_train_time",
    "staleness_lag_of",
]


# Lags of shipped samples, by the identity of their completion_mask array (RolloutSample has
# __slots__ and RolloutQueueDataset passes that very array on; the weak reference keeps a
# reused id from matching).
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
    """One rollout of one sample per ``RolloutSample``: its mask,
    ``model_version`` and ``group_id``."""
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
    """The SPEC 11 lag of each position of a shipped sample (or of the dict
    ``RolloutQueueDataset`` made of it), found by its ``completion_mask``: ``T - model_version``
    on completion tokens, -1 elsewhere."""
    found = _lags.get(id(completion_mask))
    if found is None or found[0]() is not completion_mask:
        raise MissingFieldError(
            "completion_mask",
            "this sample did not come through staleness_metrics.adapters.trl.ship",
        )
    return found[1]


def ship(monitor: StalenessMonitor, samples: Sequence[Any], *, version: int) -> list[Any]:
    """Ship TRL ``RolloutSample`` s at the trainer's ``version`` (its ``self.model_version``).

    The samples are added and shipped at step ``version + 1``; the shipped mask is written into each
    sample's own ``completion_mask``; the samples dropped for staleness (or held back) are left out,
    and the returned list holds the same objects, in ship order, samples held by an earlier call
    included once a ship takes them. Each returned sample's lag is kept for :func:`staleness_lag_of`
    / :func:`packed_staleness_lag` (the slotted ``RolloutSample`` takes no new attribute).

    This is the lower-level call, for samples not yet packed; in ``AsyncGRPOTrainer``
    use :func:`ship_at_train_time`, which ships each optimizer step's samples at the
    version that trains them.
    """
    return [sample for sample, _ in _shipped(monitor, samples, version)]


def _shipped(
    monitor: StalenessMonitor, samples: Sequence[Any], version: int
) -> list[tuple[Any, npt.NDArray[np.int64]]]:
    """:func:`ship`, each shipped sample with its lag."""
    batch = _read(samples)
    result = ship_rows(monitor, batch, list(samples), version=version, names=NAMES)
    out: list[tuple[Any, npt.NDArray[np.int64]]] = []
    for part in result.parts:
        offsets = part.batch.position_offsets
        for row, lag in zip(part.rows.tolist(), part.lags, strict=True):  # one sample per row
            sample = part.source[row]
            _write_mask(sample, part.batch.mask[int(offsets[row]) : int(offsets[row + 1])])
            _remember_lag(sample, lag)
            out.append((sample, lag))
    return out


def packed_staleness_lag(row: Any) -> npt.NDArray[np.int64]:
    """The lag of every loss term of a ``TreeRow`` (its ``samples`` are the dicts
    ``RolloutQueueDataset`` yields), in ``TreeRow.pack``'s order: per sample, each position
    ``p >= 1`` with ``completion_mask[p]``."""
    parts = []
    for sample in row.samples:
        mask = sample["completion_mask"]
        lag = staleness_lag_of(mask)
        trained = _numpy(mask)[1:] != 0
        parts.append(lag[1:][trained])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


# Codes of a loss term in a micro-batch's decision (a value >= 0 is a kept term's lag).
_PADDING = -1  # no loss term there (TRL pads token_index with -1)
_VOID = -2  # a term of a dropped sample, or a masked position of a kept one
# the one term a row keeps, at advantage 0, when it lost every other (see _decide)
_PLACEHOLDER = -3


@dataclass(frozen=True, slots=True)
class _Pulled:
    """One dict ``RolloutQueueDataset`` yielded, with the ``model_version`` the dict leaves
    out (read from the sample at the rollout queue): the fields :func:`ship` reads, the very
    arrays of the sample."""

    input_ids: Any
    completion_mask: Any
    old_log_probs: Any
    group_id: Any
    model_version: Any


class _VersionsByMask:
    """``model_version`` of each sample pulled from the rollout queue, by its
    ``completion_mask`` array (the one object the dataset's dict shares with the sample); an
    entry leaves with its array."""

    def __init__(self) -> None:
        self._by_mask: dict[int, tuple[weakref.ref[Any], Any]] = {}

    def remember(self, sample: Any) -> None:
        mask = getattr(sample, "completion_mask", None)
        if mask is None:
            return  # _read refuses the sample by name when it is shipped
        key = id(mask)

        def forget(ref: weakref.ref[Any]) -> None:
            if self._by_mask.get(key, (None,))[0] is ref:
                del self._by_mask[key]

        self._by_mask[key] = (weakref.ref(mask, forget), getattr(sample, "model_version", None))

    def take(self, mask: Any) -> Any:
        found = self._by_mask.pop(id(mask), None)
        if found is None or found[0]() is not mask:
            raise RuntimeError(
                "a sample reached TRL's collator without passing trainer.rollout_queue "
                "as wrapped by ship_at_train_time: call ship_at_train_time(trainer, "
                "monitor) before trainer.train()"
            )
        return found[1]


class _RecordingQueue:
    """``trainer.rollout_queue`` as ``RolloutQueueDataset`` reads it, noting
    each sample's version."""

    def __init__(self, rollout_queue: Any, versions: _VersionsByMask) -> None:
        self.queue = rollout_queue
        self._versions = versions

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        sample = self.queue.get(block, timeout)
        self._versions.remember(sample)
        return sample

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def __getattr__(self, name: str) -> Any:  # qsize, empty, put ...: the queue's own
        return getattr(self.queue, name)


@dataclass
class _MicroBatch:
    """What TRL's collator packed into one micro-batch: its samples, and per row (one per
    process) the sample and the position of each loss term, in ``TreeRow.pack``'s order (the
    order of ``token_index``)."""

    samples: list[_Pulled]
    term_sample: list[npt.NDArray[np.int64]]
    term_position: list[npt.NDArray[np.int64]]
    width: int  # of token_index, padded across rows

    def decide(self, lag_of: dict[int, npt.NDArray[np.int64]]) -> npt.NDArray[np.int64]:
        """``[rows, width + 1]``: each loss term's code (its lag when kept), and in the last column
        the number of kept terms of the whole micro-batch (TRL's ``global_n_tokens``)."""
        codes = np.full((len(self.term_sample), self.width + 1), _PADDING, dtype=np.int64)
        for r, (term_sample, term_position) in enumerate(zip(self.term_sample, self.term_position, strict=True)):
            row = np.full(len(term_sample), _VOID, dtype=np.int64)
            for k in np.unique(term_sample).tolist():
                lag = lag_of.get(id(self.samples[k]))
                if lag is None:
                    continue  # dropped
                terms = np.flatnonzero(term_sample == k)
                position = term_position[terms]
                trains = _numpy(self.samples[k].completion_mask)[position] != 0  # the shipped mask
                row[terms] = np.where(trains, lag[position], _VOID)
            if len(row) and not (row >= 0).any():
                row[0] = _PLACEHOLDER
            codes[r, : len(row)] = row
        codes[:, self.width] = int((codes[:, : self.width] >= 0).sum())
        return codes


class TrainTimeShipping:
    """Ships each optimizer step of TRL's ``AsyncGRPOTrainer`` at the version that trains it.

    Made by :func:`ship_at_train_time`, which says what it wraps. ``versions`` lists the ``version``
    of each ship, one per optimizer step, in order.
    """

    def __init__(self, trainer: Any, monitor: StalenessMonitor) -> None:
        if getattr(trainer, "staleness_shipping", None) is not None:
            raise FieldError("ship_at_train_time", "this trainer ships already (call it once per trainer)")
        if monitor.sink.policy.holds:
            raise ConfigError(
                "ship_at_train_time: the policy holds rollouts back (xtuner with "
                "retry_expired), and a packed TRL micro-batch cannot take a held sample back at "
                "a later step; use another policy, or staleness_metrics.adapters.trl.ship on "
                "the samples before they are packed",
                field="policy",
                reason="holds rollouts back",
            )
        self.trainer = trainer
        self.monitor = monitor
        self.versions: list[int] = []
        self._pulled = _VersionsByMask()
        self._ids = itertools.count()
        self._collated: dict[int, _MicroBatch] = {}  # by micro-batch id, until its step ships
        # micro-batch id -> the ids of its optimizer step
        self._step_of: dict[int, tuple[int, ...]] = {}
        self._decided: dict[int, npt.NDArray[np.int64]] = {}  # micro-batch id -> _MicroBatch.decide
        if getattr(trainer, "rollout_queue", None) is not None:  # rank 0 only
            trainer.rollout_queue = _RecordingQueue(trainer.rollout_queue, self._pulled)
        get_train_dataloader = trainer.get_train_dataloader
        get_batch_samples = trainer.get_batch_samples
        training_step = trainer.training_step

        def dataloader() -> Any:
            loader = get_train_dataloader()
            # accelerate's DataLoaderDispatcher iterates the DataLoader it wraps, which reads
            # collate_fn when it makes its iterator
            wrapped = vars(loader).get("base_dataloader", loader)
            wrapped.collate_fn = self._collate(wrapped.collate_fn)
            return loader

        def batch_samples(epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            batches, count = get_batch_samples(epoch_iterator, num_batches, device)
            if trainer.accelerator.is_main_process:  # the one that ships
                ids = tuple(_microbatch_id(batch) for batch in batches)
                self._step_of.update(dict.fromkeys(ids, ids))
            return batches, count

        def step(model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
            self.before_loss(inputs)
            return training_step(model, inputs, num_items_in_batch)

        trainer.get_train_dataloader = dataloader
        trainer.get_batch_samples = batch_samples
        trainer.training_step = step
        trainer.staleness_shipping = self

    def _collate(self, collator: Callable[[list[Any]], dict[str, Any]]) -> Callable[[list[Any]], dict[str, Any]]:
        def collate(examples: list[Any]) -> dict[str, Any]:
            batch = collator(examples)
            (rows,) = examples  # DataCollatorForRollout: one micro-batch, one TreeRow per process
            index = batch["token_index"]
            samples: list[_Pulled] = []
            term_sample, term_position = [], []
            for r, row in enumerate(rows):
                first = len(samples)
                positions = []
                for item in row.samples:
                    mask = item["completion_mask"]
                    samples.append(
                        _Pulled(
                            item["input_ids"],
                            mask,
                            item["old_log_probs"],
                            item["group_id"],
                            self._pulled.take(mask),
                        )
                    )
                    # TreeRow.pack's loss terms
                    positions.append(np.flatnonzero(_numpy(mask)[1:] != 0) + 1)
                counts = [len(p) for p in positions]
                term_sample.append(np.repeat(np.arange(first, len(samples), dtype=np.int64), counts))
                term_position.append(np.concatenate(positions).astype(np.int64) if positions else np.zeros(0, np.int64))
                if len(term_sample[-1]) != int((index[r] >= 0).sum()):
                    raise RuntimeError(
                        f"row {r}: {len(term_sample[-1])} loss terms expected from "
                        f"completion_mask, token_index has {int((index[r] >= 0).sum())}: TRL's "
                        "packing is not the one this adapter reads (1.16.0)"
                    )
            microbatch = next(self._ids)
            self._collated[microbatch] = _MicroBatch(samples, term_sample, term_position, int(index.shape[1]))
            batch["staleness_microbatch"] = new_tensor_like(index, np.full(len(rows), microbatch, dtype=np.int64))
            batch["staleness_lag"] = new_tensor_like(index, np.full(tuple(index.shape), -1, dtype=np.int64))
            return batch

        return collate

    def before_loss(self, inputs: dict[str, Any]) -> None:
        """Ship the step of this micro-batch if it has not shipped yet, then void its dropped and
        masked loss terms and fill ``staleness_lag``, in the micro-batch's own tensors."""
        microbatch = _microbatch_id(inputs)
        accelerator = self.trainer.accelerator
        processes = int(accelerator.num_processes)
        index = inputs["token_index"]
        if accelerator.is_main_process:
            if microbatch not in self._decided:
                self._ship_step(self._step_of.pop(microbatch, (microbatch,)))
            codes = self._decided.pop(microbatch)
        else:
            codes = np.zeros((processes, int(index.shape[1]) + 1), dtype=np.int64)
        if processes > 1:  # rank 0 shipped: every rank takes its row of rank 0's decision
            # imported by the trainer already
            broadcast = importlib.import_module("accelerate.utils").broadcast
            codes = broadcast(new_tensor_like(index, codes), from_process=0).cpu().numpy()
        local = int(index.shape[0])
        start = int(accelerator.process_index) * local
        _apply(inputs, codes[start : start + local, :-1], int(codes[0, -1]))

    def _ship_step(self, microbatches: tuple[int, ...]) -> None:
        for other in microbatches:
            self._step_of.pop(other, None)
        records = {m: self._collated.pop(m) for m in microbatches if m in self._collated}
        if not records:
            raise RuntimeError(
                f"micro-batch {microbatches[0]} was not collated here: call "
                "ship_at_train_time(trainer, monitor) before trainer.train()"
            )
        version = self.trainer.model_version
        samples = [sample for record in records.values() for sample in record.samples]
        lag_of = {id(sample): lag for sample, lag in _shipped(self.monitor, samples, version)}
        self.versions.append(int(version))
        for m, record in records.items():
            self._decided[m] = record.decide(lag_of)


def _microbatch_id(inputs: dict[str, Any]) -> int:
    found = inputs.get("staleness_microbatch")
    if found is None:
        raise RuntimeError(
            "a TRL micro-batch without staleness_microbatch: call "
            "ship_at_train_time(trainer, monitor) before trainer.train() (it wraps the "
            "collator that get_train_dataloader builds)"
        )
    return int(found.reshape(-1)[0])


def _apply(inputs: dict[str, Any], codes: npt.NDArray[np.int64], kept_terms: int) -> None:
    """One rank's rows of a decision into TRL's tensors: a voided term leaves ``token_index``
    (so ``compute_loss``'s ``selected`` and everything taken through it skip it) with advantage
    0, a position no kept term reads any more leaves ``shift_labels``, ``global_n_tokens``
    counts the kept terms."""
    index = inputs["token_index"]
    void = codes == _VOID
    positions = _numpy(index)
    labels = inputs["shift_labels"]
    unread = np.zeros(tuple(labels.shape), dtype=bool)
    for row in range(len(codes)):
        read = positions[row][(codes[row] >= 0) | (codes[row] == _PLACEHOLDER)]
        unread[row, np.setdiff1d(positions[row][void[row]], read)] = True
    labels[new_tensor_like(labels, unread)] = -100
    index[new_tensor_like(index, void)] = -1
    inputs["advantages"][new_tensor_like(index, void | (codes == _PLACEHOLDER))] = 0
    inputs["staleness_lag"].copy_(new_tensor_like(index, np.where(codes >= 0, codes, -1)))
    inputs["global_n_tokens"].fill_(float(kept_terms))


def ship_at_train_time(trainer: Any, monitor: StalenessMonitor) -> TrainTimeShipping:
    """Make TRL's ``AsyncGRPOTrainer`` ship every optimizer step at ``trainer.model_version`` just
    before it trains the step, and train only what the ship keeps. Call it once the trainer is
    built, before ``trainer.train()``.

    It wraps four things of the trainer (its own attributes; nothing of TRL's classes changes):

    - ``trainer.rollout_queue`` (rank 0), to note each sample's ``model_version``, which the dicts
      ``RolloutQueueDataset`` yields leave out;
    - the collator ``get_train_dataloader`` builds (``DataCollatorForRollout``): each
      micro-batch gets an id (``staleness_microbatch``) and ``staleness_lag`` (-1 until it
      ships, padded like ``token_index``);
    - ``get_batch_samples``, which fetches the micro-batches of one optimizer step: they ship
      together, so each step has one ship, at step ``model_version + 1``;
    - ``training_step``: before the first loss of a step, rank 0 ships the step's samples at
      ``trainer.model_version`` (the weights this step trains: the last weight sync happened at the
      end of the step before). Then, in each micro-batch's own tensors, the loss terms of dropped
      samples and of masked positions leave ``token_index`` (set to -1, so ``compute_loss``'s
      ``selected`` skips them: no loss, no gradient, not in TRL's ratio/kl/entropy statistics) with
      ``advantages`` 0, the positions no kept term reads leave ``shift_labels`` (-100),
      ``global_n_tokens`` counts the kept terms (TRL's per-token normalisation), and
      ``staleness_lag`` holds each kept term's lag.

    A packed micro-batch cannot lose a sample: its tokens stay in the prefix trie (shared prefixes
    are forwarded once for several samples) and are still forwarded, contributing nothing. A process
    whose row loses every term keeps its first one with advantage 0, which adds exactly 0 to the
    loss and the gradient (``compute_loss`` needs a term per row); that term counts in TRL's
    ratio/kl statistics only. Advantages are TRL's rollout worker's, computed per group before the
    sample was queued, so a dropped sample's reward stays in its group's baseline.

    With several processes, only rank 0 collates and knows ``model_version`` (TRL bumps it there):
    rank 0 ships and broadcasts the decision, every rank applies its own row.
    """
    return TrainTimeShipping(trainer, monitor)
