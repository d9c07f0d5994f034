"""Inputs from real runs as the SPEC 9 event stream: event files, prime-rl run directories (either
layout) and xtuner states; :func:`detect_source` tells them apart (docs/run-inputs.md)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

from ...errors import ConfigError, EventError
from ..stream import Event, read_event_path, read_events, stream_compression
from .events import EventDict, read_event_file
from .prime_rl import (
    ComparisonRow,
    PrimeRlRead,
    compare_prime_rl,
    is_current_layout,
    is_prime_rl_run,
    read_prime_rl,
    read_prime_rl_metrics,
    read_run_events,
)
from .xtuner import read_xtuner_states

_log = logging.getLogger(__name__)

__all__ = [
    "ComparisonRow",
    "EventDict",
    "PrimeRlRead",
    "SourceKind",
    "as_replay_events",
    "compare_prime_rl",
    "detect_and_read",
    "detect_source",
    "is_current_layout",
    "is_event_file",
    "is_prime_rl_run",
    "read_prime_rl",
    "read_prime_rl_metrics",
    "read_run",
    "read_run_events",
    "read_xtuner_states",
]

SourceKind = Literal["prime-rl", "events", "xtuner", "metrics"]


def _first_object(path: Path) -> object:
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    value: object = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ConfigError(f"{path}: line {number} is not JSON ({error.msg})") from None
                return value[0] if isinstance(value, list) and value else value
    raise ConfigError(f"{path}: the file is empty")


def detect_source(path: str | Path) -> SourceKind:
    """What kind of run input ``path`` is (``ConfigError`` when it is none of them)."""
    root = Path(path)
    if root.is_dir():
        if is_prime_rl_run(root):
            return "prime-rl"
        raise ConfigError(
            f"{root}: not a prime-rl run directory (no monitors/file/traces/stream, "
            "traces/stream.jsonl, rollouts/step_N/train or metrics.jsonl)"
        )
    if not root.is_file():
        pipe = "not a regular file (a pipe?); save it to a file first"  # (it reads only once)
        raise ConfigError(f"{root}: {pipe if root.exists() else 'no such file or directory'}")
    if isinstance(first := _first_object(root), dict):
        if "type" in first:
            return "events"
        if "response_ids" in first or "response_model_steps" in first:
            return "xtuner"
        if "step" in first:
            return "metrics"
    raise ConfigError(
        f"{root}: not an event stream (objects with 'type'), xtuner states ('response_ids') or logged metrics ('step')"
    )


def is_event_file(path: str | Path) -> bool:
    """Whether ``path`` is read as a SPEC 9 event stream: compressed, a first object with ``type``,
    or a first line that is not JSON (the event reader names the fault)."""
    if Path(path).is_file() and stream_compression(path) is not None:
        return True
    try:
        return detect_source(path) == "events"
    except (ValueError, RecursionError):  # ConfigError and UnicodeDecodeError are ValueErrors
        return Path(path).is_file()


def detect_and_read(
    path: str | Path, *, max_staleness: int = 8, step: int | None = None, strict: bool = True
) -> Iterator[EventDict]:
    """The SPEC 9 events of a run input, whatever its format: ``max_staleness`` the bound they
    will be replayed at (it decides which unshipped prime-rl episodes enter), ``step`` an xtuner
    file's ship step, ``strict`` whether a damaged prime-rl run stops (else damage is counted)."""
    kind = detect_source(path)
    if kind == "prime-rl" and is_current_layout(path):
        return map(_event_dict, read_run_events(path, max_staleness=max_staleness, strict=strict))
    if kind == "prime-rl":
        return read_prime_rl(path, max_staleness=max_staleness)
    if kind == "xtuner":
        read = read_xtuner_states(path, step=step)
        if read.skipped:  # said, not hidden: states that are not `completed` never enter the sink
            left_out = ", ".join(f"{n} {status}" for status, n in sorted(read.skipped.items()))
            _log.warning("%s: left out xtuner states that are not completed: %s", path, left_out)
        return iter(read)
    if kind == "events":
        return read_event_file(path)
    raise ConfigError(
        f"{path}: holds logged metrics, not events; `staleness-metrics report` can plot it, "
        "replay needs rollouts (an event stream, a prime-rl run directory or xtuner states)"
    )


def _event_dict(event: Event) -> EventDict:
    if event.kind != "rollout":
        ids = {"ids": list(event.ids)} if event.ids is not None else {}
        return {"type": event.kind, "step": event.step, **ids}
    if event.parsed is None:
        assert event.unparsed is not None
        raise EventError(event.line, str(event.unparsed.error))
    samples = []
    for sample in event.parsed.samples:
        record: dict[str, object] = {"mask": sample.mask.tolist()}
        for name in ("token_versions", "logprobs", "trainer_logprobs"):
            if (values := getattr(sample, name)) is not None:
                record[name] = [None if v != v else v for v in values.tolist()]  # NaN -> null
        samples.append(record)
    return {"type": "rollout", "rollout": {**event.parsed.echo, "samples": samples}}


def as_replay_events(events: Iterable[EventDict]) -> Iterator[Event]:
    """Event dicts as the replay's checked events (the same checks as a JSONL file gets)."""
    return read_events(json.dumps(event) for event in events)


def read_run(
    path: str | Path, *, max_staleness: int = 8, step: int | None = None, parse: bool = False, strict: bool = True
) -> Iterator[Event]:
    """:func:`detect_and_read` as checked replay events (an event stream read as bytes, as
    ``replay`` reads it; ``parse`` as in :func:`~staleness_metrics.replay.stream.read_events`)."""
    if is_event_file(path):  # compressed too, as the replay command reads it
        yield from read_event_path(path, parse=parse)
    elif detect_source(path) == "prime-rl" and is_current_layout(path):
        yield from read_run_events(path, max_staleness=max_staleness, strict=strict)
    else:
        yield from as_replay_events(detect_and_read(path, max_staleness=max_staleness, step=step, strict=strict))
