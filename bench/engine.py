"""Engine benchmark: ratios against baselines measured in the same run (no absolute targets).

    python bench/engine.py [--samples 1024] [--positions 8192] [--spans 4] [--repeat 5]

Reports, for ``token`` masking plus every metric of a ship on one batch:
- the ratio to one numpy pass that writes the same four float32 arrays (target: <= 2x);
- the per-position speed-up over a straightforward per-position Python implementation of the same
  rule, timed on a slice (target: >= 200x);
- the peak memory the engine allocates, relative to the input arrays (target: < 1.5x);
- for a right-padded [samples, positions] batch with per-token versions (AReaL's shape),
  ``RolloutBatch.from_padded`` alone and with the ship, each as a ratio to the dense multiply pass.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from staleness_metrics import RolloutBatch, Sink, StalenessConfig

FIELDS = ("mask", "rl_weights", "ce_weights", "ref_kl_weights")
MAX_STALENESS = 2
STEP = 11  # trains version 10; versions 0..7 are stale with max_staleness 2


def make_inputs(samples: int, positions: int, spans: int, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    total = samples * positions
    mask = np.ones(total, dtype=np.float32)
    prompt = positions // 8  # a prompt prefix that is not sampled
    mask.reshape(samples, positions)[:, :prompt] = 0
    starts = np.sort(rng.choice(np.arange(1, positions), size=(samples, spans - 1), replace=True), axis=1)
    starts = np.concatenate((np.zeros((samples, 1), dtype=np.int64), starts), axis=1)
    starts = np.array([np.unique(row) for row in starts], dtype=object)
    counts = np.array([len(row) for row in starts])
    dispatch = rng.integers(3, 8, size=samples)  # newest label: 7 + 3 = 10 = T
    versions = np.concatenate([d + np.arange(len(row)) for d, row in zip(dispatch, starts)])
    return {
        "ids": [f"r{i}" for i in range(samples)],
        "sample_offsets": np.arange(samples + 1),
        "position_offsets": np.arange(samples + 1) * positions,
        "dispatch_version": dispatch,
        "span_offsets": np.concatenate(([0], np.cumsum(counts))),
        "span_versions": versions,
        "span_starts": np.concatenate(list(starts)).astype(np.int64),
        "arrays": {name: mask.copy() if name == "mask" else rng.random(total, dtype=np.float32) for name in FIELDS},
    }


def fresh_batch(inputs: dict[str, Any]) -> RolloutBatch:
    arrays = {name: values.copy() for name, values in inputs["arrays"].items()}
    return RolloutBatch(
        ids=inputs["ids"],
        sample_offsets=inputs["sample_offsets"],
        position_offsets=inputs["position_offsets"],
        dispatch_version=inputs["dispatch_version"],
        span_offsets=inputs["span_offsets"],
        span_versions=inputs["span_versions"],
        span_starts=inputs["span_starts"],
        **arrays,
    )


def engine_run(batch: RolloutBatch) -> dict[str, float | int]:
    sink = Sink(StalenessConfig(policy="token", max_staleness=MAX_STALENESS))
    sink.add(batch)
    return dict(sink.ship(STEP).metrics)


def numpy_pass(arrays: dict[str, np.ndarray], keep: np.ndarray) -> None:
    for values in arrays.values():
        np.multiply(values, keep, out=values)


def putmask_pass(arrays: dict[str, np.ndarray], stale: np.ndarray) -> None:
    for values in arrays.values():
        np.putmask(values, stale, 0)


def python_rule(inputs: dict[str, Any], samples: int) -> dict[str, float]:
    """The same rule, one position at a time: what a straightforward implementation does."""
    arrays = {name: values.tolist() for name, values in inputs["arrays"].items()}
    offsets = inputs["position_offsets"].tolist()
    span_offsets, span_versions = inputs["span_offsets"].tolist(), inputs["span_versions"].tolist()
    span_starts = inputs["span_starts"].tolist()
    bound = STEP - 1 - MAX_STALENESS
    stale_sum = sampled = masked = 0
    histogram: dict[int, int] = {}
    for s in range(samples):
        lo, hi = offsets[s], offsets[s + 1]
        spans = list(
            zip(
                span_starts[span_offsets[s] : span_offsets[s + 1]], span_versions[span_offsets[s] : span_offsets[s + 1]]
            )
        )
        k = 0
        for p in range(lo, hi):
            while k + 1 < len(spans) and spans[k + 1][0] <= p - lo:
                k += 1
            version = spans[k][1]
            if arrays["mask"][p]:
                staleness = STEP - 1 - version
                sampled += 1
                stale_sum += staleness
                histogram[staleness] = histogram.get(staleness, 0) + 1
                if version < bound:
                    masked += 1
                    for name in FIELDS:
                        arrays[name][p] = 0.0
    return {"mean": stale_sum / sampled, "masked": masked / sampled}


def best_of(repeat: int, setup: Callable[[], Any], run: Callable[[Any], Any]) -> float:
    times = []
    for _ in range(repeat):
        state = setup()
        start = time.perf_counter()
        run(state)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--positions", type=int, default=8192)
    parser.add_argument("--spans", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--python-slice", type=int, default=8, help="samples timed for the per-position baseline")
    args = parser.parse_args()

    inputs = make_inputs(args.samples, args.positions, args.spans)
    total = args.samples * args.positions
    keep = np.ones(total, dtype=np.float32)
    stale = np.zeros(total, dtype=bool)
    stale[::3] = True

    numpy_time = best_of(args.repeat, lambda: {n: v.copy() for n, v in inputs["arrays"].items()},
                         lambda arrays: numpy_pass(arrays, keep))  # fmt: skip
    engine_time = best_of(args.repeat, lambda: fresh_batch(inputs), engine_run)
    python_time = best_of(1, lambda: None, lambda _: python_rule(inputs, args.python_slice))
    per_position_python = python_time / (args.python_slice * args.positions)
    per_position_engine = engine_time / total

    batch = fresh_batch(inputs)
    input_bytes = sum(getattr(batch, name).nbytes for name in FIELDS)
    tracemalloc.start()
    engine_run(batch)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    check = fresh_batch(inputs)
    metrics = engine_run(check)
    reference = python_rule(inputs, args.samples) if args.samples * args.positions <= 2_000_000 else None

    putmask_time = best_of(args.repeat, lambda: {n: v.copy() for n, v in inputs["arrays"].items()},
                           lambda arrays: putmask_pass(arrays, stale))  # fmt: skip
    speed_up = per_position_python / per_position_engine
    rows = [
        ("numpy pass writing four float32 arrays (multiply)", f"{numpy_time * 1e3:.1f} ms", ""),
        ("numpy masking of four arrays (putmask)", f"{putmask_time * 1e3:.1f} ms", ""),
        ("engine: token masking + all metrics", f"{engine_time * 1e3:.1f} ms",
         f"{engine_time / numpy_time:.2f}x the multiply pass (target <= 2x), "
         f"{engine_time / putmask_time:.2f}x the putmask pass"),
        (f"per-position Python ({args.python_slice} samples)", f"{per_position_python * 1e9:.0f} ns/position",
         f"engine {per_position_engine * 1e9:.2f} ns/position: {speed_up:.0f}x faster (target >= 200x)"),
        ("peak memory allocated by the engine", f"{peak / 2**20:.1f} MiB",
         f"{peak / input_bytes:.2f}x the input arrays (target < 1.5x)"),
    ]  # fmt: skip
    print(f"batch: {args.samples} samples x {args.positions} positions, {len(inputs['span_versions'])} spans")
    for name, value, ratio in rows:
        print(f"{name:<52} {value:>16}   {ratio}")
    print(f"token mean {metrics['staleness/token/mean']:.4f}, masked {metrics['staleness/token/masked']:.4f}")
    if reference is not None:
        assert abs(reference["mean"] - metrics["staleness/token/mean"]) < 1e-9, (reference, metrics)
        assert abs(reference["masked"] - metrics["staleness/token/masked"]) < 1e-12
        print("per-position Python agrees with the engine on the whole batch")


def padded_row(samples: int, positions: int, repeat: int, seed: int = 1) -> None:
    """``RolloutBatch.from_padded`` on a right-padded [samples, positions] batch with per-token versions
    (AReaL's shape), add and ship, against one dense numpy multiply pass over the same four arrays."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(positions // 2, positions + 1, size=samples)
    columns = np.arange(positions)
    valid = columns[None, :] < lengths[:, None]
    prompt = positions // 8
    mask = (valid & (columns[None, :] >= prompt)).astype(np.float32)
    dispatch = rng.integers(3, 8, size=samples)
    # versions rise by one every quarter of the row (4 spans); prompt -1, padding 0 as AReaL pads it
    versions = np.where(columns[None, :] < prompt, -1, dispatch[:, None] + columns[None, :] * 4 // positions)
    versions = np.where(valid, versions, 0).astype(np.int64)
    weights = {name: rng.random((samples, positions), dtype=np.float32) * mask for name in FIELDS[1:]}
    keep = np.ones((samples, positions), dtype=np.float32)

    def fresh() -> dict[str, np.ndarray]:
        return {"mask": mask.copy(), **{name: values.copy() for name, values in weights.items()}}

    def convert(arrays: dict[str, np.ndarray]) -> RolloutBatch:
        return RolloutBatch.from_padded(
            [f"p{i}" for i in range(samples)], arrays.pop("mask"), token_versions=versions, lengths=lengths, **arrays
        )

    def padded_run(arrays: dict[str, np.ndarray]) -> None:
        sink = Sink(StalenessConfig(policy="token", max_staleness=MAX_STALENESS))
        sink.add(convert(arrays))
        sink.ship(STEP)

    dense = best_of(repeat, fresh, lambda arrays: numpy_pass(arrays, keep))
    padded = best_of(repeat, fresh, padded_run)
    conversion = best_of(repeat, fresh, convert)
    for name, took in (
        (f"padded {samples} x {positions}: from_padded alone", conversion),
        (f"padded {samples} x {positions}: from_padded + ship", padded),
    ):
        print(f"{name:<52} {took * 1e3:>13.1f} ms   {took / dense:.2f}x the dense multiply pass ({dense * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
    padded_row(1024, 8192, 3)
