"""The demo's simulated trainer: log-probabilities of the shipped tokens, and what staleness cost them.

The orchestrator never sees the trainer's log-probabilities: the trainer computes them after the batch
left, so the demo takes the live path of SPEC 11 exactly as a real trainer would::

    lags = shipment.lags                                     # sent along with the batch
    sums = mismatch_sums(lags, sampler_logprobs, trainer_logprobs, masked=shipped_mask == 0)
    monitor.record_mismatch(step, sums)                      # per rank, or once with the ranks' sum

**Drift model.** Per sampled position, the sampler's log-probability is ``-Exponential(0.7)`` (a
token distribution where most tokens are likely and a tail is not). The trainer's log-probability of
the same token, under the weights it trains this batch with, is the sampler's plus
``d ~ Normal(-σ²/2, σ²)`` with

    σ(ℓ, T)² = floor² + (speed(T) · ℓ)²,    speed(T) = drift_per_version · min(1, T / warmup_steps)

- ``floor`` (default 0.05 nats) is the numeric mismatch of two engines holding the same weights
  (different kernels and precisions): present at lag 0.
- ``ℓ`` is the token's lag (``shipment.lags``): every version the policy moved since the token was
  sampled adds drift.
- ``speed(T)`` is how far the policy moves per version at train step ``T``: it ramps up over
  ``warmup_steps`` as the learning rate warms up, to ``drift_per_version`` (default 0.08 nats).

The mean ``-σ²/2`` keeps ``E[r] = 1`` for ``r = exp(d)``, as for true importance ratios; the expected
k3 of a bucket is then ``σ²/2``, so the excess over the lag-0 floor is ``(speed · ℓ)² / 2``: it grows
with the lag and with how fast the policy moves, which is what the new panels show.

The trainer splits each batch over ``ranks`` (at sample boundaries), computes one sums object per rank
as a data-parallel trainer would, adds them (``+``, exact) and records the step once, so row exporters
(console, JSONL, W&B) get one mismatch row per step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..mismatch import MismatchSums, mismatch_sums
from ..monitor import StalenessMonitor
from ..sink import Shipment

__all__ = ["DriftModel", "SimulatedTrainer", "shipped_mask"]


@dataclass(frozen=True)
class DriftModel:
    """The parameters of the drift model (see the module docstring)."""

    floor: float = 0.05
    drift_per_version: float = 0.08
    warmup_steps: int = 10
    sampler_scale: float = 0.7  # mean of -logprob of a sampled token

    def sigma(self, lags: npt.NDArray[np.int64], step: int) -> npt.NDArray[np.float64]:
        """The standard deviation of the log-ratio of tokens of the given lags, at train ``step``."""
        speed = self.drift_per_version * min(1.0, step / max(self.warmup_steps, 1))
        result: npt.NDArray[np.float64] = np.sqrt(self.floor**2 + (speed * np.maximum(lags, 0)) ** 2)
        return result


def shipped_mask(shipment: Shipment) -> npt.NDArray[np.bool_]:
    """The shipped samples' masks (as trained), concatenated in ship order: aligned with ``shipment.lags``."""
    parts: list[npt.NDArray[np.bool_]] = []
    for rollout in shipment.rollouts:
        batch = rollout.batch
        first = int(batch.sample_offsets[rollout.index])
        for k in rollout.samples:
            lo, hi = int(batch.position_offsets[first + k]), int(batch.position_offsets[first + k + 1])
            parts.append(np.asarray(batch.mask[lo:hi], dtype=bool))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)


class SimulatedTrainer:
    """Computes trainer log-probabilities of each shipped batch and records their mismatch sums."""

    def __init__(self, seed: int = 0, model: DriftModel | None = None, ranks: int = 2) -> None:
        self.model = model or DriftModel()
        self.ranks = ranks
        self._rng = np.random.default_rng([seed, 11])  # its own stream: the pipeline's events stay as they were

    def logprobs(self, shipment: Shipment) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Sampler and trainer log-probabilities of every shipped position (aligned with ``shipment.lags``)."""
        lags = shipment.lags
        sampler = -self._rng.exponential(self.model.sampler_scale, len(lags))
        sigma = self.model.sigma(lags, shipment.step)
        trainer = sampler + self._rng.normal(-(sigma**2) / 2, sigma)
        return sampler, trainer

    def train(self, monitor: StalenessMonitor, shipment: Shipment) -> MismatchSums | None:
        """The live path: sums per rank, merged and recorded with the monitor; returns the step's total
        (None when the ship took nothing)."""
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
        return monitor.record_mismatch(shipment.step, sum(ranks, MismatchSums.zero()))
