"""A run directory: what a run wrote beside its event stream, named by a ``run.json``
(docs/run-inputs.md): ``demo`` writes one, ``report`` and ``what-if`` read it."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..config import StalenessConfig
from ..errors import ConfigError, EventError
from ..files import write_whole
from ..metrics.mismatch import MismatchSums
from .sources.events import iter_json_lines
from .stream import Event, read_event_path

RUN_FILE = "run.json"
RUN_FORMAT = "staleness-metrics run"
_FILES = ("events", "metrics", "trainer_logprobs", "mismatch_sums")
# settings only one policy takes (xtuner's, and the token policy's adaptive bound)
_POLICY_OWN = ("max_token_staleness", "sync_interval", "retry_expired",
               "adapt_every", "adapt_low", "adapt_high")  # fmt: skip


@dataclass(frozen=True)
class RunDirectory:
    """A run directory as its ``run.json`` describes it (absent optional files are None)."""

    root: Path
    config: Mapping[str, Any]
    events: Path
    metrics: Path | None = None
    trainer_logprobs: Path | None = None
    mismatch_sums: Path | None = None
    steps: int | None = None

    def staleness_config(self, **overrides: Any) -> StalenessConfig:
        """The run's settings, ``overrides`` applied (another policy drops those only the run's
        took); a bad, unknown or renamed setting is a ``ConfigError`` naming run.json, or the
        ``field`` overridden."""
        policy = self.config.get("policy", "token")
        dropped = _POLICY_OWN if overrides.get("policy", policy) != policy else ()
        own = {name: value for name, value in self.config.items() if name not in dropped}
        try:
            return StalenessConfig.from_mapping(own | overrides)
        except ConfigError as error:
            if error.field in overrides:
                raise
            raise ConfigError(f"{self.root / RUN_FILE}: config: {error}") from None

    def events_with_costs(self) -> Iterator[Event]:
        """The event stream, read as replay reads a stream (compressed, or with a byte-order mark),
        each shipped rollout's samples with the trainer's log-probabilities."""
        logprobs = self._trainer_logprobs()
        for event in read_event_path(self.events, parse=not logprobs):
            rollout = event.rollout or {}
            found = logprobs.get(rollout["id"]) if isinstance(rollout.get("id"), str) else None
            if found is not None and isinstance(samples := rollout.get("samples"), list):
                joined = [
                    {**sample, "trainer_logprobs": values} if values is not None and isinstance(sample, dict)
                    else sample
                    for sample, values in zip(samples, found, strict=False)
                ]  # fmt: skip
                rollout = {**rollout, "samples": [*joined, *samples[len(joined) :]]}
                event = replace(event, rollout=rollout, booleans=True)  # (may hold booleans)
            yield event

    def _trainer_logprobs(self) -> dict[str, list[Any]]:
        if self.trainer_logprobs is None:
            return {}
        out: dict[str, list[Any]] = {}
        for line, value in iter_json_lines(self.trainer_logprobs):
            if not (isinstance(value, dict) and isinstance(value.get("id"), str)):
                raise EventError(line, f"{self.trainer_logprobs}: expected an object with a string 'id'")
            samples = value.get("trainer_logprobs")
            if not isinstance(samples, list):
                raise EventError(line, f"{self.trainer_logprobs}: rollout {value['id']!r}: field trainer_logprobs: "
                                 "expected a list (one entry per sample)")  # fmt: skip
            out[value["id"]] = samples
        return out

    def posted_sums(self) -> list[tuple[int, MismatchSums]]:
        """The SPEC 11 sums the trainer recorded, per step (empty without the file)."""
        if self.mismatch_sums is None:
            return []
        out: list[tuple[int, MismatchSums]] = []
        for line, value in iter_json_lines(self.mismatch_sums):
            if not (isinstance(value, dict) and isinstance(value.get("step"), int) and "sums" in value):
                raise EventError(line, f'{self.mismatch_sums}: expected {{"step": S, "sums": {{...}}}}')
            try:
                out.append((value["step"], MismatchSums.from_dict(value["sums"])))
            except (ConfigError, TypeError, ValueError, KeyError) as error:
                raise EventError(line, f"{self.mismatch_sums}: step {value['step']}: sums: {error}") from None
        return out


def _read(root: Path) -> RunDirectory:
    path = root / RUN_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: bad JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != RUN_FORMAT:
        raise ConfigError(f'{path}: not a run file (expected "format": "{RUN_FORMAT}")')
    if type(version := data.get("version", 1)) is not int or version != 1:  # (a later release's layout)
        raise ConfigError(f"{path}: version: {version!r}: this staleness-metrics reads run files of version 1")
    files, config = data.get("files"), data.get("config", {})
    if not isinstance(files, dict) or not isinstance(files.get("events"), str):
        raise ConfigError(f"{path}: files.events: expected the event stream's file name")
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: config: expected an object of StalenessConfig settings")
    resolved: dict[str, Path | None] = {}
    for name in _FILES:
        value = files.get(name)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"{path}: files.{name}: expected a file name, got {value!r}")
        resolved[name] = root / value if value is not None and (root / value).is_file() else None
    events = resolved.pop("events")
    if events is None:
        raise ConfigError(f"{path}: files.events: {root / files['events']} does not exist")
    steps = data.get("steps") if type(data.get("steps")) is int else None  # (not a bool)
    return RunDirectory(root=root, config=config, events=events, steps=steps, **resolved)


def find_run(path: str | Path) -> RunDirectory | None:
    """The run directory ``path`` is, or whose event stream it is; None when it is neither."""
    target = Path(path)
    if target.is_dir():
        return _read(target) if (target / RUN_FILE).is_file() else None
    if target.is_file() and (target.parent / RUN_FILE).is_file():
        run = _read(target.parent)
        if run.events.resolve() == target.resolve():
            return run
    return None


def write_run_file(root: Path, run: str, config: StalenessConfig, files: Mapping[str, Path], **extra: Any) -> Path:
    """Write ``root/run.json`` naming ``files`` (relative to ``root`` where they are under it)."""

    def relative(file: Path) -> str:
        try:
            return str(file.resolve().relative_to(root.resolve()))
        except ValueError:
            return str(file.resolve())

    data = {
        "format": RUN_FORMAT,
        "version": 1,
        "run": run,
        "config": {f.name: getattr(config, f.name) for f in fields(StalenessConfig)},
        "files": {name: relative(file) for name, file in files.items()},
        **extra,
    }
    path = root / RUN_FILE
    write_whole(path, json.dumps(data, indent=2) + "\n")  # (stopped mid-write: never half a file)
    return path
