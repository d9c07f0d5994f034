"""Engine benchmark: add + ship, as ratios to a dense numpy pass timed alternately in the same run.

    python bench/engine.py [--scale 1.0] [--repeat 5] [--clock wall|cpu] [--only TEXT] [--json]

The dense pass is one numpy pass multiplying the four float32 arrays (mask, rl, ce and ref-KL weights)
by a precomputed keep vector: the least any masking of those arrays can cost. Each row adds one batch
to a fresh sink and ships it (``token`` masking, or ``xtuner`` with ``max_token_staleness``, plus every
metric), timed alternately with the dense pass on arrays of the same size; a row's ratio is the best
engine time over the best dense time. Goals: <= 3x under ``token``, <= 4x under ``xtuner``.

Workloads (``--scale`` multiplies the number of samples, for quick runs):
- spans: 1024 samples x 8192 positions, 4 ``weight_versions`` spans each;
- token_versions 8192 x 1024 and 1024 x 8192, with 0%, 1%, 10% and 50% of positions unlabelled (-1)
  at random, the labels otherwise those of the spans;
- the same 8192 x 1024 with GRPO groups of 16 and 3 envs;
- a right-padded [1024, 8192] batch with per-token versions (AReaL's shape) through
  ``RolloutBatch.from_padded`` + add + ship, and ``from_padded`` alone.
Every sample starts with a prompt of mask 0. Then the per-position speed-up over a straightforward
per-position Python implementation of the ``token`` rule, and the peak memory the engine allocates.

``--clock cpu`` times the process's CPU time (every thread's) instead of the wall clock: on a shared
machine, what the engine itself spends. ``--only TEXT`` runs the workloads whose name holds ``TEXT``
(e.g. ``"8192 x 1024, "``), without the padded, per-position and memory rows.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any

import numpy as np

from staleness_metrics import RolloutBatch, Sink, StalenessConfig

FIELDS = ("mask", "rl_weights", "ce_weights", "ref_kl_weights")
STEP = 11  # trains version 10; labels run from 3 to 10
CONFIGS = {
    "token": StalenessConfig(policy="token", max_staleness=2),  # masks versions below 8
    "xtuner": StalenessConfig(policy="xtuner", max_staleness=8, max_token_staleness=2),  # masks below 8, no expiry
}
GOALS = {"token": 3.0, "xtuner": 4.0}
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


@dataclass(frozen=True)
class Workload:
    name: str
    samples: int
    positions: int
    labels: str  # "spans" or "tokens"
    unlabelled: float = 0.0
    groups: bool = False


UNLABELLED = (0, 0.01, 0.1, 0.5)
WORKLOADS = (
    Workload("spans 1024 x 8192", 1024, 8192, "spans"),
    *(Workload(f"token_versions 8192 x 1024, {p:.0%} unlabelled", 8192, 1024, "tokens", p) for p in UNLABELLED),
    *(Workload(f"token_versions 1024 x 8192, {p:.0%} unlabelled", 1024, 8192, "tokens", p) for p in UNLABELLED),
    Workload("token_versions 8192 x 1024, groups of 16, 3 envs", 8192, 1024, "tokens", 0.0, groups=True),
)  # fmt: skip


def make_inputs(work: Workload, samples: int, seed: int = 0) -> dict[str, Any]:
    """Arrays of one workload: 4 version spans per sample (dispatch version, then newer ones)."""
    rng = np.random.default_rng(seed)
    n = work.positions
    total = samples * n
    mask = np.ones(total, dtype=np.float32)
    mask.reshape(samples, n)[:, : n // 8] = 0  # the prompt
    cuts = np.sort(rng.integers(1, n, size=(samples, 3)), axis=1)
    dispatch = rng.integers(3, 8, size=samples)
    inputs: dict[str, Any] = {
        "ids": [f"r{i}" for i in range(samples)],
        "sample_offsets": np.arange(samples + 1),
        "position_offsets": np.arange(samples + 1) * n,
        "dispatch_version": dispatch,
        "arrays": {name: mask.copy() if name == "mask" else rng.random(total, dtype=np.float32) for name in FIELDS},
    }
    if work.labels == "spans":
        starts = [np.unique(np.concatenate(([0], row))) for row in cuts]
        inputs["span_offsets"] = np.concatenate(([0], np.cumsum([len(s) for s in starts])))
        inputs["span_versions"] = np.concatenate([d + np.arange(len(s)) for d, s in zip(dispatch, starts)])
        inputs["span_starts"] = np.concatenate(starts).astype(np.int64)
    else:
        steps = (np.arange(n)[None, :, None] >= cuts[:, None, :]).sum(axis=2)
        tokens = (dispatch[:, None] + steps).ravel().astype(np.int64)
        tokens[rng.random(total) < work.unlabelled] = -1
        inputs["token_versions"] = tokens
    if work.groups:
        inputs["group_ids"] = [f"g{i // 16}" for i in range(samples)]
        inputs["envs"] = [("math", "code", "chat")[i % 3] for i in range(samples)]
    return inputs


def fresh_batch(inputs: dict[str, Any]) -> RolloutBatch:
    arrays = {name: values.copy() for name, values in inputs["arrays"].items()}
    columns = {k: v for k, v in inputs.items() if k != "arrays"}
    return RolloutBatch(**columns, **arrays)


def engine_run(batch: RolloutBatch, config: StalenessConfig) -> dict[str, float | int]:
    sink = Sink(config)
    sink.add(batch)
    return dict(sink.ship(STEP).metrics)


def dense_pass(arrays: dict[str, np.ndarray], keep: np.ndarray) -> None:
    for values in arrays.values():
        np.multiply(values, keep, out=values)


def alternate(repeat: int, inputs: dict[str, Any], config: StalenessConfig) -> tuple[float, float]:
    """Best engine time and best dense-pass time, measured turn about."""
    keep = np.ones(len(inputs["arrays"]["mask"]), dtype=np.float32)
    engine, dense = math.inf, math.inf
    for _ in range(repeat):
        batch = fresh_batch(inputs)
        start = clock()
        engine_run(batch, config)
        engine = min(engine, clock() - start)
        arrays = {name: values.copy() for name, values in inputs["arrays"].items()}
        start = clock()
        dense_pass(arrays, keep)
        dense = min(dense, clock() - start)
    return engine, dense


def padded_ratios(samples: int, positions: int, repeat: int, seed: int = 1) -> dict[str, float]:
    """``from_padded`` + add + ship of a right-padded [samples, positions] batch (per-token versions, a
    prompt labelled -1, padding 0 as AReaL pads it) per policy, and ``from_padded`` alone, each over the
    dense pass on the same four [samples, positions] arrays, timed turn about."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(positions // 2, positions + 1, size=samples)
    columns = np.arange(positions)
    valid = columns[None, :] < lengths[:, None]
    prompt = positions // 8
    mask = (valid & (columns[None, :] >= prompt)).astype(np.float32)
    dispatch = rng.integers(3, 8, size=samples)
    versions = np.where(columns[None, :] < prompt, -1, dispatch[:, None] + columns[None, :] * 4 // positions)
    versions = np.where(valid, versions, 0).astype(np.int64)
    weights = {name: rng.random((samples, positions), dtype=np.float32) * mask for name in FIELDS[1:]}
    keep = np.ones((samples, positions), dtype=np.float32)
    ids = [f"p{i}" for i in range(samples)]

    def fresh() -> dict[str, np.ndarray]:
        return {"mask": mask.copy(), **{name: values.copy() for name, values in weights.items()}}

    out: dict[str, float] = {}
    for name, config in (("alone", None), *CONFIGS.items()):
        took, dense = math.inf, math.inf
        for _ in range(repeat):
            arrays = fresh()  # the caller's arrays, masked in place: copied before the clock starts
            start = clock()
            batch = RolloutBatch.from_padded(
                ids, arrays.pop("mask"), token_versions=versions, lengths=lengths, **arrays
            )
            if config is not None:
                engine_run(batch, config)
            took = min(took, clock() - start)
            arrays = fresh()
            start = clock()
            dense_pass(arrays, keep)
            dense = min(dense, clock() - start)
        out[name] = took / dense
    return out


def python_rule(inputs: dict[str, Any], samples: int, positions: int) -> dict[str, float]:
    """The ``token`` rule one position at a time: what a straightforward implementation does."""
    arrays = {name: values[: samples * positions].tolist() for name, values in inputs["arrays"].items()}
    versions = inputs["token_versions"][: samples * positions].tolist()
    dispatch = inputs["dispatch_version"].tolist()
    trained = STEP - 1
    bound = trained - CONFIGS["token"].max_staleness
    stale_sum = sampled = masked = 0
    histogram: dict[int, int] = {}
    for s in range(samples):
        for p in range(s * positions, (s + 1) * positions):
            version = versions[p] if versions[p] >= 0 else dispatch[s]
            if arrays["mask"][p]:
                staleness = trained - version
                sampled += 1
                stale_sum += staleness
                histogram[staleness] = histogram.get(staleness, 0) + 1
                if version < bound:
                    masked += 1
                    for name in FIELDS:
                        arrays[name][p] = 0.0
    return {"mean": stale_sum / sampled, "masked": masked / sampled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the samples of each workload")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--python-samples", type=int, default=8, help="samples timed for the per-position baseline")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall", help="wall time or process CPU time")
    parser.add_argument("--only", default="", help="run only the workloads whose name holds this text")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]

    rows = []
    for work in WORKLOADS:
        if args.only not in work.name:
            continue
        samples = max(1, round(work.samples * args.scale))
        inputs = make_inputs(work, samples)
        ratios = {}
        for policy, config in CONFIGS.items():
            engine, dense = alternate(args.repeat, inputs, config)
            ratios[policy] = engine / dense
        rows.append({"workload": work.name, "samples": samples, "positions": work.positions, **ratios})
        if not args.json:
            print(f"{work.name:<52} {ratios['token']:6.2f}x {ratios['xtuner']:6.2f}x", flush=True)
    if args.only:
        if args.json:
            print(json.dumps({"rows": rows, "clock": args.clock, "goals": GOALS}))
        return

    padded_samples = max(1, round(1024 * args.scale))
    padded = padded_ratios(padded_samples, 8192, args.repeat)
    name = f"padded {1024} x {8192} (from_padded + add + ship)"
    rows.append({"workload": name, "samples": padded_samples, "positions": 8192,
                 "token": padded["token"], "xtuner": padded["xtuner"]})  # fmt: skip
    if not args.json:
        print(f"{name:<52} {padded['token']:6.2f}x {padded['xtuner']:6.2f}x", flush=True)

    # Per-position speed-up, on the 10%-unlabelled token_versions workload.
    work = WORKLOADS[3]
    samples = max(1, round(work.samples * args.scale))
    inputs = make_inputs(work, samples)
    engine, _ = alternate(args.repeat, inputs, CONFIGS["token"])
    python_samples = min(args.python_samples, samples)
    start = clock()
    python_rule(inputs, python_samples, work.positions)
    python = (clock() - start) / (python_samples * work.positions)
    speed_up = python / (engine / (samples * work.positions))
    metrics = engine_run(fresh_batch(inputs), CONFIGS["token"])
    reference = python_rule(inputs, samples, work.positions) if samples * work.positions <= 2_000_000 else None
    if reference is not None:  # the naive rule and the engine agree on the whole batch
        assert abs(reference["mean"] - metrics["staleness/token/mean"]) < 1e-9, (reference, metrics)
        assert abs(reference["masked"] - metrics["staleness/token/masked"]) < 1e-12

    batch = fresh_batch(make_inputs(WORKLOADS[0], max(1, round(WORKLOADS[0].samples * args.scale))))
    input_bytes = sum(getattr(batch, name).nbytes for name in FIELDS)
    tracemalloc.start()
    engine_run(batch, CONFIGS["token"])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    result = {
        "rows": rows,
        "from_padded_alone": padded["alone"],
        "python_speed_up": speed_up,
        "peak_memory_ratio": peak / input_bytes,
        "clock": args.clock,
        "goals": GOALS,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'per-position speed-up over per-position Python (token, 10% unlabelled)':<60} {speed_up:9.0f}x")
    print(f"{'peak memory the engine allocates / the input arrays (spans)':<60} {peak / input_bytes:9.2f}x")
    print(f"{'from_padded alone (padded 1024 x 8192) / the dense pass':<60} {padded['alone']:9.2f}x")
    print()
    print(format_table(result))


def format_table(result: dict[str, Any]) -> str:
    """The results as a Markdown table (the README's)."""
    lines = ["| workload (add + ship) / dense pass | `token` (goal <= 3x) | `xtuner` (goal <= 4x) |", "|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['workload']} | {row['token']:.1f}x | {row['xtuner']:.1f}x |")
    lines.append(f"| from_padded alone, padded 1024 x 8192 | {result['from_padded_alone']:.1f}x | |")
    lines.append(f"| per-position speed-up over a per-position Python loop | {result['python_speed_up']:.0f}x | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
