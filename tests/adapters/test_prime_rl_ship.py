"""SPEC 15's call for prime-rl, the lines of its docs page run as they sit in ``TrainSink.process_batch``.

prime-rl is not on PyPI, so its types cannot be imported here: the episodes are those of the example run
(``tests/examples/prime-rl-run``, written by prime-rl's own record code), read as attribute objects, and
``TrainingSample`` is the dataclass of its fields this project's other prime-rl tests use. Each trace
becomes one sample; the logged ``off_policy/*`` of the run are what the ship must reproduce.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from staleness_metrics import StalenessConfig, StalenessMonitor
from staleness_metrics.adapters import prime_rl_live
from staleness_metrics.engine.sink import Sink
from staleness_metrics.errors import TraceError
from staleness_metrics.exporters.jsonl import JsonlExporter
from tests.adapters.test_prime_rl_live import TrainingSample, sample
from tests.support.examples import EXAMPLES

RUN = EXAMPLES / "prime-rl-run"
PAGE = Path(__file__).resolve().parents[2] / "docs" / "trainers" / "prime-rl.md"


def page_block(title: str) -> str:
    """The first ```python block after ``title`` on prime-rl's page of the docs."""
    text = PAGE.read_text(encoding="utf-8")
    return re.search(r"```python\n(.*?)```", text[text.index(title) :], re.S).group(1)  # type: ignore[union-attr]


def as_object(value: Any) -> Any:
    if isinstance(value, dict):
        return SimpleNamespace(**{k: as_object(v) for k, v in value.items()})
    return [as_object(v) for v in value] if isinstance(value, list) else value


def train_work(episode: Any) -> Any:
    """prime-rl's ``orchestrator/utils.py`` ``train_work``: the episode's ``run.work``."""
    return episode.run.work


def step_batch(step: int) -> tuple[dict[str, list[TrainingSample]], dict[str, Any]]:
    """The traces batch ``step`` shipped, as ``process_batch`` holds them: samples by trace id, and the
    episode of each trace."""
    selected: dict[str, list[TrainingSample]] = {}
    episodes: dict[str, Any] = {}
    path = RUN / "rollouts" / f"step_{step}" / "train" / "effective" / "traces.jsonl"
    for line in path.read_text().splitlines():
        episode = as_object(json.loads(line))
        for trace in episode.traces:
            selected[trace.id] = [sample([0, 1, 1])]
            episodes[trace.id] = episode
    return selected, episodes


def run_readme_lines(monitor: StalenessMonitor, step: int) -> Any:
    selected_by_trace, episode_by_trace = step_batch(step)
    trainer_sink = SimpleNamespace(progress=SimpleNamespace(step=step), episode_by_trace=episode_by_trace)
    samples = [s for trace_samples in selected_by_trace.values() for s in trace_samples]
    namespace: dict[str, Any] = {
        "self": trainer_sink,
        "monitor": monitor,
        "samples": samples,
        "selected_by_trace": selected_by_trace,
        "train_work": train_work,
    }
    exec(page_block("prime-rl, the lines to add"), namespace)
    return namespace["samples"]


def test_the_readme_lines_reproduce_the_logged_off_policy_maxima(tmp_path: Path) -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=8), [JsonlExporter(tmp_path / "m.jsonl")])
    logged = {row["step"]: row for row in map(json.loads, (RUN / "metrics.jsonl").read_text().splitlines())}
    shipped = {step: run_readme_lines(monitor, step) for step in sorted(logged)}
    monitor.close()
    ours = {row["step"]: row for row in map(json.loads, (tmp_path / "m.jsonl").read_text().splitlines())}
    assert sorted(ours) == sorted(logged)
    for step, row in logged.items():
        # per trace here, per episode there: the maxima agree whatever the traces per episode
        assert ours[step]["staleness/rollout/max"] == row["off_policy/max"], step
        assert ours[step]["staleness/rollout/in_queue/max"] == row["off_policy/in_queue/max"], step
        samples = shipped[step]
        assert all(isinstance(s, TrainingSample) for s in samples)  # the same objects, nothing dropped
        _, episode_by_trace = step_batch(step)
        starts = [train_work(episode).policy.start for episode in episode_by_trace.values()]
        expected = [[-1, step - 1 - start, step - 1 - start] for start in starts]
        assert [lag.tolist() for lag in samples.staleness_lag] == expected  # position 0 is context


def test_a_tight_bound_drops_and_masks_in_the_samples_themselves() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=0))
    for step in (1, 2):
        run_readme_lines(monitor, step)
    _, episode_by_trace = step_batch(3)
    starts = {t: train_work(e).policy.start for t, e in episode_by_trace.items()}
    samples = run_readme_lines(monitor, 3)
    assert len(samples) == sum(1 for start in starts.values() if start >= 2)  # T = 2, bound 0
    assert samples.shipment.dropped_rollouts == tuple(t for t, start in starts.items() if start < 2)
    assert all(s.mask == [False, True, True] for s in samples)
    assert all(np.array_equal(lag, [-1, 0, 0]) for lag in samples.staleness_lag)


def test_the_readme_cost_lines_give_the_sinks_sums() -> None:
    """prime-rl's cost family through ``staleness_lag`` equals what a sink sums when the same traces
    arrive as SPEC 3 records carrying the trainer's log-probabilities."""
    rng = np.random.default_rng(3)
    monitor, reference = StalenessMonitor(StalenessConfig(max_staleness=1)), Sink(StalenessConfig(max_staleness=1))
    compared = 0
    for step in (1, 2, 3):
        selected_by_trace, episode_by_trace = step_batch(step)
        samples = run_readme_lines(monitor, step)
        trainer_logprobs = [np.asarray(s.logprobs) + rng.normal(0, 0.05, len(s.logprobs)) for s in samples]
        shipped_ids = [r.id for r in samples.shipment.rollouts]
        records = []
        for trace_id, episode in episode_by_trace.items():
            policy = train_work(episode).policy
            sample_record: dict[str, Any] = {"mask": [0, 1, 1], "logprobs": selected_by_trace[trace_id][0].logprobs}
            if trace_id in shipped_ids:
                sample_record["trainer_logprobs"] = trainer_logprobs[shipped_ids.index(trace_id)].tolist()
            records.append(
                {"id": trace_id, "dispatch_version": policy.start, "completion_version": policy.end,
                 "samples": [sample_record]}
            )  # fmt: skip
        reference.add(records)
        expected = reference.ship(step).report.mismatch
        namespace: dict[str, Any] = {"monitor": monitor, "samples": samples, "step": step, "np": np}
        namespace["trainer_logprobs"] = trainer_logprobs
        exec(page_block("prime-rl, the cost family"), namespace)
        if expected is None:
            assert int(namespace["sums"].tokens.sum()) == 0
            continue
        ours, sinks = namespace["sums"].to_dict(), expected.to_dict()
        for bucket, values in sinks["lags"].items():
            assert ours["lags"][bucket] == pytest.approx(values, rel=1e-12, abs=1e-12), (step, bucket)
        compared += int(expected.tokens[1:].sum() > 0)  # a step with stale positions
    assert compared >= 1


def test_the_step_is_not_the_version() -> None:
    monitor = StalenessMonitor()
    selected_by_trace, episode_by_trace = step_batch(3)
    samples = [s for trace_samples in selected_by_trace.values() for s in trace_samples]
    ids = [t for t, trace_samples in selected_by_trace.items() for _ in trace_samples]
    policy = {t: prime_rl_live.policy_span(train_work(e).policy) for t, e in episode_by_trace.items()}
    newest = max(end for _, end in policy.values() if end is not None)
    with pytest.raises(TraceError, match=r"pass prime-rl's progress.step - 1"):
        prime_rl_live.ship(monitor, samples, version=newest - 1, rollout_ids=ids, policy=policy)
