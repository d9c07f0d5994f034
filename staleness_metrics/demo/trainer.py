"""The demo's simulated trainer: log-probabilities of the shipped tokens under the drift model of
docs/getting-started.md, their mismatch sums recorded through SPEC 11's live path as a real
trainer's would be."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..engine.shipment import Shipment
from ..errors import ConfigError
from ..metrics.mismatch import MismatchSums, mismatch_sums
from ..monitor import StalenessMonitor
from ..replay.what_if import shipped_values


@dataclass(frozen=True)
class DriftModel:
    """The trainer's log-probability is the sampler's plus ``Normal(-σ²/2, σ²)``, with
    ``σ(ℓ)² = floor² + (speed · ℓ)²`` at lag ``ℓ``; ``speed`` may warm up over the first steps."""

    floor: float = 0.05
    drift_per_version: float = 0.009
    warmup_steps: int = 0

    def speed(self, step: int) -> float:
        """How far the policy moves per version at train ``step`` (log-ratio standard deviation)."""
        if self.warmup_steps <= 0:
            return self.drift_per_version
        return self.drift_per_version * min(1.0, step / self.warmup_steps)

    def sigma(self, lags: npt.NDArray[np.int64], step: int) -> npt.NDArray[np.float64]:
        result: npt.NDArray[np.float64] = np.sqrt(self.floor**2 + (self.speed(step) * np.maximum(lags, 0)) ** 2)
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

    def logprobs(self, shipment: Shipment) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Sampler and trainer log-probabilities of every shipped position (as ``shipment.lags``)."""
        lags = shipment.lags
        sampler = shipped_values(shipment, "logprobs")
        sigma = self.model.sigma(lags, shipment.step)
        trainer = np.round(sampler + self._rng.normal(-(sigma**2) / 2, sigma), 6)
        return sampler, trainer

    def train(self, monitor: StalenessMonitor, shipment: Shipment) -> TrainedBatch | None:
        """Sums per rank, merged and recorded with the monitor (None when the ship took nothing)."""
        lags = shipment.lags
        if len(lags) == 0:
            return None
        sampler, trainer = self.logprobs(shipment)
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
