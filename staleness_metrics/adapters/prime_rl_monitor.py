"""A prime-rl monitor feeding a :class:`~staleness_metrics.StalenessMonitor`: a run's live numbers,
equal to a replay of the same run (``docs/trainers/prime-rl.md``)."""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ..engine.checkpoint import check_mismatch
from ..engine.queue_state import integers
from ..engine.shipment import Shipment
from ..errors import FieldError, TraceError
from ..metrics.mismatch import MismatchSums, mismatch_sums
from ..monitor import StalenessMonitor
from ..records.model import ParsedRollout, ParsedSample, UnparsedRollout, pack
from ..replay.sources.prime_rl import fold_streams, lazy
from ..replay.sources.prime_rl.episodes import EpisodeHead, NotAnEpisode, Stream, TraceHead, episode_head, trace_rollout
from ..replay.sources.prime_rl.legacy import stale_at_arrival
from ..replay.sources.prime_rl.run import STREAM_FIELD, update_fault
from ..state_checks import boolean, decode_array, encode_array, fail, integer, join, keys, mapping, sequence, strings
from ._ship import rollout_lags

KEEP_STEPS = 16  # shipments and shipped traces kept for the trainer's updates: the steps it may lag


class _Done:
    """An already finished awaitable."""

    def __await__(self) -> Generator[None, None, None]:  # (what ``await`` types expect)
        yield from ()


_DONE = _Done()


def episode_record(episode: Any, float_decimals: int | None = 4) -> Mapping[str, Any]:
    """An episode as its JSON record (verifiers' ``to_record``, a ``model_dump``, a mapping)."""
    if callable(getattr(episode, "to_record", None)):
        record = episode.to_record(float_decimals=float_decimals)
    elif callable(getattr(episode, "model_dump", None)):
        record = episode.model_dump(mode="json", exclude_none=True)
    else:
        record = episode
    if not isinstance(record, Mapping):
        kind = type(episode).__name__
        raise FieldError("episodes", f"expected an episode (a verifiers Episode or a dict), got {kind}")
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
    # per branch of a kept sample: k, the sample folded so far, its sums (not checkpointed)
    kept: dict[int, tuple[int, ParsedSample, MismatchSums]] | None = None


class PrimeRlMonitor:
    """prime-rl's monitor interface (PR #3444 on) over a :class:`StalenessMonitor`, each method done
    at once, returning an awaitable (what it reads of each call: ``docs/trainers/prime-rl.md``)."""

    run_id: str | None = None  # prime-rl asks every monitor for an external run id

    def __init__(self, monitor: StalenessMonitor, *, float_decimals: int | None = 4) -> None:
        self.monitor = monitor
        self.float_decimals = float_decimals
        self.shipments: dict[int, Shipment] = {}  # by step, KEEP_STEPS back
        self._added: dict[str, bool] = {}  # traces not shipped yet: in the sink (True), set aside
        self._shipped: dict[str, _Shipped] = {}
        self.updates_set_aside = 0  # lenient: trainer updates refused (strict raises)
        self._pending: list[tuple[_Shipped, int, Stream]] = []  # streams logged, not recorded yet
        self._unkept: tuple[Shipment, dict[str, tuple[EpisodeHead, TraceHead]]] | None = None

    def _ignore(self, *args: Any, **kwargs: Any) -> _Done:
        return _DONE

    init = log_metrics = log_live = log_eval_plan = log_eval_epoch = _ignore

    def log(self, data: Any, step: int | None, kind: str = "train", subset: str = "effective") -> _Done:
        if isinstance(data, Mapping):
            return self.log_metrics(data, step)
        if step is None:
            raise FieldError("step", "episodes are logged with the step of their batch")
        return self.log_episodes(data if isinstance(data, list | tuple) else [data], step, kind, subset)

    def log_episodes(self, episodes: Sequence[Any], step: int, kind: str, subset: str) -> _Done:
        self._keep()  # (an interrupted call's ship first: a retry then finds its traces shipped)
        if kind == "train" and subset == "all":
            bound = self.monitor.config.max_staleness
            for head, trace in self._traces(episodes, True):
                arrival = trace.arrival_step if trace.arrival_step is not None else step
                # (frozen-model work, without a policy, is never stale)
                if head.policy is not None and stale_at_arrival(head.policy[0], arrival, bound):
                    self._add(head, trace)
        elif kind == "train" and subset == "effective":
            self._ship(episodes, step)
        return _DONE

    def log_annotations(self, updates: Sequence[Mapping[str, Any]]) -> _Done:
        self._keep()
        for number, update in enumerate(updates):
            trace_id, where, fault = lazy.get(update, "trace_id"), f"updates[{number}]", update_fault(update)
            kept = fault is None and trace_id in self._shipped  # (else the orchestrator's, or old)
            for j, branch in enumerate(lazy.get(update, "branches") or () if kept else ()):
                try:
                    if (values := branch.get(STREAM_FIELD)) is not None:
                        stream = Stream(lazy.as_floats(values, nulls=True), "live", number)
                        self._fold(trace_id).updates.setdefault(branch["index"], []).append(stream)
                        self._pending.append((self._shipped[trace_id], branch["index"], stream))
                except TypeError as error:
                    where, fault = f"{where}.branches[{j}].{STREAM_FIELD}", f"not numbers or nulls ({error})"
            if fault is not None:  # (strict: raised; lenient: counted in updates_set_aside)
                self._set_aside(TraceError(trace_id if isinstance(trace_id, str) else None, where, fault))
        self._record()
        return _DONE

    def state_dict(self) -> dict[str, Any]:
        """The monitor's :meth:`~StalenessMonitor.state_dict` and, under ``prime_rl``, the traces
        not shipped yet and the shipped ones kept for the trainer's updates (SPEC 13)."""
        self._keep()
        shipped = [
            [t, s.episode.id, s.episode.group, s.episode.env, s.step, s.episode.policy, lazy.to_python(s.trace.doc),
             list(s.samples), list(map(encode_array, s.lags)), list(map(encode_array, s.masked)),
             [[index, [encode_array(x.values) for x in xs]] for index, xs in s.updates.items()],
             None if s.recorded is None else s.recorded.to_dict()]
            for t, s in self._shipped.items()
        ]  # fmt: skip
        return {**self.monitor.state_dict(), "prime_rl": {"added": dict(self._added), "shipped": shipped}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`, all or nothing: a bad state raises ``ConfigError``
        naming the key path and the reason, and the monitor stays as it was."""
        state = dict(mapping(state, ""))
        own = keys(state.pop("prime_rl", None), "prime_rl", ("added", "shipped"))
        added = {t: boolean(v, join("prime_rl.added", t)) for t, v in mapping(own["added"], "prime_rl.added").items()}
        items = enumerate(sequence(own["shipped"], "prime_rl.shipped"))
        shipped = [_read_shipped(item, join("prime_rl.shipped", i)) for i, item in items]
        self.monitor.load_state_dict(state)
        self._added, self._shipped = added, {s.trace.id: s for s in shipped}
        self._pending, self._unkept = [], None

    def finalize(self) -> _Done:
        self.monitor.close()
        return _DONE

    def _traces(self, episodes: Iterable[Any], arriving: bool) -> Iterator[tuple[EpisodeHead, TraceHead]]:
        """Each trace of a train episode that did not error, with its episode's head; one that is
        no episode is set aside at its arrival (once, as a replay's line), else skipped."""
        for number, episode in enumerate(episodes):
            try:
                head = episode_head(episode_record(episode, self.float_decimals))
            except NotAnEpisode as error:
                if arriving or self.monitor.config.strict:
                    refused = TraceError(None, f"episodes[{number}]", str(error))
                    self._set_aside(refused, UnparsedRollout(refused, None))
                continue
            if head.kind == "train" and head.ok:
                yield from ((head, trace) for trace in head.traces if trace.ok)

    def _add(self, head: EpisodeHead, trace: TraceHead) -> bool:
        """Whether the trace is in the sink, added if it was not (set aside once if refused)."""
        if trace.id in self._added:
            return self._added[trace.id]
        if trace.id in self.monitor.sink.queue.seen_ids:  # shipped or dropped: a run adds a trace once
            return False
        rollout, _ = trace_rollout(head, trace)
        if isinstance(rollout, ParsedRollout):
            self.monitor.add(pack([rollout]))
        elif rollout is not None:
            self._set_aside(rollout.error, rollout)
        self._added[trace.id] = isinstance(rollout, ParsedRollout)
        return self._added[trace.id]

    def _set_aside(self, error: TraceError, rollout: UnparsedRollout | None = None) -> None:
        """Raise ``error`` (strict), else count it (a rollout's as a replay's sink; an update's)."""
        if self.monitor.config.strict:
            raise error
        if rollout is not None:
            self.monitor.add((rollout,))  # (under the monitor's lock, as any add)
        self.updates_set_aside += rollout is None

    def _ship(self, episodes: Sequence[Any], step: int) -> None:
        named = list(self._traces(episodes, False))
        heads = {trace.id: (head, trace) for head, trace in named if self._add(head, trace)}
        names = {trace.id: (head, trace) for head, trace in named}
        if heads or step not in self.shipments:  # (nothing new for a step shipped: a retry)
            self._unkept = self.monitor.ship(step, list(heads)), names
        self._keep()

    def _keep(self) -> None:
        """Keep the last ship at once: per live trace, the lags and masked flags of its samples."""
        if self._unkept is None:
            return
        shipment, heads = self._unkept
        kept = dict(self._shipped)
        for rollout, lags in rollout_lags(shipment):
            record = rollout.record(arrays=True)
            if rollout.id not in heads or record.get("source") == "frozen":
                continue
            masked = [(lag >= 0) & (np.asarray(s["mask"]) == 0) for lag, s in zip(lags, record["samples"])]
            kept[rollout.id] = _Shipped(shipment.step, *heads[rollout.id], rollout.samples, lags, masked)
        oldest = shipment.step - KEEP_STEPS
        self._shipped = {trace_id: s for trace_id, s in kept.items() if s.step >= oldest}
        self.shipments[shipment.step] = shipment
        for trace_id in [*heads, *shipment.dropped_rollouts]:
            self._added.pop(trace_id, None)
        for step in [step for step in self.shipments if step < oldest]:
            del self.shipments[step]
        self._unkept = None

    def _record(self) -> None:
        """SPEC 11's sums of the shipped live traces the pending streams update, recorded as the
        change they make (in the streams' order, whatever calls they came in), as a replay's."""
        changes: dict[tuple[int, str | None], MismatchSums] = {}
        for shipped, index, stream in self._pending:
            key = (shipped.step, shipped.episode.env if self.monitor.config.env_breakdown else None)
            kept, change = shipped.kept or {}, changes.get(key, MismatchSums.zero())
            if shipped.recorded is None:  # (its first: all its sums, the positions not covered too)
                shipped.recorded = sum((sums for _, _, sums in kept.values()), MismatchSums.zero())
                change += shipped.recorded
            k, sample, sums = kept.get(index, (-1, None, change))  # (no kept sample: no change)
            if sample is not None and len(stream.values) <= len(sample.mask):  # (else it fits none)
                sample.trainer_logprobs = fold_streams(len(sample.mask), sample.trainer_logprobs, [stream])
                kept[index] = k, sample, self._sums(shipped, k, sample)
                delta = kept[index][2] - sums
                change, shipped.recorded = change + delta, shipped.recorded + delta
            changes[key] = change
        self._pending.clear()
        for (step, env), change in sorted(changes.items(), key=lambda item: item[0][0]):
            self.monitor.record_mismatch(step, change, env=env)

    def _fold(self, trace_id: str) -> _Shipped:
        """The shipped trace, folded once with its updates so far if it was not."""
        shipped = self._shipped[trace_id]
        if shipped.kept is None:
            samples_of: dict[int, int] = {}
            rollout, _ = trace_rollout(shipped.episode, shipped.trace, shipped.updates, samples_of)
            at = {local: k for k, local in enumerate(shipped.samples)}
            samples = rollout.samples if isinstance(rollout, ParsedRollout) else []
            pairs = [(b, at[i], samples[i]) for b, i in samples_of.items() if i in at]
            shipped.kept = {b: (k, s, self._sums(shipped, k, s)) for b, k, s in pairs}
        return shipped

    def _sums(self, shipped: _Shipped, k: int, sample: ParsedSample) -> MismatchSums:
        """SPEC 11's sums of a shipped trace's ``k``-th kept sample, from its streams so far."""
        lag, missing = shipped.lags[k], np.full(len(shipped.lags[k]), np.nan)
        sampler = missing if sample.logprobs is None else sample.logprobs
        trainer = missing if sample.trainer_logprobs is None else sample.trainer_logprobs
        return mismatch_sums(lag, sampler, trainer, shipped.masked[k], band=self.monitor.config.mismatch_band)


def _read_shipped(item: Any, at: str) -> _Shipped:
    """A shipped trace of :meth:`PrimeRlMonitor.state_dict`, checked against its record."""
    trace_id, episode_id, group, env = strings(sequence(item, at, 12)[:4], at, optional=True)
    step, policy, doc, samples, lags, masked, updates, recorded = item[4:]
    head = EpisodeHead(episode_id, "train", True, group, env, tuple(sequence(policy, join(at, 5), 2)))
    kept = tuple(integers(samples, join(at, 7), None, 0, 2**31).tolist())
    lags, masked = _arrays(lags, join(at, 8), np.int64), _arrays(masked, join(at, 9), np.bool_)
    shipped = _Shipped(integer(step, join(at, 4), 1), head, TraceHead(trace_id, True, None, doc), kept, lags, masked)
    for i, pair in enumerate(sequence(updates, join(at, 10))):
        index, streams = sequence(pair, where := join(join(at, 10), i), 2)
        values = _arrays(streams, join(where, 1), np.float64)
        shipped.updates[integer(index, join(where, 0), 0)] = [Stream(v, "live", 0) for v in values]
    shipped.recorded = None if recorded is None else check_mismatch(recorded, join(at, 11))
    rollout = trace_rollout(head, shipped.trace)[0]  # (it must give the samples kept, as shipped)
    found = ([len(rollout.samples[k].mask) if k < len(rollout.samples) else -1 for k in kept]
             if isinstance(rollout, ParsedRollout) else None)  # fmt: skip
    if found != list(map(len, lags)) or found != list(map(len, masked)):
        fail(join(at, 6), "not the record of the samples kept")
    return shipped


def _arrays(value: Any, at: str, dtype: type) -> list[npt.NDArray[Any]]:
    return [decode_array(item, join(at, i), dtype) for i, item in enumerate(sequence(value, at))]
