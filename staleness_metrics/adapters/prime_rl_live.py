"""prime-rl's ``TrainingSample`` lists, live in its orchestrator, as a :class:`RolloutBatch` and
back, read with no import of prime-rl (``docs/trainers/prime-rl.md``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..engine.shipment import Shipment
from ..errors import FieldError, MissingFieldError, TraceError
from ..records.columnar import WEIGHT_FIELDS, RolloutBatch
from ..records.model import UnparsedRollout, float_list
from ._ship import Batches, SetAside, TrainerNames, ship_rows

PolicySpan = tuple[int | None, int | None]  # (policy.start, policy.end); start None = frozen


def _get(sample: Any, name: str) -> Any:
    return sample.get(name) if isinstance(sample, Mapping) else getattr(sample, name, None)


def _concat(parts: list[npt.NDArray[Any]], dtype: type) -> npt.NDArray[Any]:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def from_training_samples(samples: Sequence[Any], rollout_ids: Sequence[str],
                          policy: Mapping[str, PolicySpan], *,
                          group_ids: Mapping[str, str] | None = None,
                          set_aside: Callable[[UnparsedRollout], None] | None = None,
                          ) -> RolloutBatch:  # fmt: skip
    """The rollouts of ``samples`` (``TrainingSample`` objects or dicts), each sample one SPEC 3
    sample: ``rollout_ids[i]`` is the rollout of ``samples[i]`` (a rollout's samples adjacent, in
    branch order), ``policy`` maps each rollout id to its ``(policy.start, policy.end)``, the
    dispatch and completion versions (no policy: ``frozen``). A rollout refused raises
    :class:`TraceError`, or is left out and handed to ``set_aside``."""
    if len(rollout_ids) != len(samples):
        raise FieldError("rollout_ids", f"{len(rollout_ids)} ids for {len(samples)} samples")
    firsts = [i for i, rid in enumerate(rollout_ids) if i == 0 or rollout_ids[i - 1] != rid]
    if len({rollout_ids[i] for i in firsts}) != len(firsts):
        raise FieldError("rollout_ids", "the samples of one rollout must be adjacent")
    if missing := [rollout_ids[i] for i in firsts if rollout_ids[i] not in policy]:
        raise MissingFieldError("policy", f"no (start, end) for rollout {missing[0]!r}", rollout=missing[0])
    rollouts: list[tuple[str, tuple[int, int], Sequence[Any], list[dict[str, Any]]]] = []
    for first, stop in zip(firsts, [*firsts[1:], len(samples)]):
        rid, own, (start, end) = rollout_ids[first], samples[first:stop], policy[rollout_ids[first]]
        try:
            version = _version(rid, "policy.start", start)  # (-1: None, frozen)
            span = version, -1 if start is None else _version(rid, "policy.end", end)
            rollouts.append((rid, span, own, [_sample(rid, f"samples[{k}]", s) for k, s in enumerate(own)]))
        except TraceError as error:
            if set_aside is None:
                raise
            env = _get(own[0], "env_name")
            set_aside(UnparsedRollout(error, env if isinstance(env, str) and env else None))
    ids, rows = [r[0] for r in rollouts], [row for r in rollouts for row in r[3]]
    lengths = [len(row["mask"]) for row in rows]
    arrays: dict[str, Any] = {}
    present: dict[str, npt.NDArray[np.bool_]] = {}
    for name in (*WEIGHT_FIELDS, "logprobs"):
        have = np.array([row[name] is not None for row in rows], dtype=bool)
        if have.any():  # an absent array is filled with what absence means (rl 1.0, the others 0)
            fill = 1.0 if name == "rl_weights" else 0.0
            parts = [row[name] if row[name] is not None else np.full(n, fill) for row, n in zip(rows, lengths)]
            arrays[name] = _concat(parts, np.float64)  # float64: written back exactly as given
            present[name] = have
    dispatch = np.array([r[1][0] for r in rollouts], dtype=np.int64)  # -1: none (2.9: refused)
    return RolloutBatch(
        ids=ids, sample_offsets=np.cumsum([0, *(len(r[2]) for r in rollouts)], dtype=np.int64),
        position_offsets=np.cumsum([0, *lengths], dtype=np.int64), dispatch_version=dispatch,
        mask=_concat([row["mask"] for row in rows], np.float32), frozen=dispatch < 0,  # (-1: None)
        completion_version=np.array([r[1][1] for r in rollouts], dtype=np.int64),
        group_ids=None if group_ids is None else [group_ids.get(rid) for rid in ids],
        envs=[_get(r[2][0], "env_name") for r in rollouts], present=present, **arrays)  # fmt: skip


def _version(rid: str, name: str, value: Any) -> int:
    """A policy version as given (-1: None), else refused (the engine checks its top; a -1 given
    would read as None: frozen)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0):
        raise TraceError(rid, name, f"expected an integer >= 0 (or None), got {value!r}")
    return -1 if value is None else int(value)


def _sample(rid: str, where: str, sample: Any) -> dict[str, Any]:
    """A sample's mask and per-position arrays (None: absent), each checked one per position."""
    given = {name: _get(sample, name) for name in (*WEIGHT_FIELDS, "logprobs")}
    mask = _positions(rid, f"{where}.mask", _get(sample, "mask"), "b", None)
    read = {k: v if v is None else _positions(rid, f"{where}.{k}", v, "", len(mask)) for k, v in given.items()}
    return read | {"mask": mask}


def _positions(rid: str, where: str, value: Any, kinds: str, count: int | None) -> npt.NDArray[Any]:
    """``value`` as one float per position (``kinds``: the other dtype kinds it may be)."""
    try:
        array = np.asarray(value)
    except ValueError:  # (a ragged list)
        array = np.asarray(None)
    if where.endswith("logprobs") and isinstance(value, list) and None in value:
        array = float_list(rid, where, value)  # uncovered (SPEC 11), as the records read a null
    if array.ndim != 1 or array.dtype.kind not in "iuf" + kinds:
        raise TraceError(rid, where, f"expected a list of numbers, got {value!r:.80}")
    if count is not None and len(array) != count:
        raise TraceError(rid, where, f"{len(array)} entries for {count} positions")
    return array.astype(np.float64, copy=False)


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
        if (values := getattr(batch, name)) is not None and batch.present[name][index]:
            _set(sample, name, values[lo:hi].tolist())
    return sample


def _set(sample: Any, name: str, value: Any) -> None:
    if isinstance(sample, dict):
        sample[name] = value
    else:
        setattr(sample, name, value)


_NAMES = TrainerNames("prime-rl", "progress.step - 1 (batch `step` trains policy v{step-1})",
                      {"dispatch_version": "policy.start of rollout_ids[...] #{row}",
                       "completion_version": "policy.end of rollout_ids[...] #{row}"})  # fmt: skip


def policy_span(policy: Any) -> PolicySpan:
    """``(start, end)`` of a policy (object or dict); ``(None, None)`` for ``None`` (frozen)."""
    return (None, None) if policy is None else (_get(policy, "start"), _get(policy, "end"))


class ShippedSamples(list[Any]):
    """The shipped ``TrainingSample`` objects, plus what a msgspec struct cannot carry:
    ``staleness_lag`` (one SPEC 11 lag array per sample) and the ``shipment``."""

    staleness_lag: list[npt.NDArray[np.int64]]
    shipment: Shipment


def ship(monitor: Any, samples: Sequence[Any], *, version: int, rollout_ids: Sequence[str],
         policy: Mapping[str, PolicySpan],
         group_ids: Mapping[str, str] | None = None) -> ShippedSamples:  # fmt: skip
    """SPEC 15's one call for prime-rl: add and ship a batch's samples at ``version``
    (``progress.step - 1``) and return the samples to pack, masked, the dropped ones left out (the
    other arguments: :func:`from_training_samples`)."""

    def read(set_aside: SetAside) -> Batches[list[Any]]:  # (counted once the call is added)
        lenient = None if monitor.config.strict else set_aside.append
        batch = from_training_samples(samples, rollout_ids, policy, group_ids=group_ids, set_aside=lenient)
        read = set(batch.ids)  # (lenient: without the rollouts refused)
        return [(batch, [sample for sample, rid in zip(samples, rollout_ids) if rid in read], None)]

    result = ship_rows(monitor, read, version=version, names=_NAMES, given=samples)
    out = ShippedSamples()
    out.staleness_lag = [lag for part in result.parts for lag in part.lags]  # one per kept sample
    out.shipment = result.shipment
    for part in result.parts:
        for row, locals_kept in zip(part.rows.tolist(), part.samples):
            first = int(part.batch.sample_offsets[row])
            out.extend(_written_back(part.source, part.batch, first + local) for local in locals_kept)
    result.handed_back(monitor)  # (its last act: a Ctrl-C before it, a repeat gets this result)
    return out
