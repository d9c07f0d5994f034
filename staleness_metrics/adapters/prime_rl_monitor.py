"""A prime-rl monitor feeding a :class:`~staleness_metrics.StalenessMonitor`: a run's live numbers,
equal to a replay of the same run (``docs/trainers/prime-rl.md``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ..engine.shipment import Shipment
from ..errors import FieldError
from ..metrics.mismatch import MismatchSums, mismatch_sums
from ..monitor import StalenessMonitor
from ..records.model import ParsedRollout, UnparsedRollout, pack
from ..replay.sources.prime_rl.episodes import EpisodeHead, Stream, TraceHead, episode_head, trace_rollout
from ..replay.sources.prime_rl.legacy import stale_at_arrival
from ._ship import rollout_lags

KEEP_STEPS = 16  # shipped traces kept for the trainer's updates: the steps it may lag behind


class _Done:
    """An already finished awaitable."""

    def __await__(self) -> Iterator[None]:
        return iter(())


_DONE = _Done()


def episode_record(episode: Any, float_decimals: int | None = 4) -> Mapping[str, Any]:
    """An episode as its JSON record (verifiers' ``to_record``, a ``model_dump``, a mapping)."""
    to_record = getattr(episode, "to_record", None)
    if callable(to_record):
        record = to_record(float_decimals=float_decimals)
    elif callable(getattr(episode, "model_dump", None)):
        record = episode.model_dump(mode="json", exclude_none=True)
    else:
        record = episode
    if not isinstance(record, Mapping):
        raise FieldError(
            "episodes",
            f"expected an episode (a verifiers Episode or a dict), got {type(episode).__name__}",
        )
    return record


@dataclass
class _Shipped:
    """A shipped trace kept for the trainer's updates: per kept sample, lags and masked flags."""

    step: int
    episode: EpisodeHead
    trace: TraceHead
    samples: tuple[int, ...]
    lags: list[npt.NDArray[np.int64]]
    masked: list[npt.NDArray[np.bool_]]
    updates: dict[int, list[Stream]] = field(default_factory=dict)
    recorded: MismatchSums | None = None  # its sums last recorded (later ones record the change)


class PrimeRlMonitor:
    """prime-rl's monitor interface (PR #3444 on) over a :class:`StalenessMonitor`, each method done
    at once, returning an awaitable (what it reads of each call: ``docs/trainers/prime-rl.md``)."""

    run_id: str | None = None  # prime-rl asks every monitor for an external run id

    def __init__(self, monitor: StalenessMonitor, *, float_decimals: int | None = 4) -> None:
        self.monitor = monitor
        self.float_decimals = float_decimals
        self.shipments: dict[int, Shipment] = {}
        self._added: set[str] = set()  # traces in the sink, not shipped yet
        self._shipped: dict[str, _Shipped] = {}

    def _ignore(self, *args: Any, **kwargs: Any) -> _Done:
        return _DONE

    init = log_metrics = log_live = log_eval_plan = log_eval_epoch = _ignore

    def log(self, data: Any, step: int | None, kind: str = "train", subset: str = "effective") -> _Done:
        if isinstance(data, Mapping):
            return self.log_metrics(data, step)
        episodes = data if isinstance(data, list | tuple) else [data]
        if step is None:
            raise FieldError("step", "episodes are logged with the step of their batch")
        return self.log_episodes(episodes, step, kind, subset)

    def log_episodes(self, episodes: Sequence[Any], step: int, kind: str, subset: str) -> _Done:
        if kind != "train":
            return _DONE
        if subset == "all":
            self._arrive(episodes, step)
        elif subset == "effective":
            self._ship(episodes, step)
        return _DONE

    def log_annotations(self, updates: Sequence[Mapping[str, Any]]) -> _Done:
        touched: set[str] = set()
        for number, update in enumerate(updates):
            shipped = self._shipped.get(str(update.get("trace_id")))
            branches = update.get("branches")
            if shipped is None or not isinstance(branches, list):
                continue
            for branch in branches:
                index = branch.get("index") if isinstance(branch, Mapping) else None
                values = branch.get("trainer_logprobs") if isinstance(branch, Mapping) else None
                if isinstance(index, int) and isinstance(values, list):
                    array = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
                    shipped.updates.setdefault(index, []).append(Stream(array, "live", number))
                    touched.add(str(update.get("trace_id")))
        self._record(touched)
        return _DONE

    def finalize(self) -> _Done:
        self.monitor.close()
        return _DONE

    def _traces(self, episodes: Iterable[Any]) -> Iterator[tuple[EpisodeHead, TraceHead]]:
        """Each trace of a train episode that did not error, with its episode's head."""
        for episode in episodes:
            head = episode_head(episode_record(episode, self.float_decimals))
            if head.kind != "train" or not head.ok:
                continue
            for trace in head.traces:
                if trace.ok:
                    yield head, trace

    def _add(self, head: EpisodeHead, trace: TraceHead) -> bool:
        rollout, _ = trace_rollout(head, trace)
        if rollout is None:
            return False
        if isinstance(rollout, UnparsedRollout):
            if self.monitor.config.strict:
                raise rollout.error
            # set aside and counted, as the replay's sink does
            self.monitor.sink.add_parsed((rollout,))
            return False
        self.monitor.add(pack([rollout]))
        self._added.add(trace.id)
        return True

    def _arrive(self, episodes: Sequence[Any], step: int) -> None:
        bound = self.monitor.config.max_staleness
        for head, trace in self._traces(episodes):
            arrival = trace.arrival_step if trace.arrival_step is not None else step
            # (frozen-model work, without a policy, is never stale)
            stale = head.policy is not None and stale_at_arrival(head.policy[0], arrival, bound)
            if stale and trace.id not in self._added:
                self._add(head, trace)

    def _ship(self, episodes: Sequence[Any], step: int) -> None:
        heads: dict[str, tuple[EpisodeHead, TraceHead]] = {}
        ids = []
        for head, trace in self._traces(episodes):
            if trace.id in self._added or self._add(head, trace):
                heads[trace.id] = (head, trace)
                ids.append(trace.id)
        shipment = self.monitor.ship(step, ids)
        self.shipments[step] = shipment
        self._added.difference_update(ids)
        self._keep(shipment, heads)

    def _keep(self, shipment: Shipment, heads: Mapping[str, tuple[EpisodeHead, TraceHead]]) -> None:
        """Per shipped live trace, the lag and masked flag of every position of its kept samples."""
        for rollout, lags in rollout_lags(shipment):
            record = rollout.record(arrays=True)
            if rollout.id not in heads or record.get("source") == "frozen":
                continue
            head, trace = heads[rollout.id]
            masked = [(lag >= 0) & (np.asarray(s["mask"]) == 0) for lag, s in zip(lags, record["samples"])]
            self._shipped[rollout.id] = _Shipped(shipment.step, head, trace, rollout.samples, lags, masked)
        oldest = shipment.step - KEEP_STEPS
        for trace_id in [t for t, s in self._shipped.items() if s.step < oldest]:
            del self._shipped[trace_id]

    def _record(self, touched: set[str]) -> None:
        """SPEC 11's sums of the shipped live traces ``touched`` by updates, recorded as the change
        they make: a step's sums are those of its traces' updates so far, as a replay's."""
        changes: dict[tuple[int, str | None], MismatchSums] = {}
        for shipped in (s for trace_id, s in self._shipped.items() if trace_id in touched):
            sums = self._sums(shipped)
            change = sums if shipped.recorded is None else sums - shipped.recorded
            shipped.recorded = sums
            key = (shipped.step, shipped.episode.env if self.monitor.config.env_breakdown else None)
            changes[key] = changes.get(key, MismatchSums.zero()) + change
        for (step, env), change in sorted(changes.items(), key=lambda item: item[0][0]):
            self.monitor.record_mismatch(step, change, env=env)

    def _sums(self, shipped: _Shipped) -> MismatchSums:
        """SPEC 11's sums of one shipped trace, from its trainer streams so far."""
        total, band = MismatchSums.zero(), self.monitor.config.mismatch_band
        rollout, _ = trace_rollout(shipped.episode, shipped.trace, shipped.updates)
        if not isinstance(rollout, ParsedRollout):
            return total
        for local, lag, masked in zip(shipped.samples, shipped.lags, shipped.masked):
            sample, missing = rollout.samples[local], np.full(len(lag), np.nan)
            sampler = missing if sample.logprobs is None else sample.logprobs
            trainer = missing if sample.trainer_logprobs is None else sample.trainer_logprobs
            total += mismatch_sums(lag, sampler, trainer, masked, band=band)
        return total
