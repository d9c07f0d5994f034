"""prime-rl's ``TrainingSample`` lists, live in its orchestrator, as a :class:`RolloutBatch` and
back, read with no import of prime-rl (``docs/trainers/prime-rl.md``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..engine.shipment import Shipment
from ..errors import FieldError, MissingFieldError
from ..records.columnar import WEIGHT_FIELDS, RolloutBatch
from ._ship import TrainerNames, ship_rows

PolicySpan = tuple[int | None, int | None]  # (policy.start, policy.end); start None = frozen


def _get(sample: Any, name: str) -> Any:
    return sample.get(name) if isinstance(sample, Mapping) else getattr(sample, name, None)


def _concat(parts: list[npt.NDArray[Any]], dtype: type) -> npt.NDArray[Any]:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def from_training_samples(
    samples: Sequence[Any],
    rollout_ids: Sequence[str],
    policy: Mapping[str, PolicySpan],
    *,
    group_ids: Mapping[str, str] | None = None,
) -> RolloutBatch:
    """The rollouts of ``samples`` (``TrainingSample`` objects or dicts), each sample one SPEC 3
    sample: ``rollout_ids[i]`` is the rollout of ``samples[i]`` (a rollout's samples adjacent, in
    branch order), ``policy`` maps each rollout id to its ``(policy.start, policy.end)``, the
    dispatch and completion versions (no policy: ``frozen``)."""
    if len(rollout_ids) != len(samples):
        raise FieldError("rollout_ids", f"{len(rollout_ids)} ids for {len(samples)} samples")
    starts = [i for i, rid in enumerate(rollout_ids) if i == 0 or rollout_ids[i - 1] != rid]
    ids = [rollout_ids[i] for i in starts]
    if len(set(ids)) != len(ids):
        raise FieldError("rollout_ids", "the samples of one rollout must be adjacent")
    missing = [rid for rid in ids if rid not in policy]
    if missing:
        raise MissingFieldError("policy", f"no (start, end) for rollout {missing[0]!r}", rollout=missing[0])

    masks = [np.asarray(_get(s, "mask"), dtype=np.float32) for s in samples]
    lengths = np.array([len(m) for m in masks], dtype=np.int64)
    arrays: dict[str, Any] = {}
    present: dict[str, npt.NDArray[np.bool_]] = {}
    for name in (*WEIGHT_FIELDS, "logprobs"):
        values = [_get(s, name) for s in samples]
        have = np.array([v is not None for v in values], dtype=bool)
        if have.any():  # an absent array is filled with what absence means (rl 1.0, the others 0)
            fill = 1.0 if name == "rl_weights" else 0.0
            parts = [
                np.asarray(v, dtype=np.float64) if v is not None else np.full(n, fill, np.float64)
                for v, n in zip(values, lengths.tolist(), strict=True)
            ]
            arrays[name] = _concat(parts, np.float64)  # float64: written back exactly as given
            present[name] = have
    spans = [policy[rid] for rid in ids]
    dispatch = np.array([-1 if start is None else start for start, _ in spans])  # 2.9: refused
    completion = np.array([-1 if start is None or end is None else end for start, end in spans])
    return RolloutBatch(
        ids=ids,
        sample_offsets=np.array([*starts, len(samples)], dtype=np.int64),
        position_offsets=np.concatenate(([0], np.cumsum(lengths))).astype(np.int64),
        mask=_concat(masks, np.float32),
        dispatch_version=dispatch,
        completion_version=completion,
        frozen=np.array([start is None for start, _ in spans], dtype=bool),
        group_ids=None if group_ids is None else [group_ids.get(rid) for rid in ids],
        envs=[_get(samples[first], "env_name") for first in starts],
        present=present,
        **arrays,
    )


def shipped_samples(shipment: Shipment, batch: RolloutBatch, samples: Sequence[Any]) -> list[Any]:
    """The samples of ``batch`` that ``shipment`` shipped, in ship order, the masked ``mask`` and
    weights written back into them (``samples`` as given to :func:`from_training_samples`)."""
    return [
        _written_back(samples, batch, int(batch.sample_offsets[rollout.index]) + local)
        for rollout in shipment.rollouts
        if rollout.batch is batch
        for local in rollout.samples
    ]


def _written_back(samples: Sequence[Any], batch: RolloutBatch, index: int) -> Any:
    lo, hi = int(batch.position_offsets[index]), int(batch.position_offsets[index + 1])
    sample = samples[index]
    _set(sample, "mask", (batch.mask[lo:hi] != 0).tolist())
    for name in WEIGHT_FIELDS:
        values = getattr(batch, name)
        if values is not None and batch.present[name][index]:
            _set(sample, name, values[lo:hi].tolist())
    return sample


def _set(sample: Any, name: str, value: Any) -> None:
    if isinstance(sample, dict):
        sample[name] = value
    else:
        setattr(sample, name, value)


_NAMES = TrainerNames(
    "prime-rl",
    "progress.step - 1 (batch `step` trains policy v{step-1})",
    {
        "dispatch_version": "policy.start of rollout_ids[...] #{row}",
        "completion_version": "policy.end of rollout_ids[...] #{row}",
        "mask": "TrainingSample.mask of rollout #{row}",
    },
)


def policy_span(policy: Any) -> PolicySpan:
    """``(start, end)`` of a policy (object or dict); ``(None, None)`` for ``None`` (frozen)."""
    return (None, None) if policy is None else (_get(policy, "start"), _get(policy, "end"))


class ShippedSamples(list[Any]):
    """The shipped ``TrainingSample`` objects, plus what a msgspec struct cannot carry:
    ``staleness_lag`` (one SPEC 11 lag array per sample) and the ``shipment``."""

    staleness_lag: list[npt.NDArray[np.int64]]
    shipment: Shipment


def ship(
    monitor: Any,
    samples: Sequence[Any],
    *,
    version: int,
    rollout_ids: Sequence[str],
    policy: Mapping[str, PolicySpan],
    group_ids: Mapping[str, str] | None = None,
) -> ShippedSamples:
    """SPEC 15's one call for prime-rl: add and ship a batch's samples at ``version``
    (``progress.step - 1``) and return the samples to pack, masked, the dropped ones left out (the
    other arguments: :func:`from_training_samples`)."""
    batch = from_training_samples(samples, rollout_ids, policy, group_ids=group_ids)
    result = ship_rows(monitor, [(batch, list(samples), None)], version=version, names=_NAMES)
    out = ShippedSamples()
    out.staleness_lag = [lag for part in result.parts for lag in part.lags]  # one per kept sample
    out.shipment = result.shipment
    for part in result.parts:
        for row, kept in zip(part.rows.tolist(), part.samples):
            first = int(part.batch.sample_offsets[row])
            out.extend(_written_back(part.source, part.batch, first + local) for local in kept)
    return out
