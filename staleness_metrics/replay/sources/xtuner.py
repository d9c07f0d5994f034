"""xtuner rollout states (``RolloutState`` as JSON) as a SPEC 9 event stream: one rollout per
state, then one ``ship`` (``docs/run-inputs.md``, "xtuner rollout states")."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import EventError
from .events import EventDict, iter_json_lines


def _versions(steps: object) -> list[int]:
    if not isinstance(steps, list):
        return []
    return [v for v in steps if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def state_rollout(state: Mapping[str, Any], fallback_id: str) -> dict[str, Any]:
    """One rollout state -> one SPEC 3 rollout dict (the sink validates lengths and types)."""
    ident = next((state[k] for k in ("uid", "rollout_id") if state.get(k) is not None), fallback_id)
    response_ids = state.get("response_ids")
    mask = state.get("response_mask")
    if mask is None:
        mask = [1] * len(response_ids) if isinstance(response_ids, list) else []
    sample: dict[str, Any] = {"mask": mask}
    for name, source in (("token_versions", "response_model_steps"), ("logprobs", "logprobs")):
        if state.get(source) is not None:
            sample[name] = state[source]
    rollout: dict[str, Any] = {"id": str(ident), "samples": [sample]}
    if versions := _versions(state.get("response_model_steps")):
        rollout["dispatch_version"] = min(versions)
        rollout["completion_version"] = max(versions)
    if state.get("group_id") is not None:
        rollout["group_id"] = str(state["group_id"])
    if state.get("task_name"):
        rollout["env"] = str(state["task_name"])
    if state.get("tools") or state.get("tool_calls"):
        rollout["agentic"] = True
    return rollout


@dataclass
class XtunerRead:
    """The events of one states file and what was left out, by status."""

    events: list[EventDict]
    step: int
    skipped: dict[str, int] = field(default_factory=dict)

    def __iter__(self) -> Iterator[EventDict]:
        return iter(self.events)


def _states(source: str | Path | Iterable[Mapping[str, Any]]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    if isinstance(source, (str, Path)):
        for number, value in iter_json_lines(source):
            members = value if isinstance(value, list) else [value]
            for index, state in enumerate(members):
                if not isinstance(state, dict):
                    raise EventError(number, f"expected a rollout state object, got {type(state).__name__}")
                yield (f"line{number}" if len(members) == 1 else f"line{number}.{index}"), state
    else:
        yield from ((f"state{index}", state) for index, state in enumerate(source))


def read_xtuner_states(
    source: str | Path | Iterable[Mapping[str, Any]],
    *,
    step: int | None = None,
    statuses: Collection[str] = ("completed",),
) -> XtunerRead:
    """Rollout events for the states with a taken ``status``, then one ship at ``step``."""
    wanted = {s.lower() for s in statuses}
    events: list[EventDict] = []
    skipped: dict[str, int] = {}
    newest = -1
    for fallback, state in _states(source):
        if (status := str(state.get("status", "completed")).lower()) not in wanted:
            skipped[status] = skipped.get(status, 0) + 1
            continue
        newest = max([newest, *_versions(state.get("response_model_steps"))])
        events.append({"type": "rollout", "rollout": state_rollout(state, fallback)})
    ship_step = step if step is not None else max(newest + 1, 1)
    events.append({"type": "ship", "step": ship_step})
    return XtunerRead(events, ship_step, skipped)
