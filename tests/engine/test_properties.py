"""Property tests: metrics recomputed naively from the shipped batches equal the reported metrics.

The engine's metrics come from span reductions over its own decision; here they are recomputed per
position, in plain Python, from what the ship actually handed over (the masked arrays) and the
rollouts as they were added. Any disagreement between the masking and the metrics shows up here.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from staleness_metrics import Sink, StalenessConfig

# The strategies are built once, here, not inside each draw: the draws and the examples are the same,
# without hypothesis building and validating a strategy per drawn sample (most of this test's time).
LENGTHS = st.integers(0, 7)
MASK_BITS = st.integers(0, 1)
LABEL_KINDS = st.sampled_from(["none", "spans", "tokens"])
WEIGHT_VALUES = st.sampled_from([0.0, 0.5, 1.0])
MAX_DISPATCH = 8
MAX_EVENTS = 25
# per dispatch version: a version label drawn around it, or -1 (none)
LABELS = [st.integers(max(dispatch - 3, 0), dispatch + 3) | st.just(-1) for dispatch in range(MAX_DISPATCH + 1)]


@st.composite
def samples(draw: st.DrawFn, dispatch: int) -> dict[str, Any]:
    n = draw(LENGTHS)
    sample: dict[str, Any] = {"mask": draw(st.lists(MASK_BITS, min_size=n, max_size=n))}
    kind = draw(LABEL_KINDS)
    if kind == "tokens":
        sample["token_versions"] = draw(st.lists(LABELS[dispatch], min_size=n, max_size=n))
    elif kind == "spans" and n:
        starts = sorted(draw(st.sets(st.integers(0, n - 1), max_size=3)))
        sample["weight_versions"] = [[draw(LABELS[dispatch]), s] for s in starts]
    for name in ("rl_weights", "ce_weights", "ref_kl_weights"):
        if draw(st.booleans()):
            sample[name] = draw(st.lists(WEIGHT_VALUES, min_size=n, max_size=n))
    return sample


DISPATCHES = st.integers(0, MAX_DISPATCH)
SAMPLE_LISTS = [st.lists(samples(dispatch), min_size=1, max_size=3) for dispatch in range(MAX_DISPATCH + 1)]
GROUPS = st.sampled_from(["g1", "g2", "g3"])
ONE_IN_TEN = st.integers(0, 9)
COMPLETION_LAGS = st.integers(0, 3)
ENVS = st.sampled_from([None, "math", "code"])


@st.composite
def rollouts(draw: st.DrawFn, rid: str) -> dict[str, Any]:
    dispatch = draw(DISPATCHES)
    record: dict[str, Any] = {"id": rid, "dispatch_version": dispatch}
    record["samples"] = draw(SAMPLE_LISTS[dispatch])
    if draw(st.booleans()):
        record["group_id"] = draw(GROUPS)
    if draw(ONE_IN_TEN) == 0:
        record["source"] = "frozen"
    if draw(ONE_IN_TEN) == 0:
        record["agentic"] = True
    if draw(st.booleans()):
        record["completion_version"] = dispatch + draw(COMPLETION_LAGS)
    env = draw(ENVS)
    if env:
        record["env"] = env
    return record


ROLLOUTS = [rollouts(f"r{i}") for i in range(MAX_EVENTS)]
FIRST_STEPS = st.integers(1, 4)
EVENT_COUNTS = st.integers(1, MAX_EVENTS)
EVENT_KINDS = st.integers(0, 9)
STEP_GAPS = st.integers(0, 2)


@st.composite
def streams(draw: st.DrawFn) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    step = draw(FIRST_STEPS)
    for i in range(draw(EVENT_COUNTS)):
        choice = draw(EVENT_KINDS)
        if choice < 6:
            events.append({"type": "rollout", "rollout": draw(ROLLOUTS[i])})
        else:
            step += draw(STEP_GAPS)
            kind = "sweep" if choice == 6 else "ship"
            event: dict[str, Any] = {"type": kind, "step": step}
            if kind == "ship" and draw(st.booleans()):
                event["ids"] = [f"r{j}" for j in draw(st.sets(st.integers(0, i + 1), max_size=4))]
            events.append(event)
    events.append({"type": "ship", "step": step + draw(STEP_GAPS)})
    return events


def versions_of(record: dict[str, Any], sample: dict[str, Any]) -> list[int]:
    n = len(sample["mask"])
    labels = [-1] * n
    if "token_versions" in sample:
        labels = list(sample["token_versions"])
    for k, (version, start) in enumerate(sample.get("weight_versions", [])):
        end = sample["weight_versions"][k + 1][1] if k + 1 < len(sample["weight_versions"]) else n
        labels[start:end] = [version] * (end - start)
    return [record["dispatch_version"] if v == -1 else v for v in labels], [v == -1 for v in labels]


def naive_metrics(
    line: dict[str, Any], added: dict[str, dict[str, Any]], dropped_before: set[tuple[str, int]], max_staleness: int
) -> dict[str, Any]:
    t = line["step"] - 1
    stale: list[int] = []
    masked = unlabelled = 0
    rollout_stats: list[tuple[int, int, int, int]] = []
    for shipped in line["shipped"]:
        original = added[shipped["id"]]
        if original.get("source") == "frozen":
            continue
        kept = [k for k in range(len(original["samples"])) if (shipped["id"], k) not in dropped_before]
        assert len(kept) == len(shipped["samples"])
        oldest = None
        newest = None  # newest shipped sampled version (staleness/rollout/newest)
        newest_all = None
        for sample in original["samples"]:
            versions, _ = versions_of(original, sample)
            for v, m in zip(versions, sample["mask"]):
                if m:
                    newest_all = v if newest_all is None else max(newest_all, v)
        for k, out in zip(kept, shipped["samples"]):
            sample = original["samples"][k]
            versions, unl = versions_of(original, sample)
            for v, u, before, after in zip(versions, unl, sample["mask"], out["mask"]):
                if before:
                    stale.append(t - v)
                    masked += after == 0
                    unlabelled += u
                    oldest = v if oldest is None else min(oldest, v)
                    newest = v if newest is None else max(newest, v)
        oldest = original["dispatch_version"] if oldest is None else oldest
        newest = original["dispatch_version"] if newest is None else newest
        completion = original.get(
            "completion_version", newest_all if newest_all is not None else original["dispatch_version"]
        )
        r = t - oldest
        f = min(max(completion - oldest, 0), r)
        rollout_stats.append((r, f, r - f, t - newest))
    out: dict[str, Any] = {}
    if stale:
        n = len(stale)
        ordered = sorted(stale)
        out["staleness/token/mean"] = float(Fraction(sum(stale), n))
        out["staleness/token/masked"] = float(Fraction(masked, n))
        out["staleness/token/unlabelled"] = float(Fraction(unlabelled, n))
        for name, p in (("p50", 50), ("p90", 90), ("p99", 99)):
            out[f"staleness/token/{name}"] = ordered[max(1, -(-p * n // 100)) - 1]
    if rollout_stats:
        for index, key in enumerate(("", "in_flight/", "in_queue/", "newest/")):
            values = [s[index] for s in rollout_stats]
            out[f"staleness/rollout/{key}mean"] = float(Fraction(sum(values), len(values)))
            out[f"staleness/rollout/{key}max"] = max(values)
    out.update(naive_length_bias(line, added, dropped_before))
    out["staleness/rollout/dropped"] = len(line["dropped_rollouts"])
    out["staleness/sample/dropped"] = len(line["dropped_samples"])
    out["staleness/rollout/held"] = len(line["held"])
    out["staleness/max_staleness"] = max_staleness
    return out


LENGTH_BUCKETS = ((256, "256"), (1024, "1k"), (4096, "4k"), (16384, "16k"), (None, "inf"))


def naive_length_bias(
    line: dict[str, Any], added: dict[str, dict[str, Any]], dropped_before: set[tuple[str, int]]
) -> dict[str, Any]:
    """SPEC 12 recounted per position: shipped samples as masked, the window's dropped samples as removed."""
    lengths: list[tuple[int, int]] = []  # (sampled positions, of which masked or dropped)
    for shipped in line["shipped"]:
        original = added[shipped["id"]]
        if original.get("source") == "frozen":
            continue
        kept = [k for k in range(len(original["samples"])) if (shipped["id"], k) not in dropped_before]
        for k, out in zip(kept, shipped["samples"]):
            arrived = original["samples"][k]["mask"]
            lengths.append((sum(arrived), sum(1 for a, b in zip(arrived, out["mask"]) if a and not b)))
    for rid, k in line["dropped_samples"]:
        n = sum(added[rid]["samples"][k]["mask"])
        lengths.append((n, n))
    if not lengths:
        return {}
    out: dict[str, Any] = {
        "staleness/length/sampled/mean": float(Fraction(sum(n for n, _ in lengths), len(lengths))),
        "staleness/length/trained/mean": float(Fraction(sum(n - gone for n, gone in lengths), len(lengths))),
    }
    for index, (top, name) in enumerate(LENGTH_BUCKETS):
        low = 1 if index == 0 else LENGTH_BUCKETS[index - 1][0] + 1  # type: ignore[operator]
        inside = [(n, gone) for n, gone in lengths if n >= low and (top is None or n <= top)]
        if inside:
            out[f"staleness/length/bucket_{name}/masked"] = float(
                Fraction(sum(g for _, g in inside), sum(n for n, _ in inside))
            )
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=streams(),
    policy=st.sampled_from(["token", "episode", "group", "xtuner"]),
    max_staleness=st.integers(0, 4),
    retry=st.booleans(),
    token_bound=st.none() | st.integers(0, 3),
    compact=st.booleans(),
)
def test_metrics_equal_a_naive_recount_of_the_shipped_batches(
    events: list[dict[str, Any]], policy: str, max_staleness: int, retry: bool, token_bound: int | None, compact: bool
) -> None:
    extra: dict[str, Any] = {}
    if policy == "xtuner":
        extra = {"retry_expired": retry, "max_token_staleness": token_bound}
    config = StalenessConfig(policy=policy, max_staleness=max_staleness, strict=False, **extra)  # type: ignore[arg-type]
    sink = Sink(config, compact_min_rows=0 if compact else 4096)  # compaction must not change a thing
    added: dict[str, dict[str, Any]] = {}
    dropped_samples: set[tuple[str, int]] = set()
    entered = 0
    for event in events:
        if event["type"] == "rollout":
            record = event["rollout"]
            if sink.add(record):
                added[record["id"]] = record
                if record.get("source") != "frozen":
                    entered += sum(sum(s["mask"]) for s in record["samples"])
        elif event["type"] == "sweep":
            sink.sweep(event["step"])
        else:
            shipment = sink.ship(event["step"], event.get("ids"))
            line = shipment.batches_line()
            dropped_samples |= {(rid, k) for rid, k in line["dropped_samples"]}
            expected = naive_metrics(line, added, dropped_samples, max_staleness)
            note(f"{events=}\n{line=}")
            assert dict(shipment.metrics) == expected
            if policy == "token":  # the masked positions are exactly those older than the bound
                bound = event["step"] - 1 - max_staleness
                for shipped in line["shipped"]:
                    original = added[shipped["id"]]
                    kept = [k for k in range(len(original["samples"])) if (shipped["id"], k) not in dropped_samples]
                    for k, out in zip(kept, shipped["samples"]):
                        versions, _ = versions_of(original, original["samples"][k])
                        frozen = original.get("source") == "frozen"
                        expected_mask = [
                            int(m and (frozen or v >= bound)) for v, m in zip(versions, original["samples"][k]["mask"])
                        ]
                        assert out["mask"] == expected_mask
            for rid, _ in line["dropped_samples"]:
                assert added[rid].get("source") != "frozen"
    # conservation: every sampled position that entered is shipped (trained or masked), dropped or queued
    totals = sink.totals
    set_aside_at_ship = entered - sink.tokens_entered  # version above T when a ship took them
    assert set_aside_at_ship >= 0
    assert totals.tokens_sampled + totals.tokens_dropped + sink.tokens_queued == sink.tokens_entered
