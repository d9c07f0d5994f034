"""One prime-rl episode record (a dict or :mod:`.lazy` proxies) -> one SPEC 3 rollout per trace, one
sample per trainable branch (``docs/trainers/prime-rl.md``, "How a run is read")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from ....errors import TraceError
from ....records.model import ParsedRollout, ParsedSample, UnparsedRollout, check_head
from . import lazy

Problem = tuple[str, int, str]  # (file, line, reason) of an update that does not fit its trace


class NotAnEpisode(ValueError):
    """A stream line that is not an episode record (why, in the message)."""


@dataclass(frozen=True)
class Stream:
    """A per-position stream of one update (NaN = null), and where it was read."""

    values: npt.NDArray[np.float64]
    path: str  # where the update was read
    line: int


@dataclass(frozen=True)
class TraceHead:
    id: str
    ok: bool
    arrival_step: int | None
    doc: Any  # the trace object (a proxy: valid until the next line is parsed)


@dataclass(frozen=True)
class EpisodeHead:
    """What every decision about an episode needs, read before any token."""

    id: str
    kind: str
    ok: bool
    group: str | None
    env: str | None
    policy: tuple[object, object] | None  # (start, end) as recorded; None: frozen-model work
    traces: list[TraceHead] = field(default_factory=list)


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _errored(doc: object) -> bool:
    errors = lazy.get(doc, "errors")
    return lazy.get(doc, "ok") is False or (lazy.is_array(errors) and lazy.length(errors) > 0)


def episode_head(doc: object) -> EpisodeHead:
    """The head of an episode record; :class:`NotAnEpisode` when the line is not one."""
    if not lazy.is_object(doc):
        raise NotAnEpisode(f"expected an episode object, got {type(lazy.to_python(doc)).__name__}")
    episode_id = _text(lazy.get(doc, "id"))
    traces = lazy.get(doc, "traces")
    if episode_id is None or not lazy.is_array(traces):
        raise NotAnEpisode("not an episode record (expected a string 'id' and a 'traces' list)")
    work = lazy.get(run := lazy.get(doc, "run"), "work")
    heads = []
    for i, trace in enumerate(traces):
        trace_id = _text(lazy.get(trace, "id"))
        if trace_id is None:
            raise NotAnEpisode(f"episode {episode_id!r}: traces[{i}] has no string 'id'")
        arrival = _int(lazy.get(lazy.get(lazy.get(trace, "info"), "arrival"), "step"))
        heads.append(TraceHead(trace_id, not _errored(trace), arrival, trace))
    first_info = lazy.get(traces[0], "info") if heads else None
    kind = _text(lazy.get(first_info, "kind")) or _text(lazy.get(work, "type")) or _text(lazy.get(run, "type"))
    policy, env = lazy.get(work, "policy"), lazy.get(doc, "env")
    span = None if policy is None else (lazy.get(policy, "start"), lazy.get(policy, "end"))
    return EpisodeHead(id=episode_id, kind=kind or "eval", ok=not _errored(doc),
                       group=_text(lazy.get(lazy.get(doc, "group"), "id")),
                       env=_text(lazy.get(env, "name")) or _text(lazy.get(env, "id")),
                       policy=span, traces=heads)  # fmt: skip


_POLICY_FIELDS = {"dispatch_version": "run.work.policy.start", "completion_version": "run.work.policy.end"}


def _head(episode: EpisodeHead, trace: TraceHead) -> ParsedRollout:
    """The rollout's fields but its samples, checked as any record's, named by the record's."""
    head: dict[str, Any] = {"id": trace.id}
    if episode.group is not None:
        head["group_id"] = episode.group
    if episode.env is not None:
        head["env"] = episode.env
    if episode.policy is None:
        head["source"] = "frozen"
    else:
        start, end = episode.policy
        head["dispatch_version"] = lazy.to_python(start)
        if end is not None:
            head["completion_version"] = lazy.to_python(end)
    try:
        return check_head(head)
    except TraceError as error:
        raise TraceError(error.rollout_id, _POLICY_FIELDS.get(error.field, error.field), error.reason) from None


@dataclass
class _Node:
    parent: int | None
    mask: npt.NDArray[np.bool_]
    logprobs: npt.NDArray[np.float64] | None  # compact; None: the node's sampled tokens have none
    trainer: npt.NDArray[np.float64] | None  # compact, NaN = null
    versions: npt.NDArray[np.int64] | None  # compact, -1 = unlabelled
    compaction_attempt: bool
    resumes: list[int]  # nodes this one names as compaction parents

    @property
    def sampled(self) -> int:
        return int(np.count_nonzero(self.mask))


def _compact_floats(rid: str, where: str, value: object, count: int) -> npt.NDArray[np.float64]:
    """A node's log-probabilities: a null (read as NaN) or non-finite value is uncovered (SPEC 11)."""
    try:
        values = lazy.as_floats(value, nulls=True)
    except TypeError as error:
        raise TraceError(rid, where, f"expected a list of numbers or nulls ({error})") from None
    if len(values) != count:
        raise TraceError(rid, where, f"{len(values)} values for the node's {count} sampled tokens")
    return values


def _pair_fault(pair: object, count: int, previous: int | None) -> str | None:
    """Why one ``[version, k]`` of ``weight_versions`` is wrong (None: it is right)."""
    if not (isinstance(pair, list) and len(pair) == 2 and all(_int(v) is not None for v in pair)):
        return f"expected a [version, k] pair of integers, got {pair!r}"
    version, start = pair
    if version < -1:
        return f"version must be >= 0 (or -1), got {version}"
    if not 0 <= start < count:
        return f"k must be in 0..{count - 1} (the node's sampled tokens), got {start}"
    return "starts must strictly increase" if previous is not None and start <= previous else None


def _versions(rid: str, where: str, doc: object, count: int) -> npt.NDArray[np.int64] | None:
    spans, tokens = lazy.get(doc, "weight_versions"), lazy.get(doc, "token_versions")
    if spans is not None and tokens is not None:
        both = "both weight_versions and token_versions are given"
        raise TraceError(rid, f"{where}.token_versions", both)
    if tokens is not None:
        where = f"{where}.token_versions"
        try:
            versions = lazy.as_ints(tokens)
        except TypeError as error:
            raise TraceError(rid, where, f"expected a list of integers ({error})") from None
        if len(versions) != count:
            raise TraceError(rid, where, f"{len(versions)} values for {count} sampled tokens")
        if versions.size and int(versions.min()) < -1:
            raise TraceError(rid, where, "versions must be >= 0 (or -1: unlabelled)")
        return versions.astype(np.int64, copy=True)
    if spans is None:
        return None
    pairs, out = lazy.to_python(spans), np.full(count, -1, dtype=np.int64)
    if not isinstance(pairs, list):
        raise TraceError(rid, f"{where}.weight_versions", "expected a list of [version, k] pairs")
    starts: list[int] = []
    for i, pair in enumerate(pairs):
        if (fault := _pair_fault(pair, count, starts[-1] if starts else None)) is not None:
            raise TraceError(rid, f"{where}.weight_versions[{i}]", fault)
        starts.append(pair[1])
    for (version, start), stop in zip(pairs, [*starts[1:], count], strict=True):
        out[start:stop] = version
    return out


def _node(rid: str, index: int, doc: object, count: int) -> _Node:
    where = f"nodes[{index}]"
    if not lazy.is_object(doc):
        raise TraceError(rid, where, "expected an object")
    parent = lazy.get(doc, "parent")
    if parent is not None and (_int(parent) is None or not 0 <= parent < count or parent == index):
        raise TraceError(rid, f"{where}.parent", f"expected the index of another node, got {lazy.to_python(parent)!r}")
    tokens, mask_doc = lazy.get(doc, "token_ids"), lazy.get(doc, "mask")
    size = lazy.length(tokens) if lazy.is_array(tokens) else 0
    try:
        mask = lazy.as_bools(mask_doc) if mask_doc is not None else np.zeros(0, dtype=bool)
    except TypeError as error:
        raise TraceError(rid, f"{where}.mask", f"expected a list of booleans ({error})") from None
    if len(mask) == 0 and size:
        mask = np.zeros(size, dtype=bool)  # a node without a mask samples nothing
    elif len(mask) != size:
        raise TraceError(rid, f"{where}.mask", f"{len(mask)} entries for {size} token_ids")
    sampled = int(np.count_nonzero(mask))
    logprobs_doc, logprobs = lazy.get(doc, "logprobs"), None
    if sampled and logprobs_doc is not None and lazy.length(logprobs_doc):
        logprobs = _compact_floats(rid, f"{where}.logprobs", logprobs_doc, sampled)
    trainer_doc, trainer = lazy.get(doc, "trainer_logprobs"), None
    if sampled and trainer_doc is not None:
        trainer = _compact_floats(rid, f"{where}.trainer_logprobs", trainer_doc, sampled)
    links: Any = lazy.get(doc, "semantic_parents")
    attempt, resumes = False, []
    if lazy.is_array(links):
        for link in links:
            kind, target = lazy.get(link, "type"), _int(lazy.get(link, "node"))
            attempt = attempt or kind == "compaction_attempt"
            if kind == "compaction" and target is not None:
                resumes.append(target)
    versions = _versions(rid, where, doc, sampled) if sampled else None
    return _Node(parent, mask, logprobs, trainer, versions, attempt, resumes)


def _branches(rid: str, nodes: list[_Node]) -> list[tuple[int, list[int], bool]]:
    """``(index, path, trainable)`` per leaf in node-index order (verifiers' ``Trace.branches``)."""
    parents = {node.parent for node in nodes if node.parent is not None}
    accepted = {target for node in nodes for target in node.resumes}
    out: list[tuple[int, list[int], bool]] = []
    for ordinal, leaf in enumerate(i for i in range(len(nodes)) if i not in parents):
        path: list[int] = []
        current: int | None = leaf
        seen: set[int] = set()
        while current is not None:
            if current in seen:
                raise TraceError(rid, f"nodes[{current}].parent", "the parents form a loop")
            seen.add(current)
            path.append(current)
            current = nodes[current].parent
        path.reverse()
        out.append((ordinal, path, not nodes[leaf].compaction_attempt or leaf in accepted))
    return out


def fold_streams(
    size: int, base: npt.NDArray[np.float64] | None, streams: Sequence[Stream]
) -> npt.NDArray[np.float64] | None:
    """A branch's per-position values: ``base`` (the record's own, NaN = none), then each stream in
    write order, where a value replaces what was there and a null (NaN) leaves it; a short stream
    covers the positions it holds. None when nothing covers any position."""
    if base is None and not streams:
        return None
    out = base.copy() if base is not None else np.full(size, np.nan)
    for stream in streams:
        values = stream.values[:size]
        known = ~np.isnan(values)
        out[: len(values)][known] = values[known]
    return out if not np.all(np.isnan(out)) else None


def _spread(nodes: list[_Node], path: list[int], name: str, fill: float) -> npt.NDArray[Any] | None:
    """A per-node field on the branch's positions (else ``fill``); None if no node has it."""
    parts, found = [], False
    for node in (nodes[i] for i in path):
        values = np.full(len(node.mask), fill, dtype=np.int64 if name == "versions" else np.float64)
        if (compact := getattr(node, name)) is not None:
            values[node.mask] = compact
            found = True
        parts.append(values)
    return np.concatenate(parts) if found else None


def _sample(nodes: list[_Node], path: list[int], claimed: set[int], streams: Sequence[Stream]) -> ParsedSample | None:
    masks = [nodes[i].mask if i not in claimed else np.zeros_like(nodes[i].mask) for i in path]
    mask = np.concatenate(masks)
    if not mask.any():
        return None
    sample = ParsedSample(mask=mask.astype(np.int8))
    bare = any(nodes[i].logprobs is None and i not in claimed and nodes[i].sampled for i in path)
    trainer = _spread(nodes, path, "trainer", np.nan)
    found = {
        "logprobs": None if bare else _spread(nodes, path, "logprobs", 0.0),
        "trainer_logprobs": fold_streams(len(mask), trainer, streams),
        "token_versions": _spread(nodes, path, "versions", -1),
    }
    for name, values in found.items():
        if values is not None:
            setattr(sample, name, values)
            sample.fresh.add(name)
    return sample


def trace_rollout(
    episode: EpisodeHead,
    trace: TraceHead,
    updates: dict[int, list[Stream]] | None = None,
    samples_of: dict[int, int] | None = None,
) -> tuple[ParsedRollout | UnparsedRollout | None, list[Problem]]:
    """The rollout of one trace (None when it trains nothing; an :class:`UnparsedRollout` the sink
    refuses) and the ``updates`` (trainer streams per branch) that do not fit it; ``samples_of``
    gets each branch's sample (its index in the rollout's samples), for a caller refolding one."""
    updates = updates or {}
    try:
        rollout = _head(episode, trace)
        nodes_doc = lazy.get(trace.doc, "nodes")
        count = lazy.length(nodes_doc) if lazy.is_array(nodes_doc) else 0
        nodes = [_node(trace.id, i, n, count) for i, n in enumerate(nodes_doc)] if count else []
        branches = _branches(trace.id, nodes)  # (parents in a loop: refused as the rest)
    except TraceError as error:
        # kept past this line: no frame of it may hold the parser's proxies (the parser is reused)
        error.__traceback__ = error.__context__ = error.__cause__ = None
        return UnparsedRollout(error, episode.env), []
    problems = [
        (s.path, s.line, f"trace {trace.id!r} has no branch {b}")
        for b, ss in updates.items()
        if not 0 <= b < len(branches)
        for s in ss
    ]
    if not nodes:  # a record without token data: one sampled, unlabelled position
        rollout.samples = [ParsedSample(mask=np.ones(1, dtype=np.int8))]
        return rollout, problems
    if lazy.get(lazy.get(trace.doc, "agent"), "trainable") is False:
        return None, problems
    samples: list[ParsedSample] = []
    claimed: set[int] = set()
    for index, path, trainable in branches:
        if not trainable:
            continue
        size = sum(len(nodes[i].mask) for i in path)
        streams = updates.get(index, [])
        for stream in (s for s in streams if len(s.values) > size):
            reason = f"trace {trace.id!r} branch {index}: {len(stream.values)} positions for a branch of {size} tokens"
            problems.append((stream.path, stream.line, reason))
        sample = _sample(nodes, path, claimed, [s for s in streams if len(s.values) <= size])
        claimed.update(i for i in path if nodes[i].sampled)
        if sample is not None:
            samples.append(sample)
            (samples_of if samples_of is not None else {})[index] = len(samples) - 1
    if not samples:
        return None, problems
    rollout.samples = samples
    if sum(1 for node in nodes if node.sampled) > 1:
        rollout.agentic = rollout.echo["agentic"] = True
    return rollout, problems
