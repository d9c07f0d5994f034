"""Deterministic rollouts that exercise every metric: masking, drops, unlabelled tokens, envs and none, and
trainer log-probabilities that drift from the sampler's with the token lag (SPEC 11), one missing per sample.

The run is fully asynchronous, as the README's demo: step 1 trains version 0 on tokens of version 0, and no
later step has a token at lag 0. SPEC 14's floor is then measured at step 1, carried for ``FLOOR_MAX_AGE``
steps, and bounded by the smallest lag after that (source ``lag0``, ``carried``, then ``min_lag``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from staleness_metrics.config import StalenessConfig
from staleness_metrics.engine.sink import Sink
from staleness_metrics.metrics.report import StepReport

ENVS = ("math", "code", "(no env)", None)  # (an env named as the dashboards name none)
MAX_STALENESS = 3
ROLLOUTS_PER_STEP = 6
TOKENS = 12
DRIFT_PER_LAG = 0.1
FLOOR_MIN_TOKENS = 2
FLOOR_MAX_AGE = 40  # steps: at 4 ships a second the carried floor gives way to min_lag after about 10 s
BUDGET = 0.01


def rollouts(step: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """The rollouts finished for ``step``: lags 1 to 6 versions after step 1 (none at lag 0), so with a bound
    of 3 some tokens are masked and some rollouts dropped (never all); two leading positions per sample carry
    no version label."""
    version = step - 1
    made = []
    for i in range(ROLLOUTS_PER_STEP):
        lag = 1 if i == 0 else int(rng.integers(1, 7))  # one rollout one version behind: every ship has tokens
        dispatch = max(0, version - lag)
        newer = max(dispatch, min(version - 1, dispatch + 1))  # finished before the last weight update
        spans = [[dispatch, 2]] if newer == dispatch else [[dispatch, 2], [newer, 7]]
        rollout: dict[str, Any] = {
            "id": f"s{step}-r{i}",
            "group_id": f"s{step}-g{i // 2}",
            "dispatch_version": dispatch,
            "completion_version": newer,
            "samples": [{"mask": [1] * TOKENS, "weight_versions": spans}],
        }
        # the trainer's log-probs: a small numeric floor, plus a drift that grows with each position's lag
        lags = np.where(np.arange(TOKENS) < 7, version - dispatch, version - newer)
        sampler = -rng.random(TOKENS)
        trainer = sampler + rng.normal(0.0, 0.02, TOKENS) + DRIFT_PER_LAG * lags * rng.random(TOKENS)
        sample = rollout["samples"][0]
        sample["logprobs"] = sampler.round(6).tolist()
        sample["trainer_logprobs"] = [None, *trainer[1:].round(6).tolist()]  # position 0 uncovered
        env = ENVS[i % len(ENVS)]
        if env is not None:
            rollout["env"] = env
        made.append(rollout)
    return made


class Traffic:
    """A sink fed step after step; each :meth:`next_report` adds one step's rollouts and ships them."""

    def __init__(self, seed: int = 7) -> None:
        # SPEC 14 on this small traffic: floor_min_tokens 2, so its few tokens per lag give the floor and the
        # curve; a budget the curve crosses after lag 2 (its excess grows as (0.1 lag)^2 / 6), so the suggestion
        # is a lag of the curve.
        config = StalenessConfig(
            max_staleness=MAX_STALENESS,
            env_breakdown=True,
            floor_min_tokens=FLOOR_MIN_TOKENS,
            floor_max_age=FLOOR_MAX_AGE,
            mismatch_budget=BUDGET,
        )
        self.sink = Sink(config)
        self.rng = np.random.default_rng(seed)
        self.step = 0

    def next_report(self) -> StepReport:
        self.step += 1
        self.sink.add(rollouts(self.step, self.rng))
        return self.sink.ship(self.step).report
