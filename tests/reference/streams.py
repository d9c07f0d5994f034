"""Random but valid replay event streams (SPEC 9), seeded, and the same as hypothesis strategies.

One generator body draws every choice through a ``Chooser``: ``SeededChooser`` (random.Random) for
reproducible seeds, ``DrawChooser`` (hypothesis ``draw``) so that failing streams shrink. Choices are
phrased so that hypothesis' "smaller" means "fewer features".

Every stream exercises, with some probability: version spans and per-token versions with -1 entries and
unlabelled prefixes, mask-0 positions, rl/ce/ref_kl weights with zeros and ce weight on mask-0 positions,
GRPO groups and singletons, frozen and agentic rollouts, partial ships (some naming nothing), sweeps
between ships, several ships at one step, staleness landing exactly on each policy's thresholds, late
members / re-rollouts under an existing ``group_id`` with new ids, versions above ``T`` seen only by
sweeps, and empty ships. Valid streams keep one invariant: every ship's ``T`` is at least every version
given so far, so only the deliberately invalid ones (``with_defects``) trip the ship-time check.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from hypothesis import strategies as st

T = TypeVar("T")

ENVS: tuple[str | None, ...] = ("math", "code", None)
DEFECTS = (
    "wrong_length",
    "negative_version",
    "unsorted_spans",
    "completion_below_dispatch",
    "missing_dispatch",
    "duplicate_id",
    "both_version_fields",
    "wrong_type",
    "empty_samples",
    "span_start_outside",
    "label_above_t",
    "dispatch_above_t",
)


class Chooser(Protocol):
    def integer(self, low: int, high: int) -> int: ...

    def chance(self, percent: int) -> bool: ...


class SeededChooser:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def chance(self, percent: int) -> bool:
        return self.rng.randrange(100) < percent


class DrawChooser:
    def __init__(self, draw: Any) -> None:
        self.draw = draw

    def integer(self, low: int, high: int) -> int:
        return int(self.draw(st.integers(low, high)))

    def chance(self, percent: int) -> bool:
        # 0 (what hypothesis shrinks to) means "no", so shrunk streams lose features.
        return int(self.draw(st.integers(0, 99))) >= 100 - percent


def pick(chooser: Chooser, options: Sequence[T]) -> T:
    return options[chooser.integer(0, len(options) - 1)]


@dataclass(frozen=True)
class ReplayConfig:
    policy: str = "token"
    max_staleness: int = 8
    max_token_staleness: int | None = None
    sync_interval: int = 1
    retry_expired: bool = False
    lenient: bool = False
    env_breakdown: bool = False
    # SPEC 14, small enough for the streams' few tokens to give floors and curves.
    floor_min_tokens: int = 1000
    floor_max_age: int = 100
    cost_window: int = 20
    mismatch_budget: float | None = None
    adapt_every: int | None = None
    adapt_low: int = 1
    adapt_high: int = 16

    def bound_options(self) -> dict[str, Any]:
        return {
            "floor_min_tokens": self.floor_min_tokens,
            "floor_max_age": self.floor_max_age,
            "cost_window": self.cost_window,
            "mismatch_budget": self.mismatch_budget,
            "adapt_every": self.adapt_every,
            "adapt_low": self.adapt_low,
            "adapt_high": self.adapt_high,
        }

    def cli_args(self) -> list[str]:
        args = ["--policy", self.policy, "--max-staleness", str(self.max_staleness)]
        if self.max_token_staleness is not None:
            args += ["--max-token-staleness", str(self.max_token_staleness)]
        if self.policy == "xtuner":
            args += ["--sync-interval", str(self.sync_interval)]
        if self.retry_expired:
            args.append("--retry-expired")
        args.append("--lenient" if self.lenient else "--strict")
        if self.env_breakdown:
            args.append("--env-breakdown")
        for name, value in self.bound_options().items():
            if value is not None:
                args += ["--" + name.replace("_", "-"), repr(value) if isinstance(value, float) else str(value)]
        return args

    def reference_options(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "max_staleness": self.max_staleness,
            "max_token_staleness": self.max_token_staleness,
            "sync_interval": self.sync_interval,
            "retry_expired": self.retry_expired,
            "lenient": self.lenient,
            "env_breakdown": self.env_breakdown,
            **self.bound_options(),
        }

    def thresholds(self) -> list[int]:
        """Staleness values at which this configuration's decisions flip (hit them exactly, and +-1)."""
        if self.policy != "xtuner":
            return [self.max_staleness]
        k = self.sync_interval
        found = [(self.max_staleness + 1) * k]
        if self.max_token_staleness is not None:
            found.append((self.max_token_staleness + 1) * k)
        return found


def random_config(chooser: Chooser, policy: str, lenient: bool = False) -> ReplayConfig:
    return dataclasses.replace(_random_config(chooser, policy, lenient), **_random_bound(chooser, policy))


def _random_bound(chooser: Chooser, policy: str) -> dict[str, Any]:
    """SPEC 14 settings the streams' handful of tokens exercise: floors of every source, curves, adaptation."""
    if chooser.chance(20):
        return {}  # the defaults: no floor from so few tokens, so no SPEC 14 key
    bound: dict[str, Any] = {
        "floor_min_tokens": chooser.integer(1, 3),
        "floor_max_age": chooser.integer(0, 4),
        "cost_window": chooser.integer(1, 6),
        "mismatch_budget": None if chooser.chance(50) else chooser.integer(0, 8) / 16,
    }
    if policy == "token" and chooser.chance(50):
        bound.update(adapt_every=chooser.integer(1, 2), adapt_low=0, adapt_high=chooser.integer(4, 6))
    return bound


def _random_config(chooser: Chooser, policy: str, lenient: bool = False) -> ReplayConfig:
    max_staleness = chooser.integer(0, 4)
    if policy != "xtuner":
        return ReplayConfig(
            policy=policy, max_staleness=max_staleness, lenient=lenient, env_breakdown=chooser.chance(25)
        )
    return ReplayConfig(
        policy=policy,
        max_staleness=max_staleness,
        # Token masking without expiry needs S_tok < S, so the token bound is mostly below the other.
        max_token_staleness=None
        if chooser.chance(25)
        else chooser.integer(0, max(0, max_staleness - 1))
        if chooser.chance(70)
        else chooser.integer(0, 3),
        sync_interval=1 if chooser.chance(60) else chooser.integer(2, 3),
        retry_expired=chooser.chance(55),
        lenient=lenient,
        env_breakdown=chooser.chance(25),
    )


class _StreamBuilder:
    def __init__(self, chooser: Chooser, config: ReplayConfig, defects: int) -> None:
        self.ch = chooser
        self.config = config
        self.events: list[dict[str, Any]] = []
        self.now = chooser.integer(1, 3 + max(config.thresholds()))  # step of the next sweep/ship
        self.min_ship_step = 1  # one above every version given so far (valid streams never trip T)
        self.next_id = 0
        self.next_group = 0
        self.groups: list[tuple[str, str | None]] = []  # (group_id, env)
        self.ids: list[str] = []
        self.valid_ids: list[str] = []  # ids of rollouts that pass the add-time checks
        self.defects_left = defects

    # -- versions --------------------------------------------------------------------------------
    def age(self) -> int:
        """Staleness the version would have at a ship at ``now``: often exactly at a threshold."""
        # Rollouts then wait in the queue, so most start at or just below a threshold.
        config = self.config
        if config.policy == "xtuner" and config.max_token_staleness is not None and self.ch.chance(35):
            # Old enough for token masking of the oldest positions, young enough not to expire yet.
            token_threshold, sequence_threshold = config.thresholds()[1], config.thresholds()[0]
            return token_threshold + self.ch.integer(0, max(0, sequence_threshold - token_threshold - 1))
        if self.ch.chance(60):
            return max(0, pick(self.ch, config.thresholds()) + self.ch.integer(-2, 0))
        return self.ch.integer(0, max(config.thresholds()) + 1)

    def version(self) -> int:
        return max(0, self.now - 1 - self.age())

    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    # -- samples ---------------------------------------------------------------------------------
    def sample(self, dispatch: int, top: int, frozen: bool) -> dict[str, Any]:
        ch = self.ch
        n = 0 if ch.chance(3) else ch.integer(1, 9)
        prompt = ch.integer(0, min(3, n)) if ch.chance(40) else 0
        mask: list[Any] = [0] * prompt + [0 if ch.chance(12) else 1 for _ in range(n - prompt)]
        if ch.chance(5):
            mask = [0] * n
        if ch.chance(10):
            mask = [bool(x) for x in mask]
        sample: dict[str, Any] = {"mask": mask}
        # Engines load new weights mid-response: versions rise from (around) dispatch towards ``top``.
        versions: list[int] = []
        current = max(0, dispatch - 1) if ch.chance(10) else dispatch  # labels older than dispatch
        for _ in range(n):
            if current < top and ch.chance(25):
                current = ch.integer(current + 1, top)
            versions.append(current)
        if frozen:
            versions = [0] * n
        mode = ch.integer(0, 2) if n else 0
        if mode == 1:  # weight_versions spans
            starts = [p for p in range(n) if p == 0 or versions[p] != versions[p - 1] or ch.chance(10)]
            if starts and ch.chance(30):
                starts = starts[1:]  # unlabelled prefix
            spans = [[-1 if ch.chance(10) else versions[s], s] for s in starts]
            sample["weight_versions"] = spans
        elif mode == 2:  # token_versions with -1 entries and maybe an unlabelled prefix
            unlabelled_prefix = ch.integer(0, n) if ch.chance(25) else 0
            sample["token_versions"] = [-1 if p < unlabelled_prefix or ch.chance(10) else versions[p] for p in range(n)]
        for name, percent in (("rl_weights", 50), ("ce_weights", 25), ("ref_kl_weights", 25)):
            if ch.chance(percent):
                values = [pick(ch, (0.0, 0.0, 0.5, 1.0, 1.0, 2.0, -0.25)) for _ in range(n)]
                if name != "rl_weights" and ch.chance(50):
                    values = [0.0] * n
                    if n and ch.chance(70):  # a ce/ref-KL weight on a mask-0 (prompt) position
                        values[ch.integer(0, n - 1)] = 1.0
                sample[name] = values
        # A stream that exercises SPEC 14 (small floor_min_tokens) carries both log-probabilities mostly.
        costs = self.config.floor_min_tokens < 1000
        if ch.chance(80 if costs else 15):
            sample["logprobs"] = [None if ch.chance(5) else -0.125 * ch.integer(0, 40) for _ in range(n)]
        if ch.chance(80 if costs else 20):  # SPEC 11: nulls (either side) are uncovered positions
            sample["trainer_logprobs"] = [None if ch.chance(10) else -0.125 * ch.integer(0, 40) for _ in range(n)]
        return sample

    # -- rollouts --------------------------------------------------------------------------------
    def rollout(self, group_id: str | None, env: str | None, dispatch: int | None = None) -> dict[str, Any]:
        ch = self.ch
        frozen = ch.chance(8)
        rid = self.new_id()
        record: dict[str, Any] = {"id": rid}
        if group_id is not None:
            record["group_id"] = group_id
        if env is not None:
            record["env"] = env
        if frozen:
            record["source"] = "frozen"
        elif ch.chance(5):
            record["source"] = "live"
        if ch.chance(15):
            record["agentic"] = True
        elif ch.chance(5):
            record["agentic"] = False
        d = self.version() if dispatch is None else dispatch
        # Sometimes a version one above the current T: only a sweep at ``now`` may see it (SPEC 3).
        top = self.now if ch.chance(5) else self.now - 1
        top = max(top, d)
        if not frozen or ch.chance(50):
            record["dispatch_version"] = d
        if not frozen and ch.chance(35):
            # completion above T at ship time is valid (prime-rl 3/5 at step 5).
            record["completion_version"] = ch.integer(d, top + 2)
        record["samples"] = [self.sample(d, top, frozen) for _ in range(1 + (ch.integer(1, 3) if ch.chance(30) else 0))]
        self.min_ship_step = max(self.min_ship_step, top + 1, d + 1)
        self.ids.append(rid)
        return record

    def add(self, record: dict[str, Any], valid: bool = True) -> None:
        self.events.append({"type": "rollout", "rollout": record})
        if valid:
            self.valid_ids.append(record["id"])

    def add_some(self) -> None:
        ch = self.ch
        for _ in range(ch.integer(0, 4)):
            if self.defects_left and ch.chance(25):
                self.add_defect()
            elif ch.chance(35):  # a GRPO group
                self.next_group += 1
                gid, env = f"g{self.next_group}", pick(ch, ENVS)
                self.groups.append((gid, env))
                d = self.version()
                for _ in range(ch.integer(2, 4)):
                    own = d if ch.chance(75) else max(0, d + ch.integer(-1, 1))
                    own = min(own, self.now - 1) if own > d else own
                    self.add(self.rollout(gid, env, own))
            elif self.groups and ch.chance(30):  # re-rollout / late member of an existing group
                gid, env = pick(ch, self.groups[-4:])
                for _ in range(ch.integer(1, 2)):
                    self.add(self.rollout(gid, env))
            else:
                self.add(self.rollout(None, pick(ch, ENVS)))

    # -- deliberately invalid rollouts (one defect each) ----------------------------------------
    def add_defect(self) -> None:
        ch = self.ch
        self.defects_left -= 1
        kind = pick(ch, DEFECTS)
        saved = self.min_ship_step
        record = self.rollout(None, pick(ch, ENVS))
        record.pop("agentic", None)  # keep invalid rollouts out of any agentic question (R12)
        record.pop("source", None)
        record["dispatch_version"] = record.get("dispatch_version", self.version())
        first = record["samples"][0]
        n = len(first["mask"])
        if kind == "wrong_length":
            first["rl_weights"] = [1.0] * (n + 1)
        elif kind == "negative_version":
            first.pop("weight_versions", None)
            first["token_versions"] = [-2] * n if n else None
            if not n:
                first.pop("token_versions")
                first["weight_versions"] = [[-3, 0]]
        elif kind == "unsorted_spans":
            first.pop("token_versions", None)
            first["mask"] = [1, 1, 1]
            for name in ("rl_weights", "ce_weights", "ref_kl_weights", "logprobs", "trainer_logprobs"):
                first.pop(name, None)
            first["weight_versions"] = [[record["dispatch_version"], 2], [record["dispatch_version"], 1]]
        elif kind == "completion_below_dispatch":
            record["dispatch_version"] = max(1, record["dispatch_version"])
            record["completion_version"] = record["dispatch_version"] - 1
        elif kind == "missing_dispatch":
            del record["dispatch_version"]
        elif kind == "duplicate_id":
            if self.valid_ids:
                record["id"] = pick(ch, self.valid_ids)
            else:
                record["samples"] = []
        elif kind == "both_version_fields":
            for name in ("rl_weights", "ce_weights", "ref_kl_weights", "logprobs", "trainer_logprobs"):
                first.pop(name, None)
            first["mask"] = [1, 1]
            first["token_versions"] = [-1, -1]
            first["weight_versions"] = [[record["dispatch_version"], 0]]
        elif kind == "wrong_type":
            record["dispatch_version"] = str(record["dispatch_version"])
        elif kind == "empty_samples":
            record["samples"] = []
        elif kind == "span_start_outside":
            first.pop("token_versions", None)
            first["weight_versions"] = [[record["dispatch_version"], n]]
        if kind in ("label_above_t", "dispatch_above_t"):
            # Valid at add and at sweeps; invalid when the ship right after takes it.
            record.pop("completion_version", None)
            if kind == "dispatch_above_t":
                record["dispatch_version"] = self.now + 1
            else:
                first.pop("weight_versions", None)
                first["mask"] = [1, *first["mask"]]
                for name in ("rl_weights", "ce_weights", "ref_kl_weights", "logprobs", "trainer_logprobs"):
                    first.pop(name, None)
                first["token_versions"] = [self.now + 1] + [-1] * (len(first["mask"]) - 1)
            self.min_ship_step = saved
            self.add(record)
            self.ship(None, at=max(self.now, saved))
            return
        self.min_ship_step = saved
        self.add(record, valid=False)

    # -- sweeps and ships ------------------------------------------------------------------------
    def ship(self, ids: list[str] | None, at: int | None = None) -> None:
        self.now = max(self.now, self.min_ship_step) if at is None else at
        event: dict[str, Any] = {"type": "ship", "step": self.now}
        if ids is not None:
            event["ids"] = ids
        self.events.append(event)

    def partial_ids(self) -> list[str]:
        ch = self.ch
        if ch.chance(15):
            return [] if ch.chance(50) else [f"ghost{ch.integer(1, 9)}"]  # names nothing
        recent = self.ids[-8:]
        chosen = [i for i in recent if ch.chance(50)]
        if ch.chance(20):
            chosen.append(f"ghost{ch.integer(1, 9)}")
        if chosen and ch.chance(10):
            chosen.append(chosen[0])  # a repeated id
        if self.ids and ch.chance(15):
            chosen.append(self.ids[0])  # probably shipped or dropped long ago
        return chosen

    def build(self) -> list[dict[str, Any]]:
        ch = self.ch
        for _ in range(ch.integer(1, 7)):
            self.add_some()
            if ch.chance(40):
                self.events.append({"type": "sweep", "step": self.now})
                if ch.chance(15):
                    self.events.append({"type": "sweep", "step": self.now})  # changes nothing
                if ch.chance(30):
                    self.add_some()
            if ch.chance(80):
                self.ship(self.partial_ids() if ch.chance(35) else None)
                while ch.chance(20):  # several ships at one step, each with its own window
                    if ch.chance(50):
                        self.add_some()
                    self.ship(self.partial_ids() if ch.chance(50) else None)
            self.now += pick(ch, (0, 1, 1, 1, 2, 3))
        if ch.chance(70):
            self.ship(None)
        return self.events


def generate_events(chooser: Chooser, config: ReplayConfig, defects: int = 0) -> list[dict[str, Any]]:
    """A stream of events; ``defects`` invalid rollouts (one defect each) are mixed in when > 0."""
    return _StreamBuilder(chooser, config, defects).build()


def random_stream(
    seed: int, policy: str, lenient: bool = False, defects: int = 0
) -> tuple[ReplayConfig, list[dict[str, Any]]]:
    chooser = SeededChooser(seed)
    config = random_config(chooser, policy, lenient)
    return config, generate_events(chooser, config, defects)


@st.composite
def configs(draw: Any, policy: str | None = None, lenient: bool = False) -> ReplayConfig:
    chooser = DrawChooser(draw)
    chosen = policy if policy is not None else draw(st.sampled_from(("token", "episode", "group", "xtuner")))
    return random_config(chooser, chosen, lenient)


@st.composite
def event_streams(
    draw: Any, policy: str | None = None, lenient: bool = False, defects: int = 0
) -> tuple[ReplayConfig, list[dict[str, Any]]]:
    """Hypothesis strategy of (config, events); shrinks towards short streams with few features."""
    config = draw(configs(policy, lenient))
    return config, generate_events(DrawChooser(draw), config, defects)
