"""Writes a prime-rl run directory in its current layout (``/work/shared/prime-rl-traces.md``, "the fact
sheet"), from episodes built with verifiers' own classes: what the reader of that layout is tested on.

Everything lands under ``<root>/monitors/file/`` as prime-rl's ``FileMonitor`` and ``ChunkedJsonl`` write it
(fact sheet §1-§8):

- ``traces/stream/NNNNN.jsonl`` (one ``Episode.to_record(float_decimals)`` a line, orjson), rolling to the next
  chunk when ``size + len(line) > chunk_bytes``; a finished chunk is sealed as ``NNNNN.jsonl.zst``: pyzstd's
  ``SeekableZstdFile`` (the seekable format prime-rl uses), level 3, frames of at most ``frame_bytes``
  decompressed, written as ``.zst.tmp``, renamed, then the plain file deleted;
- ``traces/stream.index.jsonl``: one ``index_row`` per episode (``line`` numbered from 1 across relaunches,
  ``chunk``, ``offset`` = byte offset in the plain chunk);
- ``traces/annotations/<producer>/NNNNN.jsonl[.zst]`` and ``traces/annotations/<producer>.index.jsonl``:
  update records ``{"version": 1, "trace_id", "info", "branches": [{"index", <stream>: [...]}]}`` and their
  ``{trace_id, chunk, offset, info}`` rows; ``orch`` writes ship updates (§7), ``trainer`` one update per
  trained sample (§8);
- ``metrics.jsonl``: stdlib ``json.dumps`` rows ``{"step", "time", ..., "producer"}``.

``layout="single"`` writes the earlier single-file layout instead: ``traces/stream.jsonl``,
``traces/annotations/<producer>.jsonl``, index rows without ``chunk`` (and a ``stream.lock``).

API::

    writer = PrimeRunWriter(root, chunk_bytes=64 << 10, compress=True, frame_bytes=16 << 10)
    writer.log_episodes(episodes, step, kind="train")  # stamps info.kind/dispatch/arrival, appends records
    writer.ship(episodes, step)                      # orch updates (info.effective, info.ship, advantages)
    writer.train(episodes, step, logprob=fn)         # trainer updates: trainer_logprobs, entropies, is_masked
    writer.log_metrics({...}, step, producer="orch")   # a metrics.jsonl row
    writer.tear()                                    # a torn last line in the live stream chunk
    writer.close()                                   # finalize: seal the live chunks (a clean end)
    writer.abandon()                                 # a crash: live chunks stay plain
    PrimeRunWriter(root, ...)                        # a relaunch: appends, line numbering continues

Helpers the tests and the simulation share: :func:`make_trace` / :func:`make_episode` (verifiers objects from
plain lists), :func:`loss_masks` (prime-rl's sample masks: a sampled node shared with an earlier branch
trains only in the first), :func:`episode_staleness` and :func:`off_policy_metrics` (the orchestrator's
``off_policy/*``), :func:`mismatch_kl_metrics` (the trainer's ``mismatch_kl/*``).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

import orjson
import pyzstd
import verifiers.v1 as vf
from verifiers.v1.configs.agent import AgentConfig
from verifiers.v1.episode import EnvInfo, EvalWorkInfo, GroupInfo, PolicySpan, TrainRunInfo, TrainWorkInfo
from verifiers.v1.task import WireTaskData
from verifiers.v1.trace import AgentInfo, ModelCall, Reward, Timing, TraceTask
from verifiers.v1.types import Usage

__all__ = [
    "NodeSpec",
    "PrimeRunWriter",
    "branch_paths",
    "episode_staleness",
    "index_row",
    "loss_masks",
    "make_episode",
    "make_trace",
    "mismatch_kl_metrics",
    "off_policy_metrics",
]

LEVEL = 3  # prime-rl's chunks.py
FRAME_BYTES = 4 << 20
OPTS = orjson.OPT_APPEND_NEWLINE | orjson.OPT_SERIALIZE_NUMPY
TRUNCATING_STOPS = frozenset(
    {"max_turns", "max_input_tokens", "max_output_tokens", "max_total_tokens", "compaction_failed"}
)
Layout = Literal["chunked", "single"]


# ---------------------------------------------------------------------------------------------- streams
def seal(path: Path, frame_bytes: int = FRAME_BYTES) -> None:
    """prime-rl's ``seal``: compress a finished chunk beside itself, then drop the plain file."""
    target = path.with_name(path.name + ".zst")
    partial = target.with_name(target.name + ".tmp")
    with (
        open(path, "rb") as src,
        pyzstd.SeekableZstdFile(partial, "wb", level_or_option=LEVEL, max_frame_content_size=frame_bytes) as dst,
    ):
        shutil.copyfileobj(src, dst, 1 << 20)
    partial.replace(target)
    path.unlink()


def chunk_numbers(directory: Path) -> dict[int, bool]:
    """Chunk number -> whether its plain file is present."""
    numbers: dict[int, bool] = {}
    for path in directory.glob("*.jsonl*"):
        if path.name.endswith(".tmp"):
            continue
        number = int(path.name.split(".", 1)[0])
        numbers[number] = numbers.get(number, False) or path.suffix == ".jsonl"
    return numbers


class ChunkedStream:
    """prime-rl's ``ChunkedJsonl`` (sealing synchronously, so a test sees the files settled)."""

    def __init__(self, directory: Path, max_bytes: int, compress: bool, frame_bytes: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.max_bytes, self.compress, self.frame_bytes = directory, max_bytes, compress, frame_bytes
        numbers = chunk_numbers(directory)
        last = max(numbers, default=-1)
        # A relaunch appends to the live chunk it finds and starts a new one after a sealed last chunk.
        self.number = last if numbers.get(last) else last + 1
        for number, plain in numbers.items():
            if plain and number != self.number and compress:
                seal(self.path(number), frame_bytes)
        self.file: BinaryIO = open(self.path(self.number), "ab")  # noqa: SIM115
        self.size = self.file.tell()

    def path(self, number: int) -> Path:
        return self.directory / f"{number:05d}.jsonl"

    def append(self, line: bytes) -> tuple[int | None, int]:
        if self.size and self.size + len(line) > self.max_bytes:
            self.file.close()
            if self.compress:
                seal(self.path(self.number), self.frame_bytes)
            self.number += 1
            self.file = open(self.path(self.number), "ab")  # noqa: SIM115
            self.size = 0
        offset = self.size
        self.file.write(line)
        self.size += len(line)
        return self.number, offset

    def write_raw(self, data: bytes) -> None:
        self.file.write(data)
        self.size += len(data)
        self.file.flush()

    def flush(self) -> None:
        self.file.flush()

    def close(self, *, finalize: bool) -> None:
        self.file.close()
        if not finalize:
            return
        if not self.size:
            self.path(self.number).unlink()
        elif self.compress:
            seal(self.path(self.number), self.frame_bytes)


class SingleStream:
    """The earlier single-file layout: ``<name>.jsonl``, offsets in it, no chunk number."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file: BinaryIO = open(path, "ab")  # noqa: SIM115
        self.size = self.file.tell()

    def append(self, line: bytes) -> tuple[int | None, int]:
        offset = self.size
        self.file.write(line)
        self.size += len(line)
        return None, offset

    def write_raw(self, data: bytes) -> None:
        self.file.write(data)
        self.size += len(data)
        self.file.flush()

    def flush(self) -> None:
        self.file.flush()

    def close(self, *, finalize: bool) -> None:
        self.file.close()


# ---------------------------------------------------------------------------------------------- index rows
def _walk_timing(obj: Mapping[str, Any], prefix: str, out: dict[str, float]) -> None:
    if isinstance(obj.get("duration"), int | float):
        out[prefix] = out.get(prefix, 0.0) + obj["duration"]
    elif isinstance(obj.get("start"), int | float) and isinstance(obj.get("end"), int | float):
        out[prefix] = out.get(prefix, 0.0) + (obj["end"] - obj["start"])
    for key, value in obj.items():
        if isinstance(value, dict):
            _walk_timing(value, f"{prefix}/{key}" if prefix else key, out)


def _episode_kind(record: Mapping[str, Any]) -> str:
    for trace in record.get("traces") or []:
        if (kind := (trace.get("info") or {}).get("kind")) in ("train", "eval"):
            return str(kind)
    run = record.get("run") or {}
    return str((run.get("work") or {}).get("type") or run.get("type") or "eval")


def _truncated(trace: Mapping[str, Any]) -> bool:
    if trace.get("stop_condition") in TRUNCATING_STOPS:
        return True
    last = next((call for call in reversed(trace.get("calls") or []) if call.get("error") is None), None)
    return bool(last and last.get("finish_reason") == "length")


def index_row(line: int, record: Mapping[str, Any], chunk: int | None, offset: int) -> dict[str, Any]:
    """prime-rl's ``index_row`` (``summarize_episode`` without the nested maps, plus ``chunk``); no ``chunk``
    key in the single-file layout."""
    rewards: list[float] = []
    advantages: list[float] = []
    costs: list[float] = []
    timing: dict[str, float] = {}
    turns = branches = 0
    stop_condition = None
    truncated = False
    for trace in record.get("traces") or []:
        for call in trace.get("calls") or []:
            usage = call.get("usage") or {}
            if isinstance(usage, dict) and isinstance(usage.get("cost"), int | float):
                costs.append(usage["cost"])
        nodes = trace.get("nodes") or []
        parents = {node.get("parent") for node in nodes if "parent" in node}
        branches += max(0, len(nodes) - len(parents))
        if trace.get("rewards"):
            rewards.append(
                sum(
                    (r.get("score") or 0) * (r.get("weight") if r.get("weight") is not None else 1)
                    for r in trace["rewards"].values()
                    if isinstance(r, dict)
                )
            )
        if isinstance(trace.get("timing"), dict):
            _walk_timing(trace["timing"], "", timing)
        advantage = (trace.get("info") or {}).get("advantage")
        if advantage is not None:
            advantages.append(advantage)
        turns += sum(1 for node in nodes if (node.get("message") or {}).get("role") == "assistant")
        stop_condition = trace.get("stop_condition", stop_condition)
        truncated = truncated or _truncated(trace)
    first_info = ((record.get("traces") or [{}])[0].get("info")) or {}
    dispatched = (first_info.get("dispatch") or {}).get("time")
    arrived = (first_info.get("arrival") or {}).get("time")
    if isinstance(dispatched, int | float) and isinstance(arrived, int | float):
        duration: float | None = max(0.0, arrived - dispatched)
    else:
        phases = [value for key, value in timing.items() if "/" not in key]
        duration = sum(phases) if phases else None
    env = record.get("env") or {}
    row = {
        "cost": sum(costs) if costs else None,
        "line": line,
        "offset": offset,
        "id": record.get("id"),
        "kind": _episode_kind(record),
        "trace_ids": [trace_id for trace in record.get("traces") or [] if (trace_id := trace.get("id"))],
        "env": env.get("name") or env.get("id"),
        "group": (record.get("group") or {}).get("id"),
        "ok": record.get("ok"),
        "num_errors": len(record.get("errors") or []),
        "reward": sum(rewards) / len(rewards) if rewards else None,
        "advantage": sum(advantages) / len(advantages) if advantages else None,
        "input_tokens": record.get("num_input_tokens"),
        "output_tokens": record.get("num_output_tokens"),
        "turns": turns,
        "branches": branches,
        "stop_condition": stop_condition,
        "truncated": truncated,
        "dispatch": dispatched,
        "arrival": arrived,
        "duration": duration,
    }
    if chunk is not None:
        row["chunk"] = chunk
    return row


# ---------------------------------------------------------------------------------------------- episodes
@dataclass(frozen=True)
class NodeSpec:
    """One message node: ``prompt`` tokens (not sampled) then ``logprobs`` sampled tokens (an assistant
    node when it has any). ``parent`` is a node index (None = a root)."""

    parent: int | None
    prompt: int
    logprobs: tuple[float, ...] = ()


def make_trace(
    trace_id: str,
    nodes: Sequence[NodeSpec],
    *,
    reward: float = 0.0,
    start_time: float = 1.7e9,
    token_base: int = 100,
    stop_condition: str | None = None,
    errored: bool = False,
    trainable: bool = True,
) -> vf.Trace:
    """A verifiers ``Trace`` whose message graph has the given nodes (token ids are made up)."""
    task = TraceTask[WireTaskData](type="Task", data=WireTaskData.model_validate({"prompt": trace_id}))
    built: list[vf.MessageNode] = []
    calls: list[ModelCall] = []
    token = token_base
    for index, spec in enumerate(nodes):
        count = spec.prompt + len(spec.logprobs)
        sampled = bool(spec.logprobs)
        built.append(
            vf.MessageNode(
                parent=spec.parent,
                message={"role": "assistant" if sampled else "user", "content": f"m{index}"},
                sampled=sampled,
                timestamp=start_time + index,
                token_ids=list(range(token, token + count)),
                mask=[False] * spec.prompt + [True] * len(spec.logprobs),
                logprobs=list(spec.logprobs),
            )
        )
        token += count
        if sampled:
            usage = Usage(prompt_tokens=spec.prompt, completion_tokens=len(spec.logprobs))
            calls.append(ModelCall(node=index, usage=usage, finish_reason="stop"))
    trace = vf.Trace(
        id=trace_id,
        task=task,
        agent=AgentInfo(config=AgentConfig(), trainable=trainable),
        nodes=built,
        calls=calls,
        rewards={"correct": Reward(score=reward)},
        timing=Timing(start=start_time),
        is_completed=not errored,
        ok=not errored,
        stop_condition=stop_condition or ("error" if errored else "done"),
    )
    if errored:
        trace.errors.append(vf.Error(type="RuntimeError", message="the sandbox died"))
    return trace


def make_episode(
    episode_id: str,
    traces: Sequence[vf.Trace],
    *,
    env: str,
    step: int,
    policy: tuple[int, int] | None,
    group: str | None = None,
    kind: Literal["train", "eval"] = "train",
    run_id: str = "run-1",
) -> vf.Episode:
    """A verifiers ``Episode`` with ``run.work`` = ``TrainWorkInfo`` (or ``EvalWorkInfo``); ``policy`` None =
    a frozen-model episode."""
    span = None if policy is None else PolicySpan(start=policy[0], end=policy[1])
    work = TrainWorkInfo(step=step, policy=span) if kind == "train" else EvalWorkInfo(step=step, policy=span)
    ok = all(trace.ok for trace in traces) and bool(traces)
    episode = vf.Episode(
        id=episode_id,
        env=EnvInfo(id=f"{env}-v1", name=env),
        task=traces[0].task if traces else TraceTask[WireTaskData](type="Task", data=WireTaskData()),
        group=None if group is None else GroupInfo(id=group),
        run=TrainRunInfo(id=run_id, name="sim", work=work),
        ok=ok,
        traces=list(traces),
    )
    if not ok:
        episode.errors.append(vf.Error(type="RuntimeError", message="the sandbox died"))
    return episode


def branch_paths(trace: vf.Trace) -> list[list[int]]:
    """Root-to-leaf node indexes per branch, in leaf order (verifiers' ``Trace.branches``)."""
    paths = []
    for branch_leaf in (i for i in range(len(trace.nodes)) if i not in {n.parent for n in trace.nodes}):
        path: list[int] = []
        node: int | None = branch_leaf
        while node is not None:
            path.append(node)
            node = trace.nodes[node].parent
        paths.append(path[::-1])
    return paths


def loss_masks(trace: vf.Trace) -> dict[int, list[bool]]:
    """Per trainable branch, prime-rl's sample mask over the branch's tokens: the nodes' ``mask``, except
    that a sampled node shared with an earlier branch trains only in the first (``iter_trainable_branches``)."""
    seen: set[int] = set()
    out: dict[int, list[bool]] = {}
    for branch in trace.branches:
        mask: list[bool] = []
        nodes = branch_paths(trace)[branch.index]
        for node_index in nodes:
            node = trace.nodes[node_index]
            shared = node_index in seen and any(node.mask)
            mask.extend([m and not shared for m in node.mask])
        seen.update(node_index for node_index in nodes if any(trace.nodes[node_index].mask))
        if branch.trainable and trace.agent.trainable:
            out[branch.index] = mask
    return out


# ---------------------------------------------------------------------------------------------- prime-rl's numbers
def episode_staleness(episode: vf.Episode, step: int) -> tuple[int, int, int]:
    """prime-rl's ``episode_staleness``: ``(total, in_flight, in_queue)``; (0, 0, 0) without a policy."""
    work = episode.run.work if isinstance(episode.run, TrainRunInfo) else None
    policy = work.policy if work is not None else None
    if policy is None:
        return (0, 0, 0)
    total = max(0, (step - 1) - policy.start)
    in_flight = min(total, max(0, policy.end - policy.start))
    return (total, in_flight, total - in_flight)


def off_policy_metrics(
    effective: Sequence[vf.Episode], step: int, dropped: int, prefix: str = "off_policy"
) -> dict[str, float]:
    """The orchestrator's ``off_policy/*`` of a ship (``prefix="staleness"`` for the renamed keys)."""
    metrics: dict[str, float] = {}
    staleness = [episode_staleness(episode, step) for episode in effective]
    if staleness:
        totals, in_flight, in_queue = (list(values) for values in zip(*staleness))
        metrics |= {
            f"{prefix}/mean": sum(totals) / len(totals),
            f"{prefix}/max": float(max(totals)),
            f"{prefix}/in_flight/mean": sum(in_flight) / len(in_flight),
            f"{prefix}/in_flight/max": float(max(in_flight)),
            f"{prefix}/in_queue/mean": sum(in_queue) / len(in_queue),
            f"{prefix}/in_queue/max": float(max(in_queue)),
        }
    metrics[f"{prefix}/dropped"] = float(dropped)
    return metrics


def _stats(values: Sequence[float]) -> dict[str, float]:
    """prime-rl's ``Tensors.compute_stats`` over the concatenated per-token values: torch's ``median`` (the
    lower middle value) and ``std`` (unbiased)."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else math.nan
    ordered = sorted(values)
    return {"mean": mean, "median": ordered[(n - 1) // 2], "std": std, "min": ordered[0], "max": ordered[-1]}


def mismatch_kl_metrics(per_env: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """The trainer's ``mismatch_kl/{all,<env>}/{mean,median,std,min,max}`` from per-token k3 values by env
    (per token, over every trained sample's loss-mask positions, frozen samples included); a non-finite
    value is left out of the row, as prime-rl's ``sanitize`` does."""
    metrics: dict[str, float] = {}
    everything = [v for values in per_env.values() for v in values]
    if not everything:
        return metrics
    for name, values in [("all", everything), *sorted(per_env.items())]:
        if values:
            stats = _stats(values).items()
            metrics |= {f"mismatch_kl/{name}/{stat}": value for stat, value in stats if math.isfinite(value)}
    return metrics


# ---------------------------------------------------------------------------------------------- the writer
LogprobModel = Callable[[vf.Episode, vf.Trace, int, int, float], float]
"""``(episode, trace, branch_index, position, sampler_logprob) -> trainer logprob`` (full precision)."""


@dataclass
class TrainedStep:
    """What :meth:`PrimeRunWriter.train` wrote for a step: the updates and the per-token k3 by env."""

    updates: list[dict[str, Any]] = field(default_factory=list)
    k3_by_env: dict[str, list[float]] = field(default_factory=dict)
    is_masked: list[bool] = field(default_factory=list)


class PrimeRunWriter:
    """A prime-rl run directory being written; every producer's streams in one object (see the module docs)."""

    def __init__(
        self,
        root: str | Path,
        *,
        chunk_bytes: int = 5 << 30,
        compress: bool = True,
        frame_bytes: int = FRAME_BYTES,
        float_decimals: int | None = 4,
        layout: Layout = "chunked",
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.root = Path(root)
        self.dir = self.root / "monitors" / "file"
        self.traces = self.dir / "traces"
        self.chunk_bytes, self.compress, self.frame_bytes = chunk_bytes, compress, frame_bytes
        self.float_decimals = float_decimals
        self.layout: Layout = layout
        self._now = 1.7e9
        self.clock = clock or self._tick
        self.traces.mkdir(parents=True, exist_ok=True)
        index = self.traces / "stream.index.jsonl"
        # A relaunch appends to the stream it finds, so the numbering carries on.
        self.logged = sum(1 for _ in index.open("rb")) if index.is_file() else 0
        self.metrics = open(self.dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        self._streams: dict[str, tuple[ChunkedStream | SingleStream, BinaryIO]] = {}
        # Per-node ``weight_versions`` by episode id, ``{(trace, node): [[version, k], ...]}`` with ``k`` an
        # index into the node's sampled tokens: added to the record, since verifiers 0.4.0 has no such field.
        self.labels: dict[str, dict[tuple[int, int], list[tuple[int, int]]]] = {}
        if layout == "single":
            (self.traces / "stream.lock").touch()

    def _tick(self) -> float:
        self._now += 0.5
        return self._now

    # ------------------------------------------------------------------ files
    def _stream(self, name: str) -> tuple[ChunkedStream | SingleStream, BinaryIO]:
        """``"stream"`` or an annotation producer: the stream and its index, opened on first use."""
        if name not in self._streams:
            base = self.traces / "stream" if name == "stream" else self.traces / "annotations" / name
            stream: ChunkedStream | SingleStream
            if self.layout == "chunked":
                stream = ChunkedStream(base, self.chunk_bytes, self.compress, self.frame_bytes)
            else:
                stream = SingleStream(base.with_name(base.name + ".jsonl"))
            index_path = base.with_name(base.name + ".index.jsonl")
            self._streams[name] = (stream, open(index_path, "ab"))  # noqa: SIM115
        return self._streams[name]

    def record(self, episode: vf.Episode) -> dict[str, Any]:
        """The episode's line as the file monitor serialises it (plus any per-node ``weight_versions``)."""
        record = episode.to_record(float_decimals=self.float_decimals)
        labels = self.labels.get(episode.id, {})
        for (trace_index, node_index), spans in labels.items():
            record["traces"][trace_index]["nodes"][node_index]["weight_versions"] = [list(s) for s in spans]
        return record

    # ------------------------------------------------------------------ orchestrator
    def log_episodes(self, episodes: Iterable[vf.Episode], step: int, kind: str = "train") -> list[dict[str, Any]]:
        """``stamp_arrival`` then ``FileMonitor.log_episodes(subset="all")``: returns the records written."""
        now = self.clock()
        stream, index = self._stream("stream")
        records = []
        for episode in episodes:
            work = getattr(episode.run, "work", None)
            for trace in episode.traces:
                trace.info["kind"] = kind
                if work is not None:
                    trace.info["dispatch"] = {"step": work.step, "time": trace.timing.start}
                trace.info["arrival"] = {"step": step, "time": now}
            record = self.record(episode)
            chunk, offset = stream.append(orjson.dumps(record, default=str, option=OPTS))
            self.logged += 1
            index.write(orjson.dumps(index_row(self.logged, record, chunk, offset), default=str, option=OPTS))
            records.append(record)
        stream.flush()
        index.flush()
        return records

    def log_annotations(self, producer: str, updates: Sequence[Mapping[str, Any]]) -> None:
        """``FileMonitor.log_annotations`` of one producer."""
        if not updates:
            return
        stream, index = self._stream(producer)
        for update in updates:
            chunk, offset = stream.append(orjson.dumps(update, option=OPTS))
            row: dict[str, Any] = {"trace_id": update.get("trace_id"), "chunk": chunk, "offset": offset,
                                   "info": update.get("info") or {}}  # fmt: skip
            if chunk is None:
                del row["chunk"]
            index.write(orjson.dumps(row, option=OPTS))
        stream.flush()
        index.flush()

    def ship(self, episodes: Iterable[vf.Episode], step: int) -> list[dict[str, Any]]:
        """``stamp_ship``: one orch update per trace of every shipped episode (the branch advantages spread
        over the branch's tokens, 0.0 at non-sampled positions)."""
        now = self.clock()
        updates = []
        for episode in episodes:
            for trace in episode.traces:
                info: dict[str, Any] = {"effective": True, "ship": {"step": step, "time": now}}
                if (advantage := trace.info.get("advantage")) is not None:
                    info["advantage"] = advantage
                branches = [
                    {"index": branch.index, "advantages": advantages}
                    for branch in trace.branches
                    if (advantages := branch.advantages) is not None
                ]
                updates.append({"version": 1, "trace_id": trace.id, "info": info, "branches": branches})
        self.log_annotations("orch", updates)
        return updates

    # ------------------------------------------------------------------ trainer
    def train(
        self,
        episodes: Iterable[vf.Episode],
        step: int,
        *,
        logprob: LogprobModel,
        truncate: Mapping[tuple[str, int], int] | None = None,
        eps: float = 0.1,
    ) -> TrainedStep:
        """The trainer's ``AnnotationWriter`` for the samples of one step: per trainable branch, full-length
        ``trainer_logprobs`` / ``entropies`` / ``is_masked`` streams, null outside the loss mask and at
        position 0, rounded to ``float_decimals``; ``truncate[(trace_id, branch)]`` cuts a sample (and its
        streams) to that many tokens. Also the step's per-token k3 (full precision, as the trainer's
        ``mismatch_kl``) by env."""
        out = TrainedStep()
        for episode in episodes:
            env = episode.env.name or episode.env.id
            for trace in episode.traces:
                for branch_index, mask in loss_masks(trace).items():
                    update = self._sample_update(episode, trace, branch_index, mask, logprob, truncate, eps, out, env)
                    if update is not None:
                        out.updates.append(update)
        self.log_annotations("trainer", out.updates)
        return out

    def _sample_update(
        self,
        episode: vf.Episode,
        trace: vf.Trace,
        branch_index: int,
        mask: list[bool],
        logprob: LogprobModel,
        truncate: Mapping[tuple[str, int], int] | None,
        eps: float,
        out: TrainedStep,
        env: str,
    ) -> dict[str, Any] | None:
        branch = trace.branches[branch_index]
        sampler = branch.logprobs  # full precision, 0.0 at non-sampled positions
        length = len(mask) if truncate is None else min(len(mask), truncate.get((trace.id, branch_index), len(mask)))
        trained = mask[:length]
        if not any(trained[1:]):
            return None
        lps: list[float | None] = []
        entropies: list[float | None] = []
        masked: list[bool | None] = []
        for position, keep in enumerate(trained):
            if not keep or position == 0:
                lps.append(None)
                entropies.append(None)
                masked.append(None)
                continue
            value = logprob(episode, trace, branch_index, position, sampler[position])
            d = value - sampler[position]
            out.k3_by_env.setdefault(env, []).append(math.exp(d) - 1 - d)
            decision = abs(math.exp(value) - math.exp(sampler[position])) > eps
            out.is_masked.append(decision)
            lps.append(self._round(value))
            entropies.append(self._round(0.5 + 0.25 * math.sin(position)))
            masked.append(decision)
        streams = {"trainer_logprobs": lps, "entropies": entropies, "is_masked": masked}
        return {"version": 1, "trace_id": trace.id, "info": {}, "branches": [{"index": branch_index, **streams}]}

    def _round(self, value: float) -> float | None:
        if not math.isfinite(value):
            return None
        return value if self.float_decimals is None else round(value, self.float_decimals)

    # ------------------------------------------------------------------ metrics, ends
    def log_metrics(self, metrics: Mapping[str, Any], step: int | None, producer: str | None) -> None:
        row = {"step": step, "time": self.clock(), **metrics}
        if producer is not None:
            row["producer"] = producer
        self.metrics.write(json.dumps(row) + "\n")

    def tear(self, name: str = "stream") -> None:
        """The process died mid-append: half a line at the end of the live chunk, and no index row."""
        stream, _ = self._stream(name)
        line = orjson.dumps({"id": "torn", "traces": [{"id": "torn-trace", "nodes": []}]})
        stream.write_raw(line[: len(line) // 2])

    def close(self) -> None:
        """A clean ``finalize``: every live chunk sealed (an empty one deleted)."""
        self._close(finalize=True)

    def abandon(self) -> None:
        """A crash (or a run still being written): the files stay as they are, live chunks plain."""
        self._close(finalize=False)

    def _close(self, *, finalize: bool) -> None:
        for stream, index in self._streams.values():
            stream.close(finalize=finalize)
            index.close()
        self._streams.clear()
        self.metrics.close()
