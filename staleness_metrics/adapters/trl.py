"""TRL's asynchronous GRPO (``trl.experimental.async_grpo``): its rollout samples, shipped as it
trains them, read with no import of TRL (1.16.0; ``docs/trainers/trl.md``)."""

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

from ..errors import ConfigError, FieldError, FieldTypeError, MissingFieldError, TraceError
from ..records.columnar import MAX_VERSION, RolloutBatch, as_numpy
from ._ship import Batches, SetAside, TrainerArray, TrainerNames, new_tensor_like, read_rows, ship_rows, take_rows

if TYPE_CHECKING:
    from ..monitor import StalenessMonitor


class _ByArray:
    """Values by an array's identity, each leaving with its array (arrays are unhashable)."""

    def __init__(self) -> None:
        self._found: dict[int, tuple[weakref.ref[Any], Any]] = {}

    def put(self, array: Any, value: Any) -> None:
        key = id(array)

        def forget(ref: weakref.ref[Any]) -> None:
            if self._found.get(key, (None,))[0] is ref:
                del self._found[key]

        self._found[key] = (weakref.ref(array, forget), value)

    def get(self, array: Any, *, pop: bool = False) -> Any:
        found = self._found.pop(id(array), None) if pop else self._found.get(id(array))
        if found is None or found[0]() is not array:
            raise KeyError(id(array))
        return found[1]


# lags of shipped samples by completion_mask (the array RolloutQueueDataset passes on)
_lags = _ByArray()

_NAMES = TrainerNames(
    "TRL", "self.model_version (the weights about to be trained: 0 before the first weight sync, 1 after it)",
    {"dispatch_version": "samples[{row}].model_version", "mask": "samples[{row}].completion_mask",
     "logprobs": "samples[{row}].old_log_probs"},
)  # fmt: skip


def _read(samples: Sequence[Any], ids: Sequence[str]) -> RolloutBatch:
    """One rollout of one sample per ``RolloutSample`` (``model_version``: dispatched under it)."""
    masks, logprobs, versions, groups, given = [], [], [], [], []
    for rid, sample in zip(ids, samples, strict=True):
        row = rid.rsplit("/", 1)[1]  # (the sample's index in the call, rows set aside or not)
        version = getattr(sample, "model_version", None)
        if version is None:
            raise TraceError(rid, f"samples[{row}].model_version", "missing or None on the RolloutSample")
        integer = isinstance(version, (int, np.integer)) and not isinstance(version, bool)
        if not integer or not 0 <= version <= MAX_VERSION:
            reason = f"expected an integer in 0..{MAX_VERSION}, got {version!r}"
            raise TraceError(rid, f"samples[{row}].model_version", reason)
        at = f"samples[{row}].completion_mask"
        try:
            mask = TrainerArray(getattr(sample, "completion_mask", None), at).array
        except FieldTypeError as error:
            raise TraceError(rid, at, error.reason) from None
        if mask.ndim != 1:
            raise TraceError(rid, at, f"expected one row, got shape {mask.shape}")
        if not mask.flags.writeable:  # refused before the add, not once shipped
            raise TraceError(rid, at, "read-only: the shipped mask is written back into it")
        old = getattr(sample, "old_log_probs", None)  # (None: missing, as in a record)
        old_values = np.zeros(len(mask)) if old is None else as_numpy(old).astype(np.float64)
        if old_values.shape != mask.shape:
            reason = f"length {len(old_values)} differs from completion_mask's {len(mask)}"
            raise TraceError(rid, f"samples[{row}].old_log_probs", reason)
        masks.append(mask)
        logprobs.append(old_values)
        given.append(old is not None)
        versions.append(int(version))
        group = getattr(sample, "group_id", None)
        groups.append(None if group is None else f"trl-group-{group}")
    lengths = np.array([len(m) for m in masks], dtype=np.int64)
    return RolloutBatch(
        ids=ids,
        sample_offsets=np.arange(len(samples) + 1, dtype=np.int64),
        position_offsets=np.concatenate(([0], np.cumsum(lengths))).astype(np.int64),
        mask=np.concatenate(masks) if masks else np.zeros(0, dtype=np.int64),  # (0.5: refused)
        dispatch_version=np.array(versions, dtype=np.int64),
        group_ids=groups,
        logprobs=np.concatenate(logprobs) if logprobs else np.zeros(0),
        present={"logprobs": np.array(given, dtype=bool)},
    )


def staleness_lag_of(completion_mask: Any) -> npt.NDArray[np.int64]:
    """The SPEC 11 lag of each position of a shipped sample (or of the dict
    ``RolloutQueueDataset`` made of it), found by its ``completion_mask``."""
    try:
        lag: npt.NDArray[np.int64] = _lags.get(completion_mask)
    except KeyError:
        reason = "this sample did not come through staleness_metrics.adapters.trl.ship"
        raise MissingFieldError("completion_mask", reason) from None
    return lag


def ship(monitor: StalenessMonitor, samples: Sequence[Any], *, version: int) -> list[Any]:
    """Ship TRL ``RolloutSample`` s at ``version`` (``self.model_version``): the same objects come
    back in ship order, masked in their ``completion_mask``, dropped and held ones left out
    (lags: :func:`staleness_lag_of`). In ``AsyncGRPOTrainer``, use :func:`ship_at_train_time`."""
    result, shipped = _shipped(monitor, samples, version, samples)
    result.handed_back(monitor)  # (its last act: a Ctrl-C before it, a repeat gets this result)
    return shipped


def _shipped(monitor: StalenessMonitor, samples: Sequence[Any], version: int, given: object) -> tuple[Any, list[Any]]:
    ids = [f"trl-{uuid.uuid4().hex[:12]}/{k}" for k in range(len(samples))]

    def read(rows: list[int] | None) -> tuple[RolloutBatch, list[Any], None]:
        kept = take_rows(list(samples), rows, len(ids))  # (lenient: the rows not set aside)
        return _read(kept, take_rows(ids, rows, len(ids))), kept, None

    def read_call(set_aside: SetAside) -> Batches[list[Any]]:  # (batch, samples, no write-back)
        return [read_rows(monitor, ids, read, _NAMES, set_aside=set_aside)]

    result, shipped = ship_rows(monitor, read_call, version=version, names=_NAMES, given=given), []
    for part in result.parts:
        offsets = part.batch.position_offsets
        for row, lag in zip(part.rows.tolist(), part.lags, strict=True):  # one sample per row
            sample = part.source[row]
            shipped_mask = part.batch.mask[int(offsets[row]) : int(offsets[row + 1])]
            TrainerArray(sample.completion_mask).write_back(shipped_mask)
            _lags.put(sample.completion_mask, lag)
            shipped.append(sample)
    return result, shipped  # (masked; result.handed_back: the caller's last act)


def packed_staleness_lag(row: Any) -> npt.NDArray[np.int64]:
    """The lag of every loss term of a ``TreeRow`` of shipped samples, in ``TreeRow.pack``'s
    order (per sample, each position ``p >= 1`` with ``completion_mask[p]``)."""
    masks = [sample["completion_mask"] for sample in row.samples]
    parts = [staleness_lag_of(mask)[1:][as_numpy(mask)[1:] != 0] for mask in masks]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


# Codes of a loss term in a micro-batch's decision (a value >= 0 is a kept term's lag).
_PADDING = -1  # no loss term there (TRL pads token_index with -1)
_VOID = -2  # a term of a dropped sample, or a masked position of a kept one
# the one term a row keeps, at advantage 0, when it lost every other (see _MicroBatch.decide)
_PLACEHOLDER = -3


@dataclass(frozen=True, slots=True)
class _Pulled:
    """A dict ``RolloutQueueDataset`` yielded, with the ``model_version`` it leaves out."""

    completion_mask: Any
    old_log_probs: Any
    group_id: Any
    model_version: Any


class _RecordingQueue:
    """``trainer.rollout_queue``, noting each sample's ``model_version`` by its ``completion_mask``
    (the one object ``RolloutQueueDataset``'s dict keeps)."""

    def __init__(self, rollout_queue: Any, versions: _ByArray) -> None:
        self.queue = rollout_queue
        self._versions = versions

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        sample = self.queue.get(block, timeout)
        mask = getattr(sample, "completion_mask", None)
        if mask is not None:  # else _read refuses the sample by name when it is shipped
            self._versions.put(mask, getattr(sample, "model_version", None))
        return sample

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def __getattr__(self, name: str) -> Any:  # qsize, empty, put ...: the queue's own
        return getattr(self.queue, name)


@dataclass
class _MicroBatch:
    """A collated micro-batch: per row (process), each loss term's sample and position."""

    samples: list[_Pulled]
    term_sample: list[npt.NDArray[np.int64]]
    term_position: list[npt.NDArray[np.int64]]
    width: int  # of token_index, padded across rows

    def decide(self, lag_of: dict[int, npt.NDArray[np.int64]]) -> npt.NDArray[np.int64]:
        """``[rows, width + 1]``: each term's code (a kept one's lag), then ``global_n_tokens``."""
        codes = np.full((len(self.term_sample), self.width + 1), _PADDING, dtype=np.int64)
        for r, (term_sample, term_position) in enumerate(zip(self.term_sample, self.term_position, strict=True)):
            row = np.full(len(term_sample), _VOID, dtype=np.int64)
            for k in np.unique(term_sample).tolist():
                lag = lag_of.get(id(self.samples[k]))
                if lag is None:
                    continue  # dropped
                terms = np.flatnonzero(term_sample == k)
                position = term_position[terms]
                trains = as_numpy(self.samples[k].completion_mask)[position] != 0  # shipped mask
                row[terms] = np.where(trains, lag[position], _VOID)
            if len(row) and not (row >= 0).any():
                row[0] = _PLACEHOLDER
            codes[r, : len(row)] = row
        codes[:, self.width] = int((codes[:, : self.width] >= 0).sum())
        return codes


class TrainTimeShipping:
    """Ships each optimizer step of TRL's ``AsyncGRPOTrainer`` at the version that trains it
    (made by :func:`ship_at_train_time`); ``versions``: the ``version`` of each ship, in order."""

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
        self._pulled = _ByArray()  # model_version by completion_mask
        self._ids = itertools.count()
        self._collated: dict[int, _MicroBatch] = {}  # by micro-batch id, until its step ships
        self._step_of: dict[int, tuple[int, ...]] = {}  # micro-batch id -> its step's ids
        self._decided: dict[int, npt.NDArray[np.int64]] = {}  # micro-batch id -> _MicroBatch.decide
        if getattr(trainer, "rollout_queue", None) is not None:  # rank 0 only
            trainer.rollout_queue = _RecordingQueue(trainer.rollout_queue, self._pulled)
        get_train_dataloader = trainer.get_train_dataloader
        get_batch_samples = trainer.get_batch_samples
        training_step = trainer.training_step

        def dataloader() -> Any:
            loader = get_train_dataloader()
            # accelerate's DataLoaderDispatcher iterates the wrapped loader; collate_fn is read then
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

    def _version(self, mask: Any) -> Any:
        try:
            return self._pulled.get(mask, pop=True)
        except KeyError:
            raise RuntimeError(
                "a sample reached TRL's collator without passing trainer.rollout_queue "
                "as wrapped by ship_at_train_time: call ship_at_train_time(trainer, "
                "monitor) before trainer.train()"
            ) from None

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
                    samples.append(_Pulled(mask, item["old_log_probs"], item["group_id"], self._version(mask)))
                    # TreeRow.pack's loss terms
                    positions.append(np.flatnonzero(as_numpy(mask)[1:] != 0) + 1)
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
        """Ship this micro-batch's step unless shipped, then apply the decision to its tensors."""
        microbatch = _microbatch_id(inputs)
        accelerator = self.trainer.accelerator
        processes = int(accelerator.num_processes)
        index = inputs["token_index"]
        if accelerator.is_main_process:
            if microbatch not in self._decided:
                self._ship_step(self._step_of.get(microbatch, (microbatch,)))
            codes = self._decided[microbatch]  # (kept until the next step ships: a retry applies it)
        else:
            codes = np.zeros((processes, int(index.shape[1]) + 1), dtype=np.int64)
        if processes > 1:  # rank 0 shipped: every rank takes its row of rank 0's decision
            broadcast = importlib.import_module("accelerate.utils").broadcast
            codes = broadcast(new_tensor_like(index, codes), from_process=0).cpu().numpy()
        local = int(index.shape[0])
        start = int(accelerator.process_index) * local
        _apply(inputs, codes[start : start + local, :-1], int(codes[0, -1]))

    def _ship_step(self, microbatches: tuple[int, ...]) -> None:
        records = {m: self._collated[m] for m in microbatches if m in self._collated}
        if not records:
            raise RuntimeError(
                f"micro-batch {microbatches[0]} was not collated here: call "
                "ship_at_train_time(trainer, monitor) before trainer.train()"
            )
        version = self.trainer.model_version
        samples = [sample for record in records.values() for sample in record.samples]
        given = next(iter(records.values()))  # (the same object when a step that did not ship retries)
        result, shipped = _shipped(self.monitor, samples, version, given)
        lag_of = {id(sample): _lags.get(sample.completion_mask) for sample in shipped}
        self._decided = {m: record.decide(lag_of) for m, record in records.items()}
        self.versions.append(int(version))  # (decided first: a retry after it ships no more)
        last = max(microbatches)  # shipped: forgotten only now (a step interrupted is retried)
        self._collated = {m: record for m, record in self._collated.items() if m > last}
        self._step_of = {m: step for m, step in self._step_of.items() if m > last}
        result.handed_back(self.monitor)


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
    """One rank's rows of a decision into TRL's tensors (voided terms and unread labels out)."""
    index = inputs["token_index"]
    positions = as_numpy(index)
    void = (codes == _VOID) & (positions >= 0)  # (a step retried: its voided terms' index is -1)
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
    before it trains the step, and train only what the ship keeps (each micro-batch's
    ``staleness_lag`` holds each kept term's lag). Call it once the trainer is built, before
    ``trainer.train()``; what it wraps and what it cannot change: ``docs/trainers/trl.md``."""
    return TrainTimeShipping(trainer, monitor)
