"""prime-rl's ``TrainingSample`` lists, live in its orchestrator, as a
:class:`RolloutBatch` and back.

Built from prime-rl's own source, with no import of it:

- ``src/prime_rl/transport/types.py`` as of ``Stars1233/prime-rl`` @
  ``289562d2ec28e9ff2fdd6625aaed2964cf5a7679`` (a mirror of ``PrimeIntellect-ai/prime-rl``): a
  ``TrainingSample`` is one branch of a rollout as a flat sequence: ``token_ids``, ``mask``
  (trainable, model-sampled positions), ``logprobs``, ``temperatures``, ``env_name``, and the
  optional per-token ``rl_weights`` / ``ce_weights`` / ``ref_kl_weights`` (``None`` = absent: rl
  weight 1.0 on the mask, no ce / ref-KL component), all of the length of ``token_ids``.
- ``PrimeIntellect-ai/prime-rl`` @ ``31398ee1fb0d443d132780588a2d3b5dc63a38ea``,
  ``src/prime_rl/orchestrator/train_sink.py`` (``TrainSink``): ``process_rollout`` tokenises
  each arriving rollout into its samples (``raw["_samples"]``) and records
  ``raw["_policy_version"]``; ``process_batch`` pops a cohort and assembles the trainer-bound
  sample list. The episode's policy span is ``policy.start`` / ``policy.end`` of its record
  (``run.work.policy``; see :mod:`.prime_rl`).

Mapping: a rollout (trace) is one SPEC 3 rollout and each of its ``TrainingSample`` s one
sample; the dispatch version is ``policy.start`` and the completion version ``policy.end``; a
rollout without a policy (a frozen-model episode) is ``frozen``. Samples carry no per-token
version, so every sampled position is unlabelled and takes ``policy.start`` (prime-rl's own rule
for engines without labels).

Where to call it in prime-rl's orchestrator: ``monitor.add(from_training_samples(...))`` at the end
of ``TrainSink.process_rollout`` (or per group in ``process_group``, which knows the group), and in
``process_batch``, before the sample list is built, ``shipment = monitor.ship(step)`` then
``samples = shipped_samples(shipment, batch, samples)``: the masked arrays are written back into the
samples and the dropped ones left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..engine.shipment import Shipment
from ..errors import FieldError, MissingFieldError
from ..records.columnar import WEIGHT_FIELDS, RolloutBatch
from ._ship import TrainerNames, ship_rows

__all__ = [
    "PolicySpan",
    "ShippedSamples",
    "from_training_samples",
    "policy_span",
    "ship",
    "shipped_samples",
]

PolicySpan = tuple[int | None, int | None]  # (policy.start, policy.end); start None = frozen


def _get(sample: Any, name: str) -> Any:
    if isinstance(sample, Mapping):
        return sample.get(name)
    return getattr(sample, name, None)


def _concat(parts: list[npt.NDArray[Any]], dtype: type) -> npt.NDArray[Any]:
    if not parts:
        return np.zeros(0, dtype=dtype)
    return np.concatenate(parts).astype(dtype, copy=False)


def from_training_samples(
    samples: Sequence[Any],
    rollout_ids: Sequence[str],
    policy: Mapping[str, PolicySpan],
    *,
    group_ids: Mapping[str, str] | None = None,
) -> RolloutBatch:
    """The rollouts of ``samples`` (``TrainingSample`` objects or dicts with the same fields).

    ``rollout_ids[i]`` is the rollout (trace) of ``samples[i]``; the samples of one rollout must be
    adjacent, in branch order. ``policy`` maps each rollout id to its
    ``(policy.start, policy.end)``.
    """
    if len(rollout_ids) != len(samples):
        raise FieldError("rollout_ids", f"{len(rollout_ids)} ids for {len(samples)} samples")
    ids: list[str] = []
    starts: list[int] = []
    for index, rid in enumerate(rollout_ids):
        if not ids or ids[-1] != rid:
            ids.append(rid)
            starts.append(index)
    if len(set(ids)) != len(ids):
        raise FieldError("rollout_ids", "the samples of one rollout must be adjacent")
    missing = [rid for rid in ids if rid not in policy]
    if missing:
        raise MissingFieldError("policy", f"no (start, end) for rollout {missing[0]!r}", rollout=missing[0])

    masks = [np.asarray(_get(s, "mask"), dtype=np.float32) for s in samples]
    lengths = np.array([len(m) for m in masks], dtype=np.int64)
    position_offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    arrays: dict[str, npt.NDArray[Any]] = {}
    present: dict[str, npt.NDArray[np.bool_]] = {}
    for name in (*WEIGHT_FIELDS, "logprobs"):
        values = [_get(s, name) for s in samples]
        have = np.array([v is not None for v in values], dtype=bool)
        if have.any():
            # An absent array is filled with what absence means (rl 1.0, the
            # others 0) and marked absent.
            fill = 1.0 if name == "rl_weights" else 0.0
            parts = [
                np.asarray(v, dtype=np.float64) if v is not None else np.full(n, fill, np.float64)
                for v, n in zip(values, lengths.tolist(), strict=True)
            ]
            arrays[name] = _concat(parts, np.float64)  # float64: written back exactly as given
            present[name] = have
    spans = [policy[rid] for rid in ids]
    frozen = np.array([start is None for start, _ in spans], dtype=bool)
    dispatch = np.array([-1 if start is None else start for start, _ in spans], dtype=np.int64)
    completion = np.array([-1 if start is None or end is None else end for start, end in spans], dtype=np.int64)
    envs = [_get(samples[first], "env_name") for first in starts]
    return RolloutBatch(
        ids=ids,
        sample_offsets=np.array([*starts, len(samples)], dtype=np.int64),
        position_offsets=position_offsets,
        mask=_concat(masks, np.float32),
        dispatch_version=dispatch,
        completion_version=completion,
        frozen=frozen,
        group_ids=None if group_ids is None else [group_ids.get(rid) for rid in ids],
        envs=envs,
        rl_weights=arrays.get("rl_weights"),
        ce_weights=arrays.get("ce_weights"),
        ref_kl_weights=arrays.get("ref_kl_weights"),
        logprobs=arrays.get("logprobs"),
        present=present,
    )


def shipped_samples(shipment: Shipment, batch: RolloutBatch, samples: Sequence[Any]) -> list[Any]:
    """The samples of ``batch`` that ``shipment`` shipped, in ship order, with the masked ``mask``
    and weights written back into them (``samples`` is the list given to
    :func:`from_training_samples`)."""
    out: list[Any] = []
    for rollout in shipment.rollouts:
        if rollout.batch is not batch:
            continue
        first = int(batch.sample_offsets[rollout.index])
        for local in rollout.samples:
            out.append(_written_back(samples, batch, first + local))
    return out


def _written_back(samples: Sequence[Any], batch: RolloutBatch, index: int) -> Any:
    """Sample ``index`` of ``samples`` with the masked ``mask`` and weights of
    ``batch`` written into it."""
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
    """``(start, end)`` of an episode's policy (``train_work(episode).policy``: an object or a dict
    with ``start`` / ``end``); ``None`` (a frozen-model episode) gives ``(None, None)``."""
    if policy is None:
        return (None, None)
    return (_get(policy, "start"), _get(policy, "end"))


class ShippedSamples(list[Any]):
    """The shipped ``TrainingSample`` objects (a plain list of them), plus what a msgspec struct
    cannot carry: ``staleness_lag`` (one int64 array per sample, SPEC 11's lag of each position, -1
    where not sampled) and the ``shipment`` (metrics, drops, holds)."""

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
    """SPEC 15's one call for prime-rl: add the samples of a batch, ship them for
    ``version``, return the samples to pack, with the masked ``mask`` and weights written
    into them and the dropped ones left out.

    ``version`` is ``progress.step - 1``: prime-rl's ``progress.step`` is SPEC's step (batch
    ``step`` trains policy ``v{step-1}``). ``rollout_ids`` / ``policy`` / ``group_ids`` as in
    :func:`from_training_samples`. Samples held back by an earlier call come back, first, from
    the call that ships them.
    """
    batch = from_training_samples(samples, rollout_ids, policy, group_ids=group_ids)
    result = ship_rows(monitor, batch, list(samples), version=version, names=_NAMES)
    out = ShippedSamples()
    lags: list[npt.NDArray[np.int64]] = []
    for part in result.parts:
        source, batch_of = part.source, part.batch
        lag_iter = iter(part.lags)
        for row, kept in zip(part.rows.tolist(), part.samples):
            first = int(batch_of.sample_offsets[row])
            for local in kept:
                out.append(_written_back(source, batch_of, first + local))
                lags.append(next(lag_iter))
    out.staleness_lag = lags
    out.shipment = result.shipment
    return out
