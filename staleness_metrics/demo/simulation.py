"""The demo's simulated asynchronous RL pipeline, which produces the SPEC 9 event stream of a run
(the same for one seed every time; docs/run-inputs.md), and its simulated trainer, which records
what staleness cost through SPEC 11's live path under the drift model of docs/getting-started.md."""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ..engine.shipment import Shipment
from ..errors import ConfigError
from ..metrics.mismatch import MismatchSums, mismatch_sums
from ..monitor import StalenessMonitor
from ..replay.what_if import shipped_values


@dataclass(frozen=True)
class EnvProfile:
    """One environment: its share of prompts and its response-length distribution."""

    name: str
    share: float
    median_tokens: int
    spread: float  # sigma of log(length)
    turns: int = 1  # samples per rollout (multi-turn agent rollouts)


@dataclass(frozen=True)
class DemoSettings:
    """The embedded defaults of the demo pipeline."""

    workers: int = 64  # concurrent sequences over the inference fleet
    group_size: int = 4
    batch_rollouts: int = 64
    tokens_per_tick: int = 16
    train_ticks: int = 30
    load_delay_ticks: int = 3
    frozen_share: float = 0.1
    max_buffered: int = 224
    sampler_scale: float = 0.7  # mean of -logprob of a sampled token
    max_tokens: int = 8192
    envs: tuple[EnvProfile, ...] = (
        EnvProfile("math", 0.45, 220, 0.6),
        EnvProfile("code", 0.3, 420, 0.9),
        EnvProfile("agent", 0.25, 300, 0.7, turns=3),
    )


@dataclass
class _Rollout:
    id: str
    group_id: str
    env: str
    frozen: bool
    dispatch_version: int
    lengths: list[int]  # per sample (turn)
    spans: list[tuple[int, int]] = field(default_factory=list)  # (version, absolute position)
    done: int = 0  # positions sampled so far over all samples

    @property
    def total(self) -> int:
        return sum(self.lengths)


@dataclass
class _Worker:
    version: int = 0
    pending_version: int | None = None
    load_at: int = 0
    current: _Rollout | None = None


@dataclass(frozen=True)
class StepEvents:
    """What happened up to one ship: the rollouts that finished, then the ship itself."""

    step: int
    rollouts: list[dict[str, Any]]
    ship_ids: list[str]
    queued: int
    in_flight: int
    policy_version: int  # the version inference is sampling with when the batch ships

    def events(self) -> list[dict[str, Any]]:
        """As SPEC 9 event dicts."""
        rollout_events: list[dict[str, Any]] = [{"type": "rollout", "rollout": r} for r in self.rollouts]
        return [*rollout_events, {"type": "ship", "step": self.step, "ids": self.ship_ids}]


class Simulation:
    """The pipeline, in ticks of simulated time; :meth:`steps` yields one ship after another."""

    def __init__(self, seed: int = 0, settings: DemoSettings | None = None) -> None:
        self.settings = settings or DemoSettings()
        self._rng = np.random.default_rng(seed)
        # its own stream: the events stay as they were
        self._logprob_rng = np.random.default_rng([seed, 7])
        self._workers = [_Worker() for _ in range(self.settings.workers)]
        self._waiting: deque[_Rollout] = deque()  # dispatched, not yet on a worker
        self._queue: deque[str] = deque()  # finished, not yet shipped (ids)
        self._finished: list[dict[str, Any]] = []
        self._tick = 0
        self._version = 0  # newest published version
        self._step = 1  # the next batch to ship
        self._train_until: int | None = None
        self._groups = 0
        self._shares = np.array([env.share for env in self.settings.envs], dtype=float)
        self._shares /= self._shares.sum()

    def forget(self, ids: Iterable[str]) -> None:
        """Remove the rollouts the sink dropped from the simulated queue."""
        gone = set(ids)
        if gone:
            self._queue = deque(i for i in self._queue if i not in gone)

    @property
    def in_flight(self) -> int:
        return len(self._waiting) + sum(w.current is not None for w in self._workers)

    def steps(self) -> Iterator[StepEvents]:
        while True:  # one tick at a time
            self._tick += 1
            self._finish_training()
            self._dispatch()
            self._sample()
            if self._train_until is None and len(self._queue) >= self.settings.batch_rollouts:
                yield self._ship()

    def _finish_training(self) -> None:
        if self._train_until is not None and self._tick >= self._train_until:
            self._train_until = None
            self._version = self._step - 1  # training batch S produces version S
            for worker in self._workers:
                worker.pending_version = self._version
                worker.load_at = self._tick + int(self._rng.integers(0, self.settings.load_delay_ticks + 1))

    def _dispatch(self) -> None:
        s = self.settings
        loaded = min(w.version for w in self._workers)  # what a dispatch can count on
        while self.in_flight + len(self._queue) + s.group_size <= s.max_buffered:
            self._groups += 1
            env = s.envs[int(self._rng.choice(len(s.envs), p=self._shares))]
            frozen = bool(self._rng.random() < s.frozen_share)
            group = f"g{self._groups}"
            log_median = np.log(env.median_tokens / env.turns)  # of a turn's length
            for member in range(s.group_size):
                drawn = self._rng.lognormal(log_median, env.spread, env.turns)
                lengths = np.clip(drawn, 4, s.max_tokens).astype(int).tolist()
                name = "frozen-teacher" if frozen else env.name
                # The orchestrator stamps the version it knows of; the engine may start it later.
                self._waiting.append(_Rollout(f"{group}-r{member}", group, name, frozen, loaded, lengths))

    def _sample(self) -> None:
        for worker in self._workers:
            if worker.pending_version is not None and self._tick >= worker.load_at:
                worker.version, worker.pending_version = worker.pending_version, None
                if worker.current is not None and not worker.current.frozen:
                    # New weights in the middle of a response: the rest is sampled by them.
                    worker.current.spans.append((worker.version, worker.current.done))
            if worker.current is None and self._waiting:
                worker.current = self._waiting.popleft()
                worker.current.spans.append((worker.version, 0))
            rollout = worker.current
            if rollout is None:
                continue
            rollout.done = min(rollout.total, rollout.done + self.settings.tokens_per_tick)
            if rollout.done == rollout.total:
                self._finished.append(self._record(rollout, worker.version))
                self._queue.append(rollout.id)
                worker.current = None

    def _ship(self) -> StepEvents:
        ids = [self._queue.popleft() for _ in range(self.settings.batch_rollouts)]
        step = StepEvents(self._step, self._finished, ids, len(self._queue), self.in_flight, self._version)
        self._finished = []
        self._train_until = self._tick + self.settings.train_ticks
        self._step += 1
        return step

    def _record(self, rollout: _Rollout, completion_version: int) -> dict[str, Any]:
        samples = []
        offset = 0
        for turn, length in enumerate(rollout.lengths):
            mask = [1] * length
            if turn > 0:
                # a multi-turn sample starts with the tool's output, which the policy did not sample
                tool = min(length - 1, int(self._rng.integers(2, 12)))
                mask[:tool] = [0] * tool
            logprobs = np.round(-self._logprob_rng.exponential(self.settings.sampler_scale, length), 6)
            sample: dict[str, Any] = {"mask": mask, "logprobs": logprobs.tolist()}
            if not rollout.frozen:
                sample["weight_versions"] = _spans_of(rollout.spans, offset, length)
            samples.append(sample)
            offset += length
        record: dict[str, Any] = {
            "id": rollout.id,
            "group_id": rollout.group_id,
            "env": rollout.env,
            "samples": samples,
        }
        if rollout.frozen:
            record["source"] = "frozen"
        else:
            record["dispatch_version"] = rollout.dispatch_version
            record["completion_version"] = completion_version
            record["agentic"] = len(rollout.lengths) > 1
        return record


def _spans_of(spans: list[tuple[int, int]], offset: int, length: int) -> list[list[int]]:
    """The ``[version, start]`` spans of positions ``offset .. offset+length-1`` of a sample."""
    out: list[list[int]] = []
    for i, (version, start) in enumerate(spans):
        end = spans[i + 1][1] if i + 1 < len(spans) else offset + length
        lo, hi = max(start, offset), min(end, offset + length)
        if lo < hi:
            if out and out[-1][0] == version:
                continue
            out.append([version, lo - offset])
    return out


@dataclass(frozen=True)
class DriftModel:
    """The trainer's log-probability is the sampler's plus ``Normal(-σ²/2, σ²)``, with
    ``σ(ℓ)² = floor² + (speed · ℓ)²`` at lag ``ℓ``; ``speed``, ``drift_per_version`` at full speed,
    may warm up over the first steps."""

    floor: float = 0.05
    drift_per_version: float = 0.009
    warmup_steps: int = 0

    def sigma(self, lags: npt.NDArray[np.int64], step: int) -> npt.NDArray[np.float64]:
        warm = 1.0 if self.warmup_steps <= 0 else min(1.0, step / self.warmup_steps)
        speed = self.drift_per_version * warm
        result: npt.NDArray[np.float64] = np.sqrt(self.floor**2 + (speed * np.maximum(lags, 0)) ** 2)
        return result

    def expected_suggested_bound(self, budget: float | None = None) -> int:
        """SPEC 14's suggested bound at full speed: the largest lag whose expected excess
        ``(speed · ℓ)² / 2`` is within ``budget`` (default: the floor's k3, ``floor² / 2``)."""
        beta = self.floor**2 / 2 if budget is None else budget
        if self.drift_per_version <= 0:
            raise ConfigError("drift_per_version: must be > 0 for the excess to cross any budget")
        return math.floor(math.sqrt(2 * beta) / self.drift_per_version)


def shipped_mask(shipment: Shipment) -> npt.NDArray[np.bool_]:
    """The shipped samples' masks (as trained), aligned with ``shipment.lags``."""
    return shipped_values(shipment, "mask") > 0


@dataclass(frozen=True)
class TrainedBatch:
    """One ship's recorded sums and trainer log-probabilities: per rollout, one list per sample
    as added (``None`` for a sample not shipped)."""

    step: int
    sums: MismatchSums
    trainer_logprobs: dict[str, list[list[float] | None]]


class SimulatedTrainer:
    """Computes trainer log-probabilities of each shipped batch and records their mismatch sums."""

    def __init__(self, seed: int = 0, model: DriftModel | None = None, ranks: int = 2) -> None:
        self.model = model or DriftModel()
        self.ranks = ranks
        # its own stream: the pipeline's events stay as they were
        self._rng = np.random.default_rng([seed, 11])

    def train(self, monitor: StalenessMonitor, shipment: Shipment) -> TrainedBatch | None:
        """Sums per rank, merged and recorded with the monitor (None when the ship took nothing)."""
        lags = shipment.lags
        if len(lags) == 0:
            return None
        sampler = shipped_values(shipment, "logprobs")
        sigma = self.model.sigma(lags, shipment.step)
        trainer = np.round(sampler + self._rng.normal(-(sigma**2) / 2, sigma), 6)
        masked = ~shipped_mask(shipment)
        # Ranks take contiguous runs of whole samples, as a data-parallel split of the batch would.
        offsets = shipment.lag_offsets
        cuts = [int(offsets[round(i * (len(offsets) - 1) / self.ranks)]) for i in range(self.ranks + 1)]
        ranks = [
            mismatch_sums(lags[lo:hi], sampler[lo:hi], trainer[lo:hi], masked=masked[lo:hi])
            for lo, hi in itertools.pairwise(cuts)
        ]
        total = monitor.record_mismatch(shipment.step, sum(ranks, MismatchSums.zero()))
        return TrainedBatch(shipment.step, total, _per_rollout(shipment, trainer))


def _per_rollout(shipment: Shipment, values: npt.NDArray[np.float64]) -> dict[str, list[list[float] | None]]:
    """``values`` (aligned with ``shipment.lags``) cut back into each rollout's samples."""
    out: dict[str, list[list[float] | None]] = {}
    offsets = shipment.lag_offsets
    shipped = 0
    for rollout in shipment.rollouts:
        batch = rollout.batch
        count = int(batch.sample_offsets[rollout.index + 1] - batch.sample_offsets[rollout.index])
        samples: list[list[float] | None] = [None] * count
        for k in rollout.samples:
            samples[k] = values[int(offsets[shipped]) : int(offsets[shipped + 1])].tolist()
            shipped += 1
        out[rollout.id] = samples
    return out
