"""The live monitor's trainer updates (``log_annotations``) on episodes built by verifiers' own classes:
prime-rl logs them as they come, so a call folds only its own streams into the shipped trace, and the
monitor ends where one call with all of them ends."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from staleness_metrics import StalenessConfig, StalenessMonitor
from staleness_metrics.adapters import prime_rl_monitor
from staleness_metrics.adapters.prime_rl_monitor import PrimeRlMonitor
from staleness_metrics.exporters import Exporter, JsonlExporter
from tests.support.prime_rl_writer import NodeSpec, make_episode, make_trace

STEP = 6


def _arrived(
    branches: dict[str, int], env_breakdown: bool = False, exporters: Sequence[Exporter] = ()
) -> tuple[PrimeRlMonitor, list[Any]]:
    """A monitor handed, at STEP, one episode per trace (its env the trace's name): a 3-token prompt and
    ``branches[trace]`` sampled replies of two tokens, dispatched at STEP - 3 (lag 2: unlabelled)."""
    config = StalenessConfig(max_staleness=8, env_breakdown=env_breakdown)
    live = PrimeRlMonitor(StalenessMonitor(config, list(exporters)))
    episodes = []
    for name, count in branches.items():
        nodes = [NodeSpec(None, 3), *(NodeSpec(0, 1, (-0.1 - 0.01 * b, -0.2)) for b in range(count))]
        trace = make_trace(name, nodes)
        episodes.append(make_episode(f"e-{name}", [trace], env=name, step=STEP, policy=(STEP - 3, STEP - 3)))
    live.log(episodes, STEP, "train", "all")
    return live, episodes


def _shipped(
    branches: dict[str, int], env_breakdown: bool = False, exporters: Sequence[Exporter] = ()
) -> PrimeRlMonitor:
    """The monitor of :func:`_arrived`, its episodes shipped at STEP."""
    live, episodes = _arrived(branches, env_breakdown, exporters)
    live.log(episodes, STEP, "train", "effective")
    assert sorted(live.shipments[STEP].ids) == sorted(branches)
    return live


def _stream(b: int, shift: float) -> list[float | None]:
    """Branch ``b``'s trainer log-probabilities (the prompt's 4 positions null, one sampled one null
    on every third branch)."""
    return [None] * 4 + [-0.1 - 0.01 * b + shift, None if b % 3 == 0 else -0.2 + shift]


def _updates(branches: dict[str, int]) -> list[dict[str, Any]]:
    """Per trace: one stream per branch, a wrong one later rewritten on every fourth branch, one too long
    (left out) and one of a branch the trace lacks, and an update without streams."""
    updates: list[dict[str, Any]] = []
    for name, count in branches.items():
        for b in range(count):
            streams = [_stream(b, 0.5), _stream(b, 0.01 * b)] if b % 4 == 0 else [_stream(b, 0.02)]
            if b == 1:
                streams.append([-0.1] * 9)
            updates += [{"trace_id": name, "branches": [{"index": b, "trainer_logprobs": s}]} for s in streams]
        updates.append({"trace_id": name, "branches": [{"index": count, "trainer_logprobs": [-0.3]}]})
        updates.append({"trace_id": name, "info": {"effective": True}, "branches": [{"index": 0}]})
    return updates


def _state(live: PrimeRlMonitor) -> str:
    return json.dumps(live.state_dict(), sort_keys=True)


def _close(a: Any, b: Any) -> bool:
    """Equal states but for float rounding (and the digests of what is rounded)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(k == "digests" or _close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_close, a, b))
    return a == pytest.approx(b, rel=1e-12) if isinstance(a, float) else a == b


@pytest.mark.parametrize("env_breakdown", [False, True])
def test_updates_one_a_call_end_where_all_in_one_call_end(env_breakdown: bool) -> None:
    """Each call records its change per (step, env): one env, the same sums to the bit; an env
    breakdown over two envs adds a call's per env, so the batch's total differs by float rounding."""
    branches = {"math": 12, "code": 5}
    updates = _updates(branches)
    one_a_call, at_once = _shipped(branches, env_breakdown), _shipped(branches, env_breakdown)
    for update in updates:
        one_a_call.log_annotations([update])
    at_once.log_annotations(updates)
    if env_breakdown:  # the sink, the step's sums and the traces kept
        assert _state(one_a_call) != _state(at_once) and _close(one_a_call.state_dict(), at_once.state_dict())
    else:
        assert _state(one_a_call) == _state(at_once)
    assert one_a_call.shipments[STEP].metrics == at_once.shipments[STEP].metrics
    metrics = at_once.monitor.mismatch_metrics(STEP) or {}
    assert (one_a_call.monitor.mismatch_metrics(STEP) or {}) == pytest.approx(metrics, rel=1e-12)
    if not env_breakdown:
        assert one_a_call.monitor.mismatch_metrics(STEP) == metrics
    assert metrics["staleness/mismatch/coverage"] == pytest.approx((17 * 2 - 6) / (17 * 2))  # nulls uncovered
    # in another order (each branch's streams in theirs): the same numbers but for float rounding
    by_branch: dict[tuple[str, object], list[dict[str, Any]]] = {}
    for update in updates:
        by_branch.setdefault((update["trace_id"], update["branches"][0]["index"]), []).append(update)
    shuffled = _shipped(branches, env_breakdown)
    for key in random.Random(0).sample(list(by_branch), len(by_branch)):
        shuffled.log_annotations(by_branch[key])
    batch = {k: v for k, v in metrics.items() if k.startswith("staleness/mismatch/")}
    got = shuffled.monitor.mismatch_metrics(STEP) or {}
    assert {k: v for k, v in got.items() if k in batch} == pytest.approx(batch, rel=1e-12)


def test_an_update_costs_its_own_streams_not_the_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """200 branches of one trace, one update a call: the trace is folded once, and each later call
    refolds and sums its own branch only (it refolded the whole trace per call: quadratic)."""
    branches = {"math": 200}
    live = _shipped(branches)
    work = {"records folded": 0, "samples summed": 0}

    def counted(name: str, key: str) -> None:
        real = getattr(prime_rl_monitor, name)

        def count(*args: Any, **kwargs: Any) -> Any:
            work[key] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(prime_rl_monitor, name, count)

    counted("trace_rollout", "records folded")
    counted("mismatch_sums", "samples summed")
    per_call = []
    for b in range(200):
        before = dict(work)
        live.log_annotations([{"trace_id": "math", "branches": [{"index": b, "trainer_logprobs": _stream(b, 0.02)}]}])
        per_call.append({key: work[key] - before[key] for key in work})
    assert per_call[0] == {"records folded": 1, "samples summed": 200 + 1}  # the fold, then its own branch
    assert all(cost == {"records folded": 0, "samples summed": 1} for cost in per_call[1:])
    metrics = live.monitor.mismatch_metrics(STEP) or {}
    assert metrics["staleness/mismatch/coverage"] == pytest.approx((400 - 67) / 400)


@pytest.mark.parametrize(
    ("interrupted", "retried"),
    [(True, False), (True, True), (False, True)],
    ids=["interrupted-loop-goes-on", "interrupted-call-retried", "finished-call-retried"],
)
def test_a_ship_interrupted_while_its_traces_are_kept_ends_as_if_it_fully_happened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interrupted: bool, retried: bool
) -> None:
    """Ctrl-C in log(effective) after the sink shipped (the report exported), while the shipped traces are
    kept: the next call keeps them all, so the trainer's updates count in full, and a retried call ships
    nothing again. It kept part of the traces (the updates of the others lost) and a retry shipped the step
    a second time, empty, in place of ``shipments[STEP]``."""
    branches = {f"t{i}": 2 + i % 3 for i in range(12)}
    updates = _updates(branches)
    straight = _shipped(branches, exporters=[JsonlExporter(tmp_path / "straight.jsonl")])
    straight.log_annotations(updates)
    straight.finalize()
    live, episodes = _arrived(branches, exporters=[JsonlExporter(tmp_path / "live.jsonl")])
    if interrupted:  # Ctrl-C as the fifth shipped trace is kept
        real, kept = prime_rl_monitor._Shipped, []

        def keep(*args: Any) -> Any:
            kept.append(args)
            if len(kept) == 5:
                raise KeyboardInterrupt
            return real(*args)

        monkeypatch.setattr(prime_rl_monitor, "_Shipped", keep)
        with pytest.raises(KeyboardInterrupt):
            live.log(episodes, STEP, "train", "effective")
        monkeypatch.undo()
    else:
        live.log(episodes, STEP, "train", "effective")
    if retried:
        live.log(episodes, STEP, "train", "effective")
    live.log_annotations(updates)
    live.finalize()
    assert sorted(live.shipments[STEP].ids) == sorted(branches)
    assert live.monitor.sink.totals.rollouts_shipped == len(branches)
    assert (tmp_path / "live.jsonl").read_bytes() == (tmp_path / "straight.jsonl").read_bytes()  # one ship
    assert live.monitor.mismatch_metrics(STEP) == straight.monitor.mismatch_metrics(STEP)
    assert _state(live) == _state(straight)
