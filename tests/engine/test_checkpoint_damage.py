"""SPEC 13: a damaged checkpoint is refused by name, and refusing it leaves the monitor as it was.

An exhaustive walk over the state tree of a monitor checkpoint (queued rollouts with per-token and span
versions, weights, missing trainer log-probabilities, a frozen and an agentic rollout, groups, envs,
an open window with drops and an invalid rollout, held groups, mismatch sums, the Prometheus series)
damages one node at a time: a key removed, a number negated or inflated, a list shortened, a value of
another type. Each damaged state must raise ``ConfigError`` whose message names a key path of the state
(never another exception), and the monitor it was loaded into must be unchanged: it then ships exactly
like one that was never touched.

Damage is caught by the digests saved with a checkpoint, so the same walk runs again with the digests
recomputed after each damage (a state that was built wrongly rather than damaged): then the checks of
structure, types, ranges and consistency must refuse it by name, or it loads and later calls raise only
the library's own errors. Never a crash: that walk runs in a subprocess (a stray write of a compiled
kernel would kill it rather than pytest).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from staleness_metrics import ConfigError, StalenessConfig, StalenessMonitor
from staleness_metrics.state_checks import digests_of
from tests.engine.test_checkpoint import ROOT, final_state, new_monitor
from tests.engine.test_checkpoint_cuts import Call, apply

Path = tuple[str | int, ...]
SWAPS: dict[type, Any] = {str: 7, int: "7", float: "0.5", bool: 1, list: {"x": 1}, dict: [1], type(None): 0}


def record(rid: str, dispatch: int, **extra: Any) -> dict[str, Any]:
    sample = {"mask": [0, 1, 1, 1], "token_versions": [-1, dispatch, -1, dispatch + 1], "rl_weights": [0, 1, 1, 0.5]}
    return {"id": rid, "dispatch_version": dispatch, "samples": [sample], **extra}


def scenario(policy: str) -> tuple[StalenessConfig, list[Call], int]:
    """Calls whose state after ``cut`` holds a bit of everything, and calls after it that depend on it all."""
    if policy == "xtuner":
        config = StalenessConfig(
            policy="xtuner", max_staleness=1, max_token_staleness=0, retry_expired=True, strict=False
        )
    else:
        config = StalenessConfig(policy="token", max_staleness=1, strict=False, env_breakdown=True)
    spans = {"mask": [1, 1, 1], "weight_versions": [[1, 0], [2, 2]], "trainer_logprobs": [None, -0.5, -0.25]}
    calls: list[Call] = [
        {"call": "add", "rollouts": [
            record("a", 0, group_id="g", env="math"), record("b", 2, group_id="g", env="math"),
            {"id": "s", "dispatch_version": 1, "env": "code", "agentic": True, "samples": [spans]},
        ]},
        {"call": "ship", "step": 3, "ids": None},
        {"call": "record_mismatch", "step": 3, "rank": 0},
        {"call": "add", "rollouts": [
            record("c", 2, group_id="h", env="code"), record("d", 3, group_id="g", env="math"),
            {"id": "f", "source": "frozen", "samples": [{"mask": [1, 1]}]},
            {"id": "bad", "dispatch_version": "x", "samples": [{"mask": [1]}]},  # set aside (lenient)
        ]},
        {"call": "add", "rollouts": [
            record("e", 1, env="math"), {"id": "t", "dispatch_version": 3, "samples": [spans]},
        ]},
        {"call": "sweep", "step": 4},
        # the cut: everything below depends on what the checkpoint holds
        {"call": "ship", "step": 4, "ids": ["c", "f"]},
        {"call": "add", "rollouts": [record("g1", 4, group_id="g"), record("h1", 4, group_id="h")]},
        {"call": "record_mismatch", "step": 3, "rank": 1},
        {"call": "ship", "step": 6, "ids": None},
        {"call": "record_mismatch", "step": 6, "rank": 0},
    ]  # fmt: skip
    return config, calls, 6


def prepared(config: StalenessConfig, calls: list[Call]) -> StalenessMonitor:
    monitor = new_monitor(config)
    for call in calls:
        apply(monitor, call)
    return monitor


def nodes(value: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every node; of a list of plain values (an array's data, ids), of the lag buckets of mismatch sums and of
    a report's metrics, the first and the last stand for the rest (alike, and checked by one code path)."""
    yield path, value
    if isinstance(value, dict):
        items = list(value.items())
        if path and (path[-1] in ("lags", "metrics") or path[-2:-1] == ("env_metrics",)) and items:
            items = [items[0], items[-1]] if len(items) > 1 else items
        for key, item in items:
            yield from nodes(item, (*path, key))
    elif isinstance(value, list):
        plain = all(not isinstance(item, (dict, list)) for item in value)
        for index in sorted({0, len(value) - 1}) if plain and value else range(len(value)):
            yield from nodes(value[index], (*path, index))


def damages(state: dict[str, Any]) -> Iterator[tuple[Path, str, Any]]:
    """Every damage of one node: (its path, what was done, the new value or ``REMOVE``)."""
    for path, value in nodes(state):
        if not path:
            continue
        if isinstance(path[-1], str):
            yield path, "removed", REMOVE
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if value != 0:
                yield path, "negated", -value
            yield path, "inflated", value * 1000 + (7 if isinstance(value, int) else 0.5)
        if isinstance(value, list) and value:
            yield path, "shortened", value[:-1]
        yield path, "swapped", SWAPS[type(value)]


REMOVE = object()


def damaged(text: str, path: Path, new: Any) -> Any:
    state = json.loads(text)
    parent = state
    for key in path[:-1]:
        parent = parent[key]
    if new is REMOVE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return state


def resign(state: Any) -> Any:
    """The digests of a damaged state recomputed, as if it had been saved that way."""
    if isinstance(state, dict) and isinstance(state.get("sink"), dict) and "digests" in state["sink"]:
        sink = state["sink"]
        sink["digests"] = digests_of({k: v for k, v in sink.items() if k != "digests"})
    if isinstance(state, dict) and "digests" in state:
        state["digests"] = digests_of({k: v for k, v in state.items() if k != "digests"}, skip=("sink",))
    return state


def resolves(state: Any, path: str) -> bool:
    """Whether ``a.b[3].c`` names a node of ``state`` (or a key reported missing, on an existing parent)."""
    node = state
    tokens = re.findall(r'[^.\[\]]+|\[\d+\]|\[""\]', path)
    for position, token in enumerate(tokens):
        if token.startswith("[") and token != '[""]':
            index = int(token[1:-1])
            if not isinstance(node, list) or index >= len(node):
                return False
            node = node[index]
            continue
        key = "" if token == '[""]' else token
        if not isinstance(node, dict):
            return False
        if key not in node:
            return position == len(tokens) - 1  # a missing key, named on its parent
        node = node[key]
    return True


def identity(monitor: StalenessMonitor) -> list[int]:
    """Which objects hold the monitor's state: a load replaces them (a refused one must not)."""
    exporter = monitor.exporters[0]
    held = [*vars(monitor.sink).values(), monitor.sink.policy.state_dict(), exporter.state_dict()]
    return [id(value) for value in held[:-2]] + [hash(json.dumps(held[-2:])), id(monitor._shipped_steps)]


def walk(policy: str, resigned: bool) -> dict[str, Any]:
    """Load every damaged state into one monitor; what happened, by outcome."""
    config, calls, cut = scenario(policy)
    source = prepared(config, calls[:cut])
    text = json.dumps(source.state_dict())
    undamaged = json.loads(text)
    expected = [apply(source, call) for call in calls[cut:]]
    expected_final = final_state(source)
    # The monitor damaged states are loaded into: mid-run itself, so refusing must keep a real state.
    target = prepared(config, calls[:2])
    target_state = identity(target)

    def fresh() -> tuple[StalenessMonitor, list[int]]:
        monitor = prepared(config, calls[:2])
        return monitor, identity(monitor)

    outcome: dict[str, Any] = {"refused": 0, "loaded": 0, "unnamed": [], "other": [], "changed": [], "differs": []}
    for path, what, new in damages(undamaged):
        label = f"{'.'.join(map(str, path))} {what}"
        state = damaged(text, path, new)
        if resigned:
            state = resign(state)
        try:
            target.load_state_dict(state)
        except ConfigError as exc:
            outcome["refused"] += 1
            named = re.match(r"checkpoint: ([^:]+): ", str(exc))
            if named is None or not (resolves(undamaged, named.group(1)) or resolves(state, named.group(1))):
                outcome["unnamed"].append(f"{label}: {exc}")
            if identity(target) != target_state:
                outcome["changed"].append(label)
                target, target_state = fresh()
            continue
        except Exception as exc:
            outcome["other"].append(f"{label}: {type(exc).__name__}: {exc}")
            target, target_state = fresh()
            continue
        outcome["loaded"] += 1
        try:  # loaded: the rest of the run may differ only for a re-signed state, and raise only our errors
            after = [apply(target, call) for call in calls[cut:]]
            if not resigned and (after != expected or final_state(target) != expected_final):
                outcome["differs"].append(label)
        except Exception as exc:
            outcome["other"].append(f"{label}: after loading, {type(exc).__name__}: {exc}")
        target, target_state = fresh()
    # The monitor every refused state was loaded into ships like one never touched.
    untouched = prepared(config, calls[:2])
    outcome["continues"] = [apply(target, call) for call in calls[2:]] == [apply(untouched, c) for c in calls[2:]]
    outcome["continues"] &= final_state(target) == final_state(untouched)
    return outcome


@pytest.mark.parametrize("policy", ["xtuner", "token"])
def test_every_damage_of_a_checkpoint_is_refused_by_name_and_changes_nothing(policy: str) -> None:
    outcome = walk(policy, resigned=False)
    assert outcome["refused"] > 500 and outcome["loaded"] == 0  # each damage is caught, at least by a digest
    assert outcome["other"] == [] and outcome["unnamed"] == [] and outcome["changed"] == []
    assert outcome["continues"]


@pytest.mark.parametrize("policy", ["xtuner"])  # the richest state (held groups, owed re-rollouts); costs most
def test_wrongly_built_checkpoints_are_refused_by_name_or_load_harmlessly(policy: str) -> None:
    script = (
        f"import json, sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.engine.test_checkpoint_damage import walk\n"
        f"print(json.dumps(walk({policy!r}, resigned=True)))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]  # no crash (a compiled kernel writing out of bounds)
    outcome = json.loads(done.stdout)
    assert outcome["refused"] > 300
    assert outcome["other"] == [] and outcome["unnamed"] == [] and outcome["changed"] == []
    assert outcome["continues"]
