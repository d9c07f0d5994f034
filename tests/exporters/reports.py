"""Reports for exporter tests: hand-made ones (unit tests) and real ones from the sink (integration)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from staleness_metrics.config import StalenessConfig
from staleness_metrics.metrics.report import StepReport, Tally

# A bound the random rollouts cross often: masking, sample drops and rollout drops all happen.
CONFIG = StalenessConfig(max_staleness=3, env_breakdown=True)

__all__ = ["CONFIG", "FAR_CONFIG", "FAR_SHIPS", "far_records", "far_staleness", "hand_report", "nearest_rank",
           "random_rollouts", "ship_script"]  # fmt: skip


def nearest_rank(values: Sequence[int], p: float) -> int:
    """SPEC 6 quantile: the ceil(p*N)-th smallest value."""
    ordered = sorted(values)
    return ordered[max(math.ceil(p * len(ordered)), 1) - 1]


def _population(tokens: Sequence[int], masked: int, rollout_max: Sequence[int]) -> dict[str, float | int]:
    if not tokens:
        return {}
    return {
        "staleness/token/mean": sum(tokens) / len(tokens),
        "staleness/token/masked": masked / len(tokens),
        "staleness/token/unlabelled": 0.0,
        "staleness/token/p50": nearest_rank(tokens, 0.5),
        "staleness/token/p90": nearest_rank(tokens, 0.9),
        "staleness/token/p99": nearest_rank(tokens, 0.99),
        "staleness/rollout/mean": sum(rollout_max) / len(rollout_max),
        "staleness/rollout/max": max(rollout_max),
        "staleness/rollout/in_flight/mean": 0.0,
        "staleness/rollout/in_flight/max": 0,
        "staleness/rollout/in_queue/mean": sum(rollout_max) / len(rollout_max),
        "staleness/rollout/in_queue/max": max(rollout_max),
    }


def hand_report(
    step: int,
    rollouts: Mapping[str, Sequence[Sequence[int]]],
    *,
    masked: Mapping[str, int] | None = None,
    dropped: Mapping[str, int] | None = None,
    max_staleness: int = 4,
    env_breakdown: bool = False,
) -> StepReport:
    """A self-consistent report: ``rollouts`` maps env ("" = none) to each rollout's token stalenesses.

    ``dropped`` rollouts (one sample of 3 tokens each) and ``masked`` tokens are per env.
    """
    masked = masked or {}
    dropped = dropped or {}
    envs = sorted(set(rollouts) | set(dropped))
    env_metrics: dict[str, dict[str, float | int]] = {}
    env_tally: dict[str, Tally] = {}
    for env in envs:
        env_rollouts = rollouts.get(env, [])
        tokens = [t for r in env_rollouts for t in r]
        metrics = _population(tokens, masked.get(env, 0), [max(r) for r in env_rollouts])
        metrics.update(
            {
                "staleness/rollout/dropped": dropped.get(env, 0),
                "staleness/sample/dropped": dropped.get(env, 0),
                "staleness/rollout/held": 0,
                "staleness/max_staleness": max_staleness,
            }
        )
        env_metrics[env] = metrics
        env_tally[env] = Tally(
            tokens_sampled=len(tokens),
            tokens_masked=masked.get(env, 0),
            tokens_dropped=3 * dropped.get(env, 0),
            samples_dropped=dropped.get(env, 0),
            rollouts_dropped=dropped.get(env, 0),
            rollouts_shipped=len(env_rollouts),
            token_histogram=np.bincount(np.array(tokens, dtype=np.int64)) if tokens else np.zeros(0, np.int64),
            rollout_histogram=np.bincount(np.array([max(r) for r in env_rollouts], dtype=np.int64))
            if env_rollouts
            else np.zeros(0, np.int64),
        )
    all_rollouts = [r for env in envs for r in rollouts.get(env, [])]
    all_tokens = [t for r in all_rollouts for t in r]
    metrics = _population(all_tokens, sum(masked.values()), [max(r) for r in all_rollouts])
    metrics.update(
        {
            "staleness/rollout/dropped": sum(dropped.values()),
            "staleness/sample/dropped": sum(dropped.values()),
            "staleness/rollout/held": 0,
            "staleness/max_staleness": max_staleness,
        }
    )
    if env_breakdown:
        for env, values in env_metrics.items():
            if env:
                metrics.update({f"staleness/env/{env}/{k[len('staleness/') :]}": v for k, v in values.items()})
    return StepReport(
        step=step,
        max_staleness=max_staleness,
        metrics=metrics,
        tally=sum(env_tally.values(), Tally()),
        env_metrics=env_metrics,
        env_tally=env_tally,
    )


def random_rollouts(rng: random.Random, step: int, count: int, prefix: str) -> list[dict[str, Any]]:
    """SPEC 3 records for a ship at ``step``: versions up to ``step - 1``, a few envs, spans and gaps."""
    latest = step - 1
    records: list[dict[str, Any]] = []
    for i in range(count):
        dispatch = max(0, latest - rng.randint(0, 6))
        samples = []
        for _ in range(rng.randint(1, 2)):
            n = rng.randint(3, 12)
            mask = [1 if rng.random() < 0.85 else 0 for _ in range(n)]
            mask[0] = 1
            spans = [[dispatch, 0]]
            if n > 4 and dispatch < latest:
                spans.append([rng.randint(dispatch + 1, latest), rng.randint(1, n - 1)])
            spans.sort(key=lambda s: s[1])
            if len(spans) == 2 and spans[0][1] == spans[1][1]:
                spans.pop()
            # SPEC 11: trainer log-probs drift from the sampler's with the rollout's age; one in ten missing
            logprobs = [round(-3 * rng.random(), 6) for _ in range(n)]
            drift = 0.05 * (latest - dispatch)
            trainer = [
                None if rng.random() < 0.1 else round(lp + drift * rng.uniform(-1, 1) + rng.gauss(0, 0.01), 6)
                for lp in logprobs
            ]
            samples.append({"mask": mask, "weight_versions": spans, "logprobs": logprobs, "trainer_logprobs": trainer})
        record: dict[str, Any] = {
            "id": f"{prefix}-{step}-{i}",
            "dispatch_version": dispatch,
            "samples": samples,
        }
        env = rng.choice([None, "math", "code"])
        if env is not None:
            record["env"] = env
        records.append(record)
    return records


def ship_script(
    steps: int, *, seed: int = 7, per_step: int = 6, first_step: int = 8
) -> Iterator[tuple[list[dict[str, Any]], int]]:
    """(records to add, step to ship) for ``steps`` ships: drive a monitor or a sink with them.

    Starting at step 8, rollouts are up to 6 versions old: with :data:`CONFIG` some tokens are masked,
    some samples and rollouts dropped.
    """
    rng = random.Random(seed)
    for step in range(first_step, first_step + steps):
        yield random_rollouts(rng, step, per_step, prefix="r"), step


# Staleness from 4096 up, which the histograms fold into their last index (HISTOGRAM_TOP): per ship,
# its step and its rollouts (id, env, dispatch version, sampled positions), none masked.
FAR_CONFIG = StalenessConfig(max_staleness=10**6, env_breakdown=True)
FAR_SHIPS: list[tuple[int, list[tuple[str, str, int, int]]]] = [
    (5001, [("f1", "far", 0, 3), ("f2", "far", 500, 2), ("n1", "near", 4990, 4)]),
    (6001, [("f3", "far", 0, 1)]),
    (7001, [("f4", "far", 2500, 2), ("f5", "far", 2000, 1)]),  # inside the run's lowest..highest
]


def far_records(ship: int) -> list[dict[str, Any]]:
    return [
        {"id": rid, "env": env, "dispatch_version": version, "samples": [{"mask": [1] * n}]}
        for rid, env, version, n in FAR_SHIPS[ship][1]
    ]


def far_staleness(ships: int, env: str | None = None) -> tuple[list[int], list[int]]:
    """Token and rollout staleness of the first ``ships`` of FAR_SHIPS (of ``env``; None: all)."""
    tokens: list[int] = []
    rollouts: list[int] = []
    for step, shipped in FAR_SHIPS[:ships]:
        for _, rollout_env, version, n in shipped:
            if env in (None, rollout_env):
                tokens += [step - 1 - version] * n
                rollouts.append(step - 1 - version)
    return tokens, rollouts
