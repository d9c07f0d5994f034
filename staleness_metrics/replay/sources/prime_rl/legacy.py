"""prime-rl run directories in the older layout (``rollouts/step_N/train/{all,effective}``) as a
SPEC 9 event stream: an episode one rollout, each trace one sample of one unlabelled position."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ....errors import EventError, TraceError
from ..events import EventDict, iter_json_lines

_STEP_DIR = re.compile(r"^step_(\d+)$")


def episode_rollout(record: Mapping[str, Any]) -> EventDict:
    """One episode record -> one SPEC 3 rollout (each trace one unlabelled position)."""
    episode_id = record.get("id")
    if not isinstance(episode_id, str) or not episode_id:
        raise TraceError(None, "id", f"expected a non-empty string, got {episode_id!r}")
    traces = record.get("traces")
    if not isinstance(traces, list):
        raise TraceError(episode_id, "traces", f"expected a list, got {type(traces).__name__}")
    rollout: dict[str, Any] = {"id": episode_id, "samples": [{"mask": [1]} for _ in traces]}
    if isinstance(group := record.get("group"), Mapping) and group.get("id") is not None:
        rollout["group_id"] = str(group["id"])
    if isinstance(env := record.get("env"), Mapping) and env.get("name"):
        rollout["env"] = str(env["name"])
    run = record.get("run")
    work = run.get("work") if isinstance(run, Mapping) else None
    policy = work.get("policy") if isinstance(work, Mapping) else None
    if policy is None:
        # No policy span: sampled by a frozen model (prime-rl's episode_staleness returns 0s).
        rollout["source"] = "frozen"
        return rollout
    if not isinstance(policy, Mapping):
        raise TraceError(episode_id, "run.work.policy", f"expected an object, got {type(policy).__name__}")
    rollout["dispatch_version"] = policy.get("start")
    if policy.get("end") is not None:
        rollout["completion_version"] = policy["end"]
    return rollout


def step_dirs(root: Path) -> dict[int, Path]:
    """The ``rollouts/step_N/train`` folders by step."""
    rollouts = root / "rollouts"
    if not rollouts.is_dir():
        return {}
    found = {}
    for child in rollouts.iterdir():
        if (match := _STEP_DIR.match(child.name)) and (child / "train").is_dir():
            found[int(match.group(1))] = child / "train"
    return found


def _episodes(path: Path) -> Iterator[EventDict]:
    if not path.is_file():
        return
    for number, value in iter_json_lines(path):
        if not isinstance(value, dict):
            raise EventError(number, f"{path}: expected an episode object, got {type(value).__name__}")
        try:
            yield episode_rollout(value)
        except TraceError as error:  # the record cannot become a rollout: say which file and line
            raise EventError(number, f"{path}: {error}") from error


def stale_at_arrival(start: object, step: int, bound: int) -> bool:
    """Whether work dispatched at ``start`` arriving at ``step`` is stale (a ``start`` that is not
    an integer counts as stale: the sink names what is wrong with it)."""
    return not isinstance(start, int) or isinstance(start, bool) or (step - 1) - start > bound


def read_prime_rl(run_dir: str | Path, *, max_staleness: int = 8) -> Iterator[EventDict]:
    """The run as SPEC 9 events: per step, the arrivals, then a ``ship`` of the effective ids; a
    never-shipped episode enters when stale at its arrival (the sink drops it)."""
    root = Path(run_dir)
    steps = step_dirs(root)
    if not steps:
        raise EventError(0, f"{root}: no rollouts/step_N/train folders (not a prime-rl run directory)")
    effective = {step: train / "effective" / "traces.jsonl" for step, train in sorted(steps.items())}
    shipped = {step: list(_episodes(path)) for step, path in effective.items() if path.is_file()}
    ships = {rollout["id"] for rollouts in shipped.values() for rollout in rollouts}
    added: set[str] = set()
    for step in sorted(steps):
        for rollout in _episodes(steps[step] / "all" / "traces.jsonl"):
            live = rollout.get("source") != "frozen"
            start = rollout.get("dispatch_version")
            if rollout["id"] in ships or (live and stale_at_arrival(start, step, max_staleness)):
                added.add(rollout["id"])
                yield {"type": "rollout", "rollout": rollout}
        if step not in shipped:
            continue
        # Shipped episodes whose arrival was not recorded enter just before their ship.
        for rollout in shipped[step]:
            if rollout["id"] not in added:
                added.add(rollout["id"])
                yield {"type": "rollout", "rollout": rollout}
        yield {"type": "ship", "step": step, "ids": [rollout["id"] for rollout in shipped[step]]}


def shipped_counts(run_dir: Path) -> dict[int, tuple[int, int]]:
    """``(live, frozen)`` episodes per step in the effective files."""
    counts = {}
    for step, train in step_dirs(run_dir).items():
        rollouts = list(_episodes(train / "effective" / "traces.jsonl"))
        frozen = sum(rollout.get("source") == "frozen" for rollout in rollouts)
        counts[step] = (len(rollouts) - frozen, frozen)
    return counts
