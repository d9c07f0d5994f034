"""Mismatch-sums benchmark (SPEC 11): the trainer-side call as a ratio to the dense numpy pass.

    python bench/mismatch.py [--samples 1024] [--positions 8192] [--repeat 5]

Times ``mismatch_sums(lags, sampler_logprobs, trainer_logprobs, masked)`` on one ``[samples, positions]``
batch (float32 log-probabilities, lags of a few versions in runs, a prompt prefix outside the population),
alternating with the baseline the engine bench uses: one numpy pass multiplying the four float32 arrays by
a precomputed keep vector. Goal: <= 1.5x. The ratio is measured in one process, never a wall-clock limit.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from staleness_metrics import mismatch_sums

GOAL = 1.5


def make_inputs(samples: int, positions: int, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    total = samples * positions
    lags = np.repeat(rng.integers(0, 6, size=samples * 4), positions // 4).astype(np.int64)
    lags.reshape(samples, positions)[:, : positions // 8] = -1  # prompt: not sampled
    sampler = rng.normal(-1.0, 0.5, total).astype(np.float32)
    trainer = (sampler + rng.normal(0.0, 0.05, total)).astype(np.float32)
    keep = (rng.random(total) < 0.9).astype(np.float32)
    arrays = {name: rng.random(total, dtype=np.float32) for name in ("mask", "rl", "ce", "ref_kl")}
    return {"lags": lags, "sampler": sampler, "trainer": trainer, "masked": keep == 0, "keep": keep, "arrays": arrays}


def best_of(repeat: int, run: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure(samples: int, positions: int, repeat: int) -> dict[str, float]:
    inputs = make_inputs(samples, positions)
    arrays, keep = inputs["arrays"], inputs["keep"]

    def dense() -> None:
        for values in arrays.values():
            np.multiply(values, keep, out=values)

    def sums() -> None:
        mismatch_sums(inputs["lags"], inputs["sampler"], inputs["trainer"], inputs["masked"])

    dense_times, sums_times = [], []
    for _ in range(repeat):  # alternate, so both see the same machine
        dense_times.append(best_of(1, dense))
        sums_times.append(best_of(1, sums))
    dense_s, sums_s = min(dense_times), min(sums_times)
    return {"positions": samples * positions, "dense_s": dense_s, "sums_s": sums_s, "ratio": sums_s / dense_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--positions", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args(argv)
    result = measure(args.samples, args.positions, args.repeat)
    if args.json:
        print(json.dumps({**result, "goal": GOAL}))
        return 0
    print(f"mismatch sums, {args.samples} x {args.positions} = {result['positions']:,} positions")
    print(f"  dense numpy pass      {result['dense_s'] * 1e3:8.2f} ms")
    print(f"  mismatch_sums         {result['sums_s'] * 1e3:8.2f} ms")
    print(f"  ratio                 {result['ratio']:8.2f}x   (goal <= {GOAL}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
