"""A small simulated asynchronous prime-rl run, written by :mod:`tests.support.prime_rl_writer`, with the truth
kept beside it so tests can compute every number on their own.

The model (all seeded, so a config always writes the same bytes):

- Batch ``s`` is collected while inference serves policy ``v(s) = max(0, s - 1 - a(s))``, ``a(s)`` drawn from
  ``0..async_level`` and never letting ``v`` go back. Each step dispatches ``groups_per_step`` groups of
  ``group_size`` episodes (``run.work.step = s``, ``policy.start = v(s)``); an episode arrives ``k`` steps
  later (``k`` drawn with a long tail), ``policy.end = v(arrival)``.
- Envs: ``gsm8k`` (one turn), ``wordle`` (two turns with a second branch from the first answer: a sampled node
  shared by two branches), ``code`` (two agents, two traces). Every ``frozen_every``-th step adds a group of the
  ``teacher`` env sampled by a frozen model (no ``policy``); every ``eval_every``-th step an eval group.
- Some episodes error (never shipped); groups whose rewards are all equal carry no signal (never shipped).
- Ship ``N``: what arrived up to ``N`` in arrival order, at most ``batch_episodes``: errored and signal-less
  episodes are discarded, episodes with ``(N - 1) - policy.start > prime_max_staleness`` dropped as stale
  (``off_policy/dropped`` counts their traces), the rest shipped or left buffered for a later ship.
- The trainer of step ``N`` annotates every trained sample; its log-probability of a sampled token is the
  sampler's plus ``±sigma(lag)`` (the sign alternating with the position), ``sigma(lag)^2 =
  floor_sigma^2 * (1 + drift_per_lag * lag)``, so the k3 of lag ``l`` is ``cosh(sigma(l)) - 1``: its excess over
  the lag-0 floor is ``drift_per_lag * l`` floors, and with the budget = the floor the suggested bound is
  ``floor(1 / drift_per_lag)`` (:attr:`SimConfig.suggested_bound`). The first batch is all lag 0 and large
  enough (at least ``floor_min_tokens`` = 1000 covered tokens) to measure the floor, as SPEC 14 expects of a
  run. Frozen samples drift by ``frozen_sigma``.
  Every ``truncate_every``-th wordle sample is truncated inside its last node (a shorter trainer stream).
- ``relaunch_at``: the run crashes after ship ``relaunch_at - 1`` (in-flight and buffered episodes are lost;
  ``tear`` leaves a torn line) and a new writer appends from step ``relaunch_at`` on.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import verifiers.v1 as vf

from .prime_rl_writer import (
    Layout,
    NodeSpec,
    PrimeRunWriter,
    loss_masks,
    make_episode,
    make_trace,
    mismatch_kl_metrics,
    off_policy_metrics,
)

__all__ = ["SimConfig", "SimRun", "simulate"]


@dataclass(frozen=True)
class SimConfig:
    steps: int = 20
    seed: int = 7
    groups_per_step: int = 4
    group_size: int = 4
    batch_episodes: int = 16
    async_level: int = 2
    prime_max_staleness: int = 5
    sampled_tokens: tuple[int, int] = (32, 80)
    prompt_tokens: int = 5
    floor_sigma: float = 0.04
    drift_per_lag: float = 0.3
    frozen_sigma: float = 0.3
    frozen_every: int = 4
    eval_every: int = 8
    error_rate: float = 0.05
    truncate_every: int = 5
    metric_prefix: str = "off_policy"
    chunk_bytes: int = 5 << 30
    frame_bytes: int = 4 << 20
    compress: bool = True
    layout: Layout = "chunked"
    end: Literal["close", "abandon", "tear"] = "close"
    relaunch_at: int | None = None
    tear_at_relaunch: bool = False

    @property
    def suggested_bound(self) -> int:
        """The bound SPEC 14 suggests for this drift model (budget = the floor)."""
        return math.floor(1 / self.drift_per_lag + 1e-9)


@dataclass
class SimEpisode:
    episode: vf.Episode
    dispatch_step: int
    arrival_step: int
    kind: Literal["train", "eval"] = "train"
    signal: bool = True
    advantage: float = 0.0  # reward - group mean, set on the objects when the episode ships
    lost: bool = False  # in flight or buffered when the run crashed


@dataclass
class SimRun:
    """What was written, for the tests' own computations."""

    root: Path
    config: SimConfig
    versions: dict[int, int]  # v(s): the policy served while batch s was collected
    episodes: dict[str, SimEpisode] = field(default_factory=dict)
    shipped: dict[int, list[str]] = field(default_factory=dict)  # step -> episode ids, ship order
    stale_dropped: dict[int, list[str]] = field(default_factory=dict)  # step -> episode ids prime-rl dropped
    trainer_streams: dict[tuple[str, int], list[float | None]] = field(default_factory=dict)
    truncated: set[tuple[str, int]] = field(default_factory=set)
    orch_metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    trainer_metrics: dict[int, dict[str, float]] = field(default_factory=dict)

    def trace_episode(self) -> dict[str, vf.Episode]:
        return {t.id: e.episode for e in self.episodes.values() for t in e.episode.traces}


async def _await(result: Awaitable[None]) -> None:
    await result


class _Sim:
    def __init__(self, root: Path, config: SimConfig, observers: Sequence[Any] = ()) -> None:
        self.config = config
        self.observers = list(observers)
        self.rng = random.Random(config.seed)
        self.run = SimRun(root, config, self._versions())
        self.pending: list[SimEpisode] = []  # arrived, not yet decided
        self.clock = 1.75e9
        self.writer = self._writer()
        self.counter = 0

    def _tell(self, method: str, *args: Any) -> None:
        """What prime-rl hands every registered monitor (``await monitor.<method>(...)``)."""
        for observer in self.observers:
            asyncio.run(_await(getattr(observer, method)(*args)))

    def _writer(self) -> PrimeRunWriter:
        c = self.config
        return PrimeRunWriter(self.run.root, chunk_bytes=c.chunk_bytes, compress=c.compress,
                              frame_bytes=c.frame_bytes, layout=c.layout, clock=self._tick)  # fmt: skip

    def _tick(self) -> float:
        self.clock += 1.25
        return round(self.clock, 3)

    def _versions(self) -> dict[int, int]:
        versions, last = {}, 0
        for step in range(1, self.config.steps + 1):
            lag = self.rng.randint(0, self.config.async_level)
            last = max(last, max(0, step - 1 - lag))
            versions[step] = last
        return versions

    # ------------------------------------------------------------------ episodes
    def _logprobs(self) -> tuple[float, ...]:
        n = self.rng.randint(*self.config.sampled_tokens)
        return tuple(-round(self.rng.uniform(0.01, 3.0), 6) for _ in range(n))

    def _nodes(self, env: str) -> list[NodeSpec]:
        p = self.config.prompt_tokens
        if env == "wordle":
            return [NodeSpec(None, p), NodeSpec(0, 2, self._logprobs()), NodeSpec(1, 3),
                    NodeSpec(2, 2, self._logprobs()), NodeSpec(1, 3), NodeSpec(4, 2, self._logprobs())]  # fmt: skip
        return [NodeSpec(None, p), NodeSpec(0, 2, self._logprobs())]

    def _episode(self, step: int, env: str, group: str, policy: tuple[int, int] | None, kind: str) -> vf.Episode:
        self.counter += 1
        eid = f"ep{self.counter:04d}"
        errored = kind == "train" and self.rng.random() < self.config.error_rate
        reward = float(self.rng.random() < 0.5)
        agents = 2 if env == "code" else 1
        traces = [
            make_trace(
                f"{eid}-t{i}",
                self._nodes(env),
                reward=reward,
                start_time=self.clock + i,
                token_base=1000 * i,
                errored=errored and i == 0,
            )
            for i in range(agents)
        ]
        return make_episode(eid, traces, env=env, step=step, policy=policy, group=group, kind=kind)  # type: ignore[arg-type]

    def _dispatch(self, step: int) -> list[SimEpisode]:
        c, v = self.config, self.run.versions[step]
        envs = ["gsm8k", "wordle", "code"]
        # The first batch is collected before training starts: enough groups for it, all back at step 1.
        count = c.batch_episodes // c.group_size + 1 if step == 1 else c.groups_per_step
        groups: list[tuple[str, bool, str]] = [(envs[(step + g) % 3], True, "train") for g in range(count)]
        if c.frozen_every and step % c.frozen_every == 0:
            groups.append(("teacher", False, "train"))
        if c.eval_every and step % c.eval_every == 0:
            groups.append(("gsm8k-eval", True, "eval"))
        out = []
        for g, (env, live, kind) in enumerate(groups):
            group = f"s{step}g{g}"
            members = []
            for _ in range(c.group_size):
                delay = (
                    0 if kind == "eval" or step == 1 else self.rng.choices(range(9), [35, 30, 15, 8, 4, 3, 2, 2, 1])[0]
                )
                arrival = step + delay
                end = self.run.versions.get(arrival, self.run.versions[c.steps])
                episode = self._episode(step, env, group, (v, end) if live else None, kind)
                members.append(SimEpisode(episode, step, arrival, kind))  # type: ignore[arg-type]
            rewards = [m.episode.traces[0].rewards["correct"].score for m in members]  # type: ignore[union-attr]
            for m in members:
                m.signal = len(set(rewards)) > 1
                m.advantage = rewards[members.index(m)] - sum(rewards) / len(rewards)
            out.extend(members)
        return out

    @staticmethod
    def _advantages(member: SimEpisode) -> None:
        """What the orchestrator sets on a shipped episode's objects (after its record was written)."""
        for trace in member.episode.traces:
            trace.info["advantage"] = member.advantage
            for node in trace.nodes:
                if any(node.mask):
                    node.advantages = [member.advantage] * sum(node.mask)

    # ------------------------------------------------------------------ the loop
    def simulate(self) -> SimRun:
        c = self.config
        in_flight: list[SimEpisode] = []
        for step in range(1, c.steps + 1):
            if c.relaunch_at is not None and step == c.relaunch_at:
                self._crash(in_flight)
                in_flight = []
            in_flight += self._dispatch(step)
            arrived = [e for e in in_flight if e.arrival_step == step]
            in_flight = [e for e in in_flight if e.arrival_step != step]
            for kind in ("train", "eval"):
                batch = [e for e in arrived if e.kind == kind]
                if batch:
                    self.writer.log_episodes([e.episode for e in batch], step, kind=kind)
                    self._tell("log", [e.episode for e in batch], step, kind, "all")
                    for e in batch:
                        self.run.episodes[e.episode.id] = e
            self.pending += [e for e in arrived if e.kind == "train"]
            self._ship(step, [e for e in arrived if e.kind == "eval"])
        for e in in_flight:  # never finished: never written
            e.lost = True
        {"close": self.writer.close, "abandon": self.writer.abandon, "tear": self._tear_and_abandon}[c.end]()
        return self.run

    def _tear_and_abandon(self) -> None:
        self.writer.tear()
        self.writer.abandon()

    def _crash(self, in_flight: list[SimEpisode]) -> None:
        for e in [*in_flight, *self.pending]:
            e.lost = True
        self.pending = []
        if self.config.tear_at_relaunch:
            self.writer.tear()
        self.writer.abandon()
        self.writer = self._writer()

    def _ship(self, step: int, evals: list[SimEpisode]) -> None:
        c = self.config
        shipped: list[SimEpisode] = []
        keep: list[SimEpisode] = []
        dropped_traces = 0
        for e in self.pending:
            policy = e.episode.run.work.policy  # type: ignore[union-attr]
            if not e.episode.ok or not e.signal:
                continue
            if policy is not None and (step - 1) - policy.start > c.prime_max_staleness:
                dropped_traces += len(e.episode.traces)
                self.run.stale_dropped.setdefault(step, []).append(e.episode.id)
            elif len(shipped) < c.batch_episodes:
                shipped.append(e)
            else:
                keep.append(e)
        self.pending = keep
        if evals:
            self._tell("log", [e.episode for e in evals], step, "eval", "effective")
            self._tell("log_annotations", self.writer.ship([e.episode for e in evals], step))
        if not shipped:
            return
        for e in shipped:
            self._advantages(e)
        episodes = [e.episode for e in shipped]
        self.run.shipped[step] = [e.id for e in episodes]
        self._tell("log", episodes, step, "train", "effective")
        self._tell("log_annotations", self.writer.ship(episodes, step))
        metrics = off_policy_metrics(episodes, step, dropped_traces, prefix=c.metric_prefix)
        self.run.orch_metrics[step] = metrics
        self.writer.log_metrics({**metrics, "step": step}, step, "orch")
        self._tell("log", {**metrics, "step": step}, step)
        self._train(step, episodes)

    def _train(self, step: int, episodes: list[vf.Episode]) -> None:
        c = self.config
        truncate: dict[tuple[str, int], int] = {}
        count = 0
        for episode in episodes:
            for trace in episode.traces:
                masks = loss_masks(trace)
                for branch, mask in masks.items():
                    if episode.env.name == "wordle":
                        count += 1
                        if c.truncate_every and count % c.truncate_every == 0:
                            truncate[(trace.id, branch)] = len(mask) - 3
                            self.run.truncated.add((trace.id, branch))

        def logprob(episode: vf.Episode, trace: vf.Trace, branch: int, position: int, sampler: float) -> float:
            policy = episode.run.work.policy  # type: ignore[union-attr]
            if policy is None:
                sigma = c.frozen_sigma
            else:
                sigma = c.floor_sigma * math.sqrt(1 + c.drift_per_lag * ((step - 1) - policy.start))
            return sampler + (sigma if position % 2 == 0 else -sigma)

        trained = self.writer.train(episodes, step, logprob=logprob, truncate=truncate)
        self._tell("log_annotations", trained.updates)
        for update in trained.updates:
            for branch in update["branches"]:
                self.run.trainer_streams[(update["trace_id"], branch["index"])] = branch["trainer_logprobs"]
        metrics = mismatch_kl_metrics(trained.k3_by_env)
        if trained.is_masked:
            metrics["is_masked/mean"] = sum(trained.is_masked) / len(trained.is_masked)
        self.run.trainer_metrics[step] = metrics
        self.writer.log_metrics(metrics, step, "trainer")


def simulate(root: str | Path, config: SimConfig | None = None, observers: Sequence[Any] = ()) -> SimRun:
    """Write the simulated run under ``root`` and return what it wrote. ``observers`` are prime-rl monitors
    (its ``Monitor`` interface) handed the same calls as the file monitor, in the same order: episodes as
    they arrive (``subset="all"``) and as they ship (``"effective"``), the orchestrator's and the
    trainer's updates (``log_annotations``), the metrics rows."""
    return _Sim(Path(root), config or SimConfig(), observers).simulate()
