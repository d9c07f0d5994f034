"""A literal, per-token reference implementation of SPEC.md sections 2-6 and 9 (replay).

Written from SPEC.md alone, without reading the engine, so that ``staleness-metrics replay`` can be
compared with it line by line. Clarity over speed: every position is a Python int in a Python list.

Readings chosen where SPEC is silent or ambiguous (the lead compares these with the engine's):

R1  Version checks at ship time: a token label (any ``weight_versions`` span version or ``token_versions``
    entry other than -1, on any position, mask 1 or 0) or a ``dispatch_version`` above ``T`` is invalid when
    a ship takes the rollout. ``completion_version`` above ``T`` is valid (prime-rl's 3/5 at step 5). The
    check applies to frozen rollouts too. A strict-mode error found at ship time reports the ship's line.
R2  ``ship`` is, literally: sweep at ``step`` (which accepts versions above ``T`` and may drop or expire
    such a rollout, which is then never checked), take, check the taken rollouts (set the invalid ones aside
    in lenient mode), apply the policy to the rest. A taken rollout of a held group is checked like any
    other taken rollout.
R3  "Had something to train" is judged on the sample as it arrived; "nothing left" on its current arrays.
    A sample that had nothing to train is never dropped, so its rollout is never dropped by ``token``.
R4  ``completion_version`` defaults to the max effective version (unlabelled = dispatch) over the sampled
    positions of all samples as added; the dispatch version when there are none.
R5  ``dropped_samples`` (and ``staleness/sample/dropped``) include every not-yet-dropped sample of a dropped
    rollout, so the count always equals the length of the list.
R6  ``staleness/rollout/held`` and ``held`` count each rollout the ship would have taken (all queued ones
    when ``ids`` is None, else the named queued ones) that belongs to a held group, frozen members
    included, once per ship. Sweeps never count holds.
R7  xtuner retry: each group owes one new rollout per expired member; a rollout added with that
    ``group_id`` while the group owes pays one back (rollouts added before the expiry pay nothing). The group
    is held while it owes anything. A rollout without ``group_id`` is its own group (keyed by its id).
R8  xtuner "its own mask is not all zero" reads the mask as it arrived (identical to "has sampled
    positions"; a sample whose sampled positions all got masked expired at that moment anyway).
R9  ``group``/``xtuner`` judge, at a sweep, every group that has a queued rollout not yet judged at this
    step, over all its queued members. A group dropped earlier does not doom members added later.
R10 Sequence staleness (xtuner) = ``T - min(v)`` over labelled positions (mask 1 or 0) and sampled positions
    (unlabelled ones take the dispatch version); 0 when the set is empty.
R11 ``--env-breakdown``: for each env (rollouts without ``env`` are left out) that has a shipped rollout
    (frozen ones included), a dropped rollout or sample, a held rollout, or (lenient) a rollout set aside
    as invalid in the window (its ``env`` when that is a string): the population keys of that
    env's slice (when non-empty), its dropped and held counts and ``max_staleness`` ("the same keys"),
    under ``staleness/env/<env>/...``.
R12 Duplicate ids are checked against every rollout accepted so far in the run (shipped, dropped and
    queued ones); a rollout set aside as invalid at add time never entered the sink (its id is free and
    its ``agentic`` flag does not count), one set aside at ship time did enter it.
R13 Shipped rollouts are written as they were given, with ``samples`` reduced to the shipped ones and
    ``mask``/``rl_weights``/``ce_weights``/``ref_kl_weights`` replaced by the masked arrays (mask as 0/1),
    and a log-probability lacking a value (R16, R18) written as null.
R14 Malformed events: bad JSON, a non-object line, an unknown or missing ``type``, a rollout event whose
    ``rollout`` is not an object, a step that is not an int >= 1 or is below an earlier step, ``ids`` that
    is not a list of strings, a key an event of its type does not have (rollout: type, rollout; sweep: type,
    step; ship: type, step, ids), as a record's unknown fields are (SPEC 3: nothing silently coerced). Blank
    lines are skipped (they still count for line numbers).
R15 Quantiles use exact rational ranks ``ceil(p * N)`` (p = 1/2, 9/10, 99/100), never float products.
R16 SPEC 11, read literally for both arrays: ``logprobs`` entries, like ``trainer_logprobs`` ones, are numbers
    or null; a null, NaN or ±inf is an uncovered position, never an error (strings, booleans: errors).
R17 A ship's ``"ids": null`` means all queued rollouts; an id named twice is taken once.
R18 SPEC 11: ``trainer_logprobs`` entries are numbers or null (null, NaN, ±inf: uncovered); the family is
    reported when some shipped sample of the whole batch (not per env) carries the field, and left out
    when nothing is covered. Position by position, in plain floats.
R19 SPEC 12: the length population is the shipped samples of live rollouts plus every sample the window
    dropped; a sample with no sampled position counts in the means but in no length bucket.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

POLICIES = ("token", "episode", "group", "xtuner")
QUANTILES = (("p50", Fraction(1, 2)), ("p90", Fraction(9, 10)), ("p99", Fraction(99, 100)))
WEIGHT_FIELDS = ("rl_weights", "ce_weights", "ref_kl_weights")

__all__ = [
    "POLICIES",
    "ReferenceEventError",
    "ReferenceTraceError",
    "replay_reference",
    "replay_reference_lines",
]


class ReferenceTraceError(Exception):
    """Invalid rollout under --strict: the CLI exits 2 with ``line L: rollout 'ID': field F: reason``."""

    def __init__(self, line: int, rollout_id: str | None, field: str, reason: str) -> None:
        self.line = line
        self.rollout_id = rollout_id
        self.field = field
        self.reason = reason
        super().__init__(f"line {line}: rollout {rollout_id!r}: field {field}: {reason}")


class ReferenceEventError(Exception):
    """Malformed event line: the CLI exits 2 in either mode."""

    def __init__(self, line: int, reason: str) -> None:
        self.line = line
        self.reason = reason
        super().__init__(f"line {line}: {reason}")


class _Invalid(Exception):
    def __init__(self, rollout_id: str | None, field: str, reason: str) -> None:
        self.rollout_id = rollout_id
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


# ---------------------------------------------------------------------------------------------- records


@dataclass
class Sample:
    index: int  # position in the rollout as it was added
    raw: dict[str, Any]
    arrived_mask: list[int]  # 0/1 as it arrived: the sampled positions
    labels: list[int | None]  # version label per position, None = unlabelled
    mask: list[int]  # current (masked) mask
    weights: dict[str, list[float]]  # current (masked) rl/ce/ref_kl weights that were given
    arrived_had_something: bool = False
    dropped: bool = False
    logprobs: list[float | None] | None = None
    trainer_logprobs: list[float | None] | None = None


@dataclass
class Rollout:
    id: str
    raw: dict[str, Any]
    group_key: tuple[str, str]
    env: str | None
    frozen: bool
    dispatch: int | None
    completion_given: int | None
    agentic: bool
    samples: list[Sample]
    state: str = "queued"  # queued | dropped | shipped | invalid
    judged_at: int | None = None

    def effective(self, sample: Sample, position: int) -> int:
        label = sample.labels[position]
        if label is not None:
            return label
        assert self.dispatch is not None, "only live rollouts ask for effective versions"
        return self.dispatch

    def kept_samples(self) -> list[Sample]:
        return [s for s in self.samples if not s.dropped]

    def completion(self) -> int:
        if self.completion_given is not None:
            return self.completion_given
        newest: int | None = None
        for sample in self.samples:  # all samples as added (R4)
            for p in range(len(sample.arrived_mask)):
                if sample.arrived_mask[p] == 1:
                    v = self.effective(sample, p)
                    if newest is None or v > newest:
                        newest = v
        assert self.dispatch is not None
        return self.dispatch if newest is None else newest


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _optional_str(raw: dict[str, Any], name: str, rid: str) -> str | None:
    value = raw.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _Invalid(rid, name, "expected a string")
    return value


def _version(value: object, rid: str, name: str) -> int:
    if not _is_int(value):
        raise _Invalid(rid, name, "expected an integer")
    assert isinstance(value, int)
    if value < 0:
        raise _Invalid(rid, name, "must be >= 0")
    return value


def _parse_sample(raw: object, index: int, rid: str) -> Sample:
    where = f"samples[{index}]"
    if not isinstance(raw, dict):
        raise _Invalid(rid, where, "expected an object")
    mask_raw = raw.get("mask")
    if not isinstance(mask_raw, list):
        raise _Invalid(rid, f"{where}.mask", "expected a list of 0/1")
    mask: list[int] = []
    for value in mask_raw:
        if isinstance(value, bool) or (_is_int(value) and value in (0, 1)):
            mask.append(int(value))
        else:
            raise _Invalid(rid, f"{where}.mask", "expected a list of 0/1")
    n = len(mask)
    has_spans = raw.get("weight_versions") is not None
    has_tokens = raw.get("token_versions") is not None
    if has_spans and has_tokens:
        raise _Invalid(rid, f"{where}.token_versions", "both weight_versions and token_versions given")
    labels: list[int | None] = [None] * n
    if has_spans:
        name = f"{where}.weight_versions"
        spans = raw["weight_versions"]
        if not isinstance(spans, list):
            raise _Invalid(rid, name, "expected a list of [version, start] pairs")
        previous_start = -1
        parsed: list[tuple[int, int]] = []
        for pair in spans:
            if not isinstance(pair, list) or len(pair) != 2 or not all(_is_int(x) for x in pair):
                raise _Invalid(rid, name, "expected a list of [version, start] pairs")
            version, start = pair
            if version < -1:
                raise _Invalid(rid, name, "negative version other than -1")
            if start < 0 or start > n - 1:
                raise _Invalid(rid, name, "span start outside 0..n-1")
            if start <= previous_start:
                raise _Invalid(rid, name, "span starts must strictly increase")
            previous_start = start
            parsed.append((version, start))
        for p in range(n):
            label: int | None = None
            for version, start in parsed:
                if start <= p:
                    label = None if version == -1 else version
            labels[p] = label
    if has_tokens:
        name = f"{where}.token_versions"
        token_versions = raw["token_versions"]
        if not isinstance(token_versions, list) or not all(_is_int(x) for x in token_versions):
            raise _Invalid(rid, name, "expected a list of integers")
        if len(token_versions) != n:
            raise _Invalid(rid, name, "wrong length")
        for p in range(n):
            if token_versions[p] < -1:
                raise _Invalid(rid, name, "negative version other than -1")
            labels[p] = None if token_versions[p] == -1 else token_versions[p]
    weights: dict[str, list[float]] = {}
    for name in WEIGHT_FIELDS:
        values = raw.get(name)
        if values is None:
            continue
        if not isinstance(values, list) or not all(_is_number(x) for x in values):
            raise _Invalid(rid, f"{where}.{name}", "expected a list of numbers")
        if len(values) != n:
            raise _Invalid(rid, f"{where}.{name}", "wrong length")
        if not all(math.isfinite(x) for x in values):
            raise _Invalid(rid, f"{where}.{name}", "not a finite number")
        weights[name] = [float(x) for x in values]
    sample = Sample(index=index, raw=raw, arrived_mask=mask, labels=labels, mask=list(mask), weights=weights)
    sample.logprobs = _logprobs(rid, f"{where}.logprobs", raw.get("logprobs"), n)
    sample.trainer_logprobs = _logprobs(rid, f"{where}.trainer_logprobs", raw.get("trainer_logprobs"), n)
    sample.arrived_had_something = _has_something_to_train(sample)
    return sample


def _logprobs(rid: str, name: str, values: object, n: int) -> list[float | None] | None:
    """R16/R18: numbers or nulls; a null, NaN or ±inf read as None (uncovered)."""
    if values is None:
        return None
    if not isinstance(values, list) or not all(x is None or _is_number(x) for x in values):
        raise _Invalid(rid, name, "expected a list of numbers or nulls")
    if len(values) != n:
        raise _Invalid(rid, name, "wrong length")
    return [None if x is None or not math.isfinite(x) else float(x) for x in values]


def parse_rollout(raw: object) -> Rollout:
    """SPEC 3 validation; raises _Invalid naming the first bad field."""
    if not isinstance(raw, dict):
        raise _Invalid(None, "rollout", "expected an object")
    rid_raw = raw.get("id")
    if not isinstance(rid_raw, str):
        raise _Invalid(None, "id", "expected a string")
    rid = rid_raw
    source = raw.get("source", "live")
    if source not in ("live", "frozen"):
        raise _Invalid(rid, "source", "expected 'live' or 'frozen'")
    frozen = source == "frozen"
    group_id = _optional_str(raw, "group_id", rid)
    env = _optional_str(raw, "env", rid)
    if env == "":  # SPEC 3: it would make staleness/env//... keys
        raise _Invalid(rid, "env", "must be a non-empty string when present")
    agentic = raw.get("agentic", False)
    if agentic is None:
        agentic = False
    if not isinstance(agentic, bool):
        raise _Invalid(rid, "agentic", "expected a boolean")
    dispatch: int | None = None
    if raw.get("dispatch_version") is None:
        if not frozen:
            raise _Invalid(rid, "dispatch_version", "required on a live rollout")
    else:
        dispatch = _version(raw["dispatch_version"], rid, "dispatch_version")
    completion: int | None = None
    if raw.get("completion_version") is not None:
        completion = _version(raw["completion_version"], rid, "completion_version")
        if dispatch is not None and completion < dispatch:
            raise _Invalid(rid, "completion_version", "below dispatch_version")
    samples_raw = raw.get("samples")
    if not isinstance(samples_raw, list):
        raise _Invalid(rid, "samples", "expected a list of samples")
    if not samples_raw:
        raise _Invalid(rid, "samples", "empty")
    samples = [_parse_sample(s, i, rid) for i, s in enumerate(samples_raw)]
    group_key = ("group", group_id) if group_id is not None else ("single", rid)
    return Rollout(
        id=rid,
        raw=raw,
        group_key=group_key,
        env=env,
        frozen=frozen,
        dispatch=dispatch,
        completion_given=completion,
        agentic=agentic,
        samples=samples,
    )


def _above_t(rollout: Rollout, t: int) -> _Invalid | None:
    """R1: versions above T are checked when a ship takes the rollout."""
    if rollout.dispatch is not None and rollout.dispatch > t:
        return _Invalid(rollout.id, "dispatch_version", f"version {rollout.dispatch} above T={t}")
    for sample in rollout.samples:
        for p in range(len(sample.labels)):
            label = sample.labels[p]
            if label is not None and label > t:
                name = "token_versions" if sample.raw.get("token_versions") is not None else "weight_versions"
                return _Invalid(rollout.id, f"samples[{sample.index}].{name}", f"version {label} above T={t}")
    return None


def _has_something_to_train(sample: Sample) -> bool:
    rl = sample.weights.get("rl_weights")
    ce = sample.weights.get("ce_weights")
    kl = sample.weights.get("ref_kl_weights")
    for p in range(len(sample.mask)):
        rl_weight = 1.0 if rl is None else rl[p]
        if sample.mask[p] != 0 and rl_weight != 0:
            return True
        if ce is not None and ce[p] != 0:
            return True
        if kl is not None and kl[p] != 0:
            return True
    return False


def _mask_position(sample: Sample, position: int) -> None:
    """SPEC 5: a masked position gets 0 in mask and every given weight array."""
    sample.mask[position] = 0
    for values in sample.weights.values():
        values[position] = 0.0


# ---------------------------------------------------------------------------------------------- the sink


@dataclass
class Config:
    policy: str
    max_staleness: int
    max_token_staleness: int | None
    sync_interval: int
    retry_expired: bool
    lenient: bool
    env_breakdown: bool
    floor_min_tokens: int = 1000
    floor_max_age: int = 100
    cost_window: int = 20
    mismatch_budget: float | None = None
    adapt_every: int | None = None
    adapt_low: int = 1
    adapt_high: int = 16


@dataclass
class Window:
    dropped_rollouts: list[Rollout] = field(default_factory=list)
    dropped_samples: list[tuple[Rollout, Sample]] = field(default_factory=list)
    invalid_envs: list[str] = field(default_factory=list)  # envs of rollouts set aside (lenient)


class ReferenceSink:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.queue: list[Rollout] = []  # in order of arrival
        self.seen_ids: set[str] = set()
        self.agentic_groups: set[tuple[str, str]] = set()
        self.owed: dict[tuple[str, str], int] = {}
        self.window = Window()
        # SPEC 14: the bound in force, the last ships with SPEC 11 sums, the last lag-0 floor, the adaptation.
        self.bound = config.max_staleness
        self.costs = Costs()  # the batch's
        self.env_costs: dict[str, Costs] = {}  # each env's (env breakdown), which never adapt the bound

    # -- add -------------------------------------------------------------------------------------
    def add(self, rollout: Rollout) -> None:
        if rollout.id in self.seen_ids:
            raise _Invalid(rollout.id, "id", "duplicate id")
        self.seen_ids.add(rollout.id)
        if rollout.agentic:
            self.agentic_groups.add(rollout.group_key)
        if self.owed.get(rollout.group_key, 0) > 0:
            self.owed[rollout.group_key] -= 1  # a re-rollout pays back one expired member (R7)
        self.queue.append(rollout)

    def set_aside(self, raw: object) -> None:
        """Lenient mode: an invalid rollout leaves no trace but its env in the breakdown (R11)."""
        env = raw.get("env") if isinstance(raw, dict) else None
        if isinstance(env, str) and env:  # ("" is itself invalid: it names no env)
            self.window.invalid_envs.append(env)

    # -- drops -----------------------------------------------------------------------------------
    def _drop_sample(self, rollout: Rollout, sample: Sample) -> None:
        sample.dropped = True
        self.window.dropped_samples.append((rollout, sample))

    def _drop_rollout(self, rollout: Rollout) -> None:
        for sample in rollout.samples:
            if not sample.dropped:
                self._drop_sample(rollout, sample)
        rollout.state = "dropped"
        self.queue.remove(rollout)
        self.window.dropped_rollouts.append(rollout)

    # -- policies --------------------------------------------------------------------------------
    def _judge(self, step: int, targets: list[Rollout]) -> None:
        policy = self.config.policy
        if policy == "token":
            self._judge_token(step, targets)
        elif policy == "episode":
            self._judge_episode(step, targets)
        elif policy == "group":
            self._judge_group(step, targets)
        else:
            self._judge_xtuner(step, targets)

    def _judge_token(self, step: int, targets: list[Rollout]) -> None:
        t = step - 1
        bound = t - self.bound
        for rollout in targets:
            if rollout.frozen or rollout.state != "queued":
                continue
            for sample in rollout.kept_samples():
                for p in range(len(sample.arrived_mask)):
                    if sample.arrived_mask[p] == 1 and rollout.effective(sample, p) < bound:
                        _mask_position(sample, p)
                if sample.arrived_had_something and not _has_something_to_train(sample):
                    self._drop_sample(rollout, sample)
            if all(s.dropped for s in rollout.samples):
                self._drop_rollout(rollout)

    def _judge_episode(self, step: int, targets: list[Rollout]) -> None:
        t = step - 1
        for rollout in targets:
            if rollout.frozen or rollout.state != "queued":
                continue
            assert rollout.dispatch is not None
            if t - rollout.dispatch > self.config.max_staleness:
                self._drop_rollout(rollout)

    def _touched_groups(self, targets: list[Rollout]) -> list[tuple[str, str]]:
        groups: list[tuple[str, str]] = []
        for rollout in targets:
            if rollout.group_key not in groups:
                groups.append(rollout.group_key)
        return groups

    def _judge_group(self, step: int, targets: list[Rollout]) -> None:
        t = step - 1
        for group in self._touched_groups(targets):
            members = [r for r in self.queue if r.group_key == group and not r.frozen]
            if not members:
                continue
            group_version = min(r.dispatch for r in members if r.dispatch is not None)
            if t - group_version > self.config.max_staleness:
                for rollout in members:
                    self._drop_rollout(rollout)

    def _sequence_staleness(self, rollout: Rollout, sample: Sample, t: int) -> int:
        versions: list[int] = []
        for p in range(len(sample.labels)):
            label = sample.labels[p]
            if label is not None:
                versions.append(label)
            elif sample.arrived_mask[p] == 1:
                versions.append(rollout.effective(sample, p))
        return 0 if not versions else t - min(versions)

    def _xtuner_expired(self, rollout: Rollout, t: int) -> bool:
        k = self.config.sync_interval
        seq_threshold = (self.config.max_staleness + 1) * k
        token_bound = self.config.max_token_staleness
        group_agentic = rollout.group_key in self.agentic_groups
        expired = False
        for sample in rollout.kept_samples():
            sampled = [p for p in range(len(sample.arrived_mask)) if sample.arrived_mask[p] == 1]
            masking_applies = token_bound is not None and not group_agentic and len(sampled) > 0
            if masking_applies:
                assert token_bound is not None
                token_threshold = (token_bound + 1) * k
                for p in sampled:
                    if t - rollout.effective(sample, p) >= token_threshold:
                        _mask_position(sample, p)
            if self._sequence_staleness(rollout, sample, t) >= seq_threshold:
                expired = True
            if masking_applies and all(sample.mask[p] == 0 for p in sampled):
                expired = True
        return expired

    def _judge_xtuner(self, step: int, targets: list[Rollout]) -> None:
        t = step - 1
        for group in self._touched_groups(targets):
            members = [r for r in self.queue if r.group_key == group]
            expired = [r for r in members if not r.frozen and self._xtuner_expired(r, t)]
            if not expired:
                continue
            if self.config.retry_expired:
                for rollout in expired:
                    self._drop_rollout(rollout)
                self.owed[group] = self.owed.get(group, 0) + len(expired)
            else:
                for rollout in members:
                    if not rollout.frozen:
                        self._drop_rollout(rollout)

    def _held(self, rollout: Rollout) -> bool:
        return self.config.policy == "xtuner" and self.config.retry_expired and self.owed.get(rollout.group_key, 0) > 0

    # -- sweep and ship --------------------------------------------------------------------------
    def sweep(self, step: int) -> None:
        targets = [r for r in self.queue if r.judged_at != step]
        for rollout in targets:
            rollout.judged_at = step
        self._judge(step, targets)

    def ship(self, step: int, ids: list[str] | None, line: int) -> tuple[dict[str, Any], dict[str, Any]]:
        self.sweep(step)
        t = step - 1
        if ids is None:
            taken = list(self.queue)
        else:
            named = set(ids)
            taken = [r for r in self.queue if r.id in named]
        checked: list[Rollout] = []
        for rollout in taken:
            problem = _above_t(rollout, t)
            if problem is None:
                checked.append(rollout)
            elif self.config.lenient:
                rollout.state = "invalid"
                self.queue.remove(rollout)
                self.set_aside(rollout.raw)
            else:
                raise ReferenceTraceError(line, problem.rollout_id, problem.field, problem.reason)
        self._judge(step, checked)
        held = [r for r in checked if r.state == "queued" and self._held(r)]
        shipped = [r for r in checked if r.state == "queued" and not self._held(r)]
        for rollout in shipped:
            rollout.state = "shipped"
            self.queue.remove(rollout)
        metrics = self._metrics(step, shipped, held)
        batch = {
            "step": step,
            "shipped": [_as_shipped(r) for r in shipped],
            "dropped_rollouts": [r.id for r in self.window.dropped_rollouts if not r.frozen],
            "dropped_samples": [[r.id, s.index] for r, s in self.window.dropped_samples],
            "held": [r.id for r in held],
        }
        self.window = Window()
        return metrics, batch

    # -- what staleness costs and choosing the bound (SPEC 11, SPEC 14) ---------------------------------
    def _costs(self, step: int, buckets: Buckets | None, state: Costs, bound: int, adapt: bool) -> dict[str, Any]:
        if buckets is None or not any(entry[0] for name, entry in buckets.items() if name):
            return {}
        c = self.config
        state.ships = [*state.ships, buckets][-c.cost_window :]

        def tokens(ship: Buckets, name: str) -> float:
            return ship[name][0] if name in ship else 0

        floor: float | None = None
        if tokens(buckets, "0") >= c.floor_min_tokens:
            floor, source, age = buckets["0"][1] / buckets["0"][0], "lag0", 0
            state.last_lag0 = (floor, step)
        elif state.last_lag0 is not None and step - state.last_lag0[1] <= c.floor_max_age:
            floor, source, age = state.last_lag0[0], "carried", step - state.last_lag0[1]
        else:
            for name in LAG_NAMES:
                if tokens(buckets, name) >= c.floor_min_tokens:
                    floor, source, age = buckets[name][1] / buckets[name][0], "min_lag", 0
                    break
        out = _mismatch_metrics(buckets, floor)
        if floor is None:
            return out
        budget = floor if c.mismatch_budget is None else c.mismatch_budget
        out["staleness/mismatch/floor"] = floor
        out["staleness/mismatch/floor_age"] = age
        out["staleness/mismatch/floor_source"] = source
        out["staleness/mismatch/budget"] = budget
        lags, excess, weights = [], [], []
        for lag in range(1, 17):
            n = sum(tokens(ship, str(lag)) for ship in state.ships)
            if n >= c.floor_min_tokens:
                k3 = sum(ship[str(lag)][1] for ship in state.ships if str(lag) in ship)
                lags.append(lag)
                excess.append(k3 / n - floor)
                weights.append(n)
        fitted = _pooled(excess, weights)
        for lag, value in zip(lags, fitted):
            out[f"staleness/mismatch/curve/lag_{lag}"] = value
        if not lags:
            return out
        within = [lag for lag, value in zip(lags, fitted) if value <= budget]
        suggested = max(within) if within else 0
        crossed = any(value > budget for value in fitted)
        out["staleness/bound/suggested"] = suggested
        out["staleness/bound/crossed"] = int(crossed)
        at_bound = [value for lag, value in zip(lags, fitted) if lag <= bound]
        if at_bound:
            out["staleness/bound/excess_at_bound"] = at_bound[-1]
        if adapt and c.adapt_every is not None:
            state.ships_with_curve += 1
            if state.ships_with_curve % c.adapt_every == 0:
                if crossed and suggested != self.bound:
                    self.bound += 1 if suggested > self.bound else -1
                elif not crossed and suggested >= self.bound:
                    self.bound += 1
                self.bound = max(c.adapt_low, min(c.adapt_high, self.bound))
        return out

    # -- metrics (SPEC 6) ------------------------------------------------------------------------
    def _metrics(self, step: int, shipped: list[Rollout], held: list[Rollout]) -> dict[str, Any]:
        metrics: dict[str, Any] = {"step": step}
        metrics.update(
            _slice_metrics(step, shipped, self.window.dropped_rollouts, self.window.dropped_samples, held, "staleness/")
        )
        metrics["staleness/max_staleness"] = bound = self.bound
        env_costs: dict[str, dict[str, Any]] = {}
        if self.config.env_breakdown:  # each env's SPEC 11 / 14 keys, at the bound this ship used
            for env in dict.fromkeys(r.env for r in shipped if r.env is not None):
                state = self.env_costs.setdefault(env, Costs())
                env_buckets = _mismatch_buckets(step, [r for r in shipped if r.env == env])
                env_costs[env] = self._costs(step, env_buckets, state, bound, adapt=False)
        metrics.update(self._costs(step, _mismatch_buckets(step, shipped), self.costs, bound, adapt=True))
        if self.config.env_breakdown:
            envs: list[str] = []
            everything = [
                *shipped,
                *self.window.dropped_rollouts,
                *[r for r, _ in self.window.dropped_samples],
                *held,
            ]
            for env in [*(r.env for r in everything), *self.window.invalid_envs]:
                if env is not None and env not in envs:
                    envs.append(env)
            for env in envs:
                metrics.update(
                    _slice_metrics(
                        step,
                        [r for r in shipped if r.env == env],
                        [r for r in self.window.dropped_rollouts if r.env == env],
                        [(r, s) for r, s in self.window.dropped_samples if r.env == env],
                        [r for r in held if r.env == env],
                        f"staleness/env/{env}/",
                    )
                )
                metrics[f"staleness/env/{env}/max_staleness"] = metrics["staleness/max_staleness"]
                for key, value in env_costs.get(env, {}).items():
                    metrics[f"staleness/env/{env}/{key.removeprefix('staleness/')}"] = value
        return metrics


def _slice_metrics(
    step: int,
    shipped: list[Rollout],
    dropped_rollouts: list[Rollout],
    dropped_samples: list[tuple[Rollout, Sample]],
    held: list[Rollout],
    prefix: str,
) -> dict[str, Any]:
    t = step - 1
    out: dict[str, Any] = {}
    population = [r for r in shipped if not r.frozen]
    token_staleness: list[int] = []
    masked = 0
    unlabelled = 0
    for rollout in population:
        for sample in rollout.kept_samples():
            for p in range(len(sample.arrived_mask)):
                if sample.arrived_mask[p] == 1:
                    token_staleness.append(t - rollout.effective(sample, p))
                    if sample.mask[p] == 0:
                        masked += 1
                    if sample.labels[p] is None:
                        unlabelled += 1
    n = len(token_staleness)
    if n > 0:
        out[prefix + "token/mean"] = sum(token_staleness) / n
        out[prefix + "token/masked"] = masked / n
        out[prefix + "token/unlabelled"] = unlabelled / n
        ordered = sorted(token_staleness)
        for name, share in QUANTILES:
            rank = math.ceil(share * n)  # exact: p is a Fraction (R15)
            out[prefix + f"token/{name}"] = ordered[rank - 1]
    rollout_r: list[int] = []
    rollout_f: list[int] = []
    rollout_q: list[int] = []
    rollout_n: list[int] = []  # newest-token staleness (issue 14): T - max(v), dispatch when none
    for rollout in population:
        versions: list[int] = []
        for sample in rollout.kept_samples():
            for p in range(len(sample.arrived_mask)):
                if sample.arrived_mask[p] == 1:
                    versions.append(rollout.effective(sample, p))
        assert rollout.dispatch is not None
        oldest = min(versions) if versions else rollout.dispatch
        r = t - oldest
        f = min(max(rollout.completion() - oldest, 0), r)
        rollout_r.append(r)
        rollout_f.append(f)
        rollout_q.append(r - f)
        rollout_n.append(t - (max(versions) if versions else rollout.dispatch))
    if population:
        for name, values in (
            ("", rollout_r),
            ("in_flight/", rollout_f),
            ("in_queue/", rollout_q),
            ("newest/", rollout_n),
        ):
            out[prefix + f"rollout/{name}mean"] = sum(values) / len(values)
            out[prefix + f"rollout/{name}max"] = max(values)
    out.update(_length_metrics(population, dropped_samples, prefix))
    out[prefix + "rollout/dropped"] = len([r for r in dropped_rollouts if not r.frozen])
    out[prefix + "sample/dropped"] = len(dropped_samples)
    out[prefix + "rollout/held"] = len(held)
    return out


LENGTH_BUCKETS = ((1, 256, "256"), (257, 1024, "1k"), (1025, 4096, "4k"), (4097, 16384, "16k"), (16385, None, "inf"))


def _length_metrics(
    population: list[Rollout], dropped_samples: list[tuple[Rollout, Sample]], prefix: str
) -> dict[str, Any]:
    """SPEC 12 (R19): (sampled positions, masked or dropped ones) per sample of the population."""
    lengths: list[tuple[int, int]] = []
    for rollout in population:
        for sample in rollout.kept_samples():
            sampled = [p for p in range(len(sample.arrived_mask)) if sample.arrived_mask[p] == 1]
            lengths.append((len(sampled), sum(1 for p in sampled if sample.mask[p] == 0)))
    for _, sample in dropped_samples:
        n = sum(sample.arrived_mask)
        lengths.append((n, n))
    if not lengths:
        return {}
    out: dict[str, Any] = {
        prefix + "length/sampled/mean": sum(n for n, _ in lengths) / len(lengths),
        prefix + "length/trained/mean": sum(n - gone for n, gone in lengths) / len(lengths),
    }
    for low, high, name in LENGTH_BUCKETS:
        inside = [(n, gone) for n, gone in lengths if n >= low and (high is None or n <= high)]
        if inside:
            out[prefix + f"length/bucket_{name}/masked"] = sum(g for _, g in inside) / sum(n for n, _ in inside)
    return out


LAG_NAMES = (*(str(b) for b in range(17)), "32", "64", "inf")


def _pooled(values: list[float], weights: list[float]) -> list[float]:
    """Weighted isotonic (non-decreasing) fit: pool the first adjacent pair of blocks out of order, again and
    again, until none is."""
    blocks = [[v * w, w, 1] for v, w in zip(values, weights)]  # [Σ w·v, Σ w, points]
    while True:
        for i in range(len(blocks) - 1):
            if blocks[i][0] / blocks[i][1] > blocks[i + 1][0] / blocks[i + 1][1]:
                a, b = blocks[i], blocks.pop(i + 1)
                blocks[i] = [a[0] + b[0], a[1] + b[1], a[2] + b[2]]
                break
        else:
            break
    return [block[0] / block[1] for block in blocks for _ in range(int(block[2]))]


def _lag_bucket(lag: int) -> str:
    if lag <= 16:
        return str(lag)
    return "32" if lag <= 32 else "64" if lag <= 64 else "inf"


@dataclass
class Costs:
    """SPEC 14's run-long state: the last ships with SPEC 11 sums, the last lag-0 floor, ships with a curve."""

    ships: list[dict[str, list[float]]] = field(default_factory=list)
    last_lag0: tuple[float, int] | None = None
    ships_with_curve: int = 0


Buckets = dict[str, list[float]]  # bucket -> [tokens, k3, |d|, out of band, r, r^2], plus "" -> [sampled]


def _mismatch_buckets(step: int, shipped: list[Rollout]) -> Buckets | None:
    """SPEC 11 (R18), position by position: the sums per lag bucket (None when no sample has trainer values)."""
    t = step - 1
    population = [r for r in shipped if not r.frozen]
    if not any(s.trainer_logprobs is not None for r in population for s in r.kept_samples()):
        return None
    buckets: dict[str, list[float]] = {}  # bucket -> [tokens, k3, |d|, out of band, r, r^2]
    sampled = covered = 0
    k3_all = 0.0
    for rollout in population:
        for sample in rollout.kept_samples():
            for p in range(len(sample.arrived_mask)):
                if sample.arrived_mask[p] != 1:
                    continue
                sampled += 1
                trainer = None if sample.trainer_logprobs is None else sample.trainer_logprobs[p]
                sampler = None if sample.logprobs is None else sample.logprobs[p]
                if trainer is None or sampler is None:
                    continue
                covered += 1
                d = max(-20.0, min(20.0, trainer - sampler))
                r = math.exp(d)
                k3 = r - 1 - d
                k3_all += k3
                entry = buckets.setdefault(_lag_bucket(t - rollout.effective(sample, p)), [0, 0.0, 0.0, 0, 0.0, 0.0])
                entry[0] += 1
                entry[1] += k3
                entry[2] += abs(d)
                entry[3] += r < 0.5 or r > 2.0
                entry[4] += r
                entry[5] += r * r
    buckets[""] = [sampled, k3_all]
    return buckets


def _mismatch_metrics(buckets: Buckets, floor: float | None) -> dict[str, Any]:
    """The SPEC 11 keys of a ship's buckets, the excess against SPEC 14's floor."""
    sampled, k3_all = buckets[""]
    covered = sum(entry[0] for name, entry in buckets.items() if name)
    if covered == 0:
        return {}
    out: dict[str, Any] = {}
    for name, entry in buckets.items():
        if not name:
            continue
        n, k3, absd, oob, ratio, ratio_sq = entry
        key = f"staleness/mismatch/lag_{name}/"
        out[key + "tokens"] = n
        out[key + "k3"] = k3 / n
        out[key + "abs_log_ratio"] = absd / n
        out[key + "out_of_band"] = oob / n
        out[key + "ess"] = ratio * ratio / (n * ratio_sq)
        if floor is not None and name != "0":
            out[key + "excess_k3"] = k3 / n - floor
    out["staleness/mismatch/k3"] = k3_all / covered
    stale = [(entry[0], entry[1]) for name, entry in buckets.items() if name not in ("0", "")]
    if floor is not None and stale:
        out["staleness/mismatch/excess_k3"] = sum(k for _, k in stale) / sum(n for n, _ in stale) - floor
    out["staleness/mismatch/coverage"] = covered / sampled
    return out


def _as_shipped(rollout: Rollout) -> dict[str, Any]:
    """R13: the rollout as given, shipped samples only, masked arrays in place."""
    out = copy.deepcopy(rollout.raw)
    samples = []
    for sample in rollout.kept_samples():
        raw = copy.deepcopy(sample.raw)
        raw["mask"] = list(sample.mask)
        for name, values in sample.weights.items():
            raw[name] = list(values)
        for name in ("logprobs", "trainer_logprobs"):  # a value lacking (null, NaN, ±inf) as null
            if getattr(sample, name) is not None:
                raw[name] = list(getattr(sample, name))
        samples.append(raw)
    out["samples"] = samples
    return out


# ---------------------------------------------------------------------------------------------- replay


_EVENT_FIELDS = {"rollout": {"type", "rollout"}, "sweep": {"type", "step"}, "ship": {"type", "step", "ids"}}  # R14


def _event_step(event: dict[str, Any], line: int, last_step: int) -> int:
    step = event.get("step")
    if not _is_int(step):
        raise ReferenceEventError(line, "step must be an integer")
    assert isinstance(step, int)
    if step < 1:
        raise ReferenceEventError(line, "step must be >= 1")
    if step < last_step:
        raise ReferenceEventError(line, f"step {step} below an earlier step {last_step}")
    return step


def replay_reference(
    events: list[Any],
    policy: str = "token",
    max_staleness: int = 8,
    max_token_staleness: int | None = None,
    sync_interval: int = 1,
    retry_expired: bool = False,
    lenient: bool = False,
    env_breakdown: bool = False,
    **bound: Any,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Replay parsed events (line L = index + 1); returns (metrics lines, batches lines).

    Raises ReferenceTraceError (strict, invalid rollout) or ReferenceEventError (malformed event): the
    cases where SPEC 9 says the CLI exits 2 and writes no output.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}")
    config = Config(
        policy=policy,
        max_staleness=max_staleness,
        max_token_staleness=max_token_staleness,
        sync_interval=sync_interval,
        retry_expired=retry_expired,
        lenient=lenient,
        env_breakdown=env_breakdown,
        **bound,  # SPEC 14's settings: floor_min_tokens, floor_max_age, cost_window, mismatch_budget, adapt_*
    )
    sink = ReferenceSink(config)
    metrics_lines: list[dict[str, Any]] = []
    batches_lines: list[dict[str, Any]] = []
    last_step = 0
    for number, event in enumerate(events, start=1):
        if event is None:  # a blank line (R14)
            continue
        if not isinstance(event, dict):
            raise ReferenceEventError(number, "expected a JSON object")
        kind = event.get("type")
        if kind in ("rollout", "sweep", "ship") and set(event) - _EVENT_FIELDS[kind]:
            raise ReferenceEventError(number, f"unknown key {sorted(set(event) - _EVENT_FIELDS[kind])[0]!r}")
        if kind == "rollout":
            raw = event.get("rollout")
            if not isinstance(raw, dict):
                raise ReferenceEventError(number, "rollout event without a rollout object")
            try:
                sink.add(parse_rollout(raw))
            except _Invalid as problem:
                if not lenient:
                    raise ReferenceTraceError(number, problem.rollout_id, problem.field, problem.reason) from None
                sink.set_aside(raw)
        elif kind == "sweep":
            last_step = _event_step(event, number, last_step)
            sink.sweep(last_step)
        elif kind == "ship":
            last_step = _event_step(event, number, last_step)
            ids = event.get("ids")
            if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, str) for i in ids)):
                raise ReferenceEventError(number, "ids must be a list of strings")
            metrics, batch = sink.ship(last_step, ids, number)
            metrics_lines.append(metrics)
            batches_lines.append(batch)
        else:
            raise ReferenceEventError(number, f"unknown event type {kind!r}")
    return metrics_lines, batches_lines


def replay_reference_lines(lines: list[str], **options: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Same as replay_reference, from the raw lines of an EVENTS.jsonl file (bad JSON is malformed)."""
    events: list[Any] = []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            events.append(None)
            continue
        try:
            events.append(json.loads(text))
        except json.JSONDecodeError as error:
            raise ReferenceEventError(number, f"bad JSON: {error}") from None
    return replay_reference(events, **options)
