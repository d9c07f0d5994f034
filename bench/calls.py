"""Cost of a call against its work (issue 20): ratios measured turn about in one process.

    python bench/calls.py [--positions 2000000] [--repeat 3] [--json]

- **adds**: 64 rollouts of 1,024 positions (a prompt of mask 0, two ``token_versions`` labels, rl weights,
  log-probabilities) added one at a time (prime-rl's ``TrainSink.process_rollout`` adds per rollout) and
  shipped, against the same 64 added as one batch and shipped. Goal: <= 2x.
- **replay**: ``staleness-metrics replay FILE --metrics-out --batches-out`` of a stream that ships every
  3 rollouts (about 2,800 positions a ship: a run that ships every step) against decoding its JSON with
  orjson (goal <= 3x; also without outputs), against a stream of the same
  positions that ships every 512 (goal <= 2x), and the replay's
  positions per second against a per-position pure-Python replay (``tests/reference/spec_reference.py``,
  timed on the first ~100,000 positions of the stream; goal >= 8x).
- **what-if**: ``what-if FILE --max-staleness 0..8`` over one replay, on both streams. Goal: <= 2x. Also
  printed over the replay without outputs, on the small-ship stream.
- **envs**: a ship of 2N rollouts over N envs (two rollouts each) against one of N rollouts over N / 2 envs
  (``--envs N``, default 10,000): a ship's cost grows with its rollouts and envs, never with their product.
  Goal: <= 2.5x (x2 is linear).
- **import**: ``import staleness_metrics`` and ``from staleness_metrics import Sink`` in a fresh
  interpreter after ``import numpy``, against ``import numpy`` (goal: the first <= 1x).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.reference: the per-position replay
sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay import generate

from staleness_metrics import RolloutBatch, Sink, StalenessConfig
from staleness_metrics.cli import main as cli_main

ROLLOUTS, POSITIONS = 64, 1024
GOALS = {"adds": 2.0, "replay_small_over_big": 2.0, "replay_over_python": 8.0, "what_if": 2.0, "import": 1.0,
         "replay_small_over_decode": 3.0, "envs": 2.5}  # fmt: skip


def one_batch(ids: list[str], step: int) -> RolloutBatch:
    """``len(ids)`` rollouts of one sample of 1,024 positions, versions ``step - 2`` then ``step - 1``."""
    n = len(ids)
    mask = np.ones(n * POSITIONS, dtype=np.float32)
    mask.reshape(n, POSITIONS)[:, :128] = 0
    versions = np.full((n, POSITIONS), step - 2, dtype=np.int64)
    versions[:, 600:] = step - 1
    return RolloutBatch(
        ids=ids, sample_offsets=np.arange(n + 1), position_offsets=np.arange(n + 1) * POSITIONS, mask=mask,
        dispatch_version=np.full(n, step - 2), rl_weights=mask.copy(), token_versions=versions.ravel(),
        logprobs=np.linspace(-3, 0, n * POSITIONS, dtype=np.float32),
    )  # fmt: skip


def timed(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def adds(repeat: int) -> tuple[float, float]:
    """Best time of 64 single adds + ship, and of one add of 64 + ship (inputs built beforehand)."""
    config = StalenessConfig(policy="token", max_staleness=1)
    singles = together = math.inf
    for round_ in range(repeat * 10):
        step = 3 + round_
        parts = [one_batch([f"s{round_}-{i}"], step) for i in range(ROLLOUTS)]
        whole = one_batch([f"w{round_}-{i}" for i in range(ROLLOUTS)], step)
        sink = Sink(config)

        def add_singles(sink: Sink = sink, parts: list[RolloutBatch] = parts, step: int = step) -> None:
            for part in parts:
                sink.add(part)
            sink.ship(step)

        singles = min(singles, timed(add_singles))
        sink = Sink(config)
        together = min(together, timed(lambda sink=sink, whole=whole, step=step: (sink.add(whole), sink.ship(step))))
    return singles, together


def env_ship(rollouts: int, repeat: int) -> float:
    """Best time of a ship of ``rollouts`` rollouts of 4 positions, two per env, with the env breakdown."""
    n = rollouts
    best = math.inf
    for _ in range(repeat):
        batch = RolloutBatch(
            ids=[f"r{i}" for i in range(n)], sample_offsets=np.arange(n + 1), position_offsets=np.arange(n + 1) * 4,
            mask=np.ones(4 * n, np.float32), dispatch_version=np.arange(n) % 20, envs=[f"e{i // 2}" for i in range(n)],
        )  # fmt: skip
        sink = Sink(StalenessConfig(max_staleness=8, env_breakdown=True))
        sink.add(batch)
        best = min(best, timed(lambda sink=sink: sink.ship(21)))
    return best


def replay_once(path: Path, folder: Path) -> None:
    code = cli_main(["replay", str(path), "--metrics-out", str(folder / "m.jsonl"),
                     "--batches-out", str(folder / "b.jsonl"), "--no-progress"])  # fmt: skip
    assert code == 0


def replay_bare(path: Path) -> None:
    assert cli_main(["replay", str(path), "--no-progress"]) == 0


def decode_once(path: Path) -> None:
    with path.open("rb") as handle:
        for line in handle:
            orjson.loads(line)


def what_if_once(path: Path) -> None:
    assert cli_main(["what-if", str(path), "--max-staleness", "0..8", "--json"]) == 0


def python_replay_rate(path: Path, positions: int, repeat: int) -> float:
    """Seconds per position of the per-position pure-Python replay, on the stream's first lines (best of
    ``repeat`` runs)."""
    from tests.reference.spec_reference import replay_reference_lines

    lines, counted = [], 0
    with path.open() as handle:
        for line in handle:
            lines.append(line)
            event = json.loads(line)
            if event["type"] == "rollout":
                counted += sum(len(s["mask"]) for s in event["rollout"]["samples"])
            elif counted >= positions:
                break
    seconds = min(timed(lambda: replay_reference_lines(lines, policy="token", max_staleness=8)) for _ in range(repeat))
    return seconds / counted


def import_ratio(repeat: int) -> tuple[float, float, float]:
    code = (
        "import time; t = time.perf_counter(); import numpy; a = time.perf_counter() - t; "
        "t = time.perf_counter(); import staleness_metrics; b = time.perf_counter() - t; "
        "t = time.perf_counter(); from staleness_metrics import Sink; c = time.perf_counter() - t; print(a, b, c)"
    )
    best = [math.inf] * 3
    for _ in range(repeat * 3):
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
        best = [min(x, float(y)) for x, y in zip(best, out.split())]
    return best[0], best[1], best[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=2_000_000)
    parser.add_argument("--python-positions", type=int, default=100_000)
    parser.add_argument("--per-ship", type=int, default=3, help="rollouts per ship of the many-small-ships stream")
    parser.add_argument("--envs", type=int, default=10_000, help="envs of the smaller ship of the envs measure")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    singles, together = adds(args.repeat)
    env_ship(64, 1)  # (the compiled loops loaded)
    fewer_envs, more_envs = env_ship(2 * args.envs, args.repeat), env_ship(4 * args.envs, args.repeat)
    numpy_import, package_import, sink_import = import_ratio(args.repeat)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        small, big = folder / "small.jsonl", folder / "big.jsonl"
        positions = generate(small, args.positions, per_ship=args.per_ship)
        generate(big, args.positions, per_ship=512)
        names = ("decode_small", "replay_small_bare", "replay_small", "replay_big", "what_if_small", "what_if_big")
        times = dict.fromkeys(names, math.inf)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            for _ in range(args.repeat):
                times["decode_small"] = min(times["decode_small"], timed(lambda: decode_once(small)))
                times["replay_small_bare"] = min(times["replay_small_bare"], timed(lambda: replay_bare(small)))
                times["replay_small"] = min(times["replay_small"], timed(lambda: replay_once(small, folder)))
                times["replay_big"] = min(times["replay_big"], timed(lambda: replay_once(big, folder)))
                times["what_if_small"] = min(times["what_if_small"], timed(lambda: what_if_once(small)))
                times["what_if_big"] = min(times["what_if_big"], timed(lambda: what_if_once(big)))
        python_per_position = python_replay_rate(small, args.python_positions, args.repeat)
    result = {
        "positions": positions,
        "per_ship": args.per_ship,
        "adds_singles_seconds": singles,
        "adds_together_seconds": together,
        "adds_ratio": singles / together,
        **{f"{k}_seconds": v for k, v in times.items()},
        "replay_small_over_decode": times["replay_small"] / times["decode_small"],
        "replay_small_bare_over_decode": times["replay_small_bare"] / times["decode_small"],
        "replay_small_over_big": times["replay_small"] / times["replay_big"],
        "replay_over_python": python_per_position * positions / times["replay_small"],
        "what_if_small_over_replay": times["what_if_small"] / times["replay_small"],
        "what_if_small_over_bare_replay": times["what_if_small"] / times["replay_small_bare"],
        "what_if_big_over_replay": times["what_if_big"] / times["replay_big"],
        "envs": args.envs,
        "envs_seconds": fewer_envs,
        "twice_the_envs_seconds": more_envs,
        "envs_ratio": more_envs / fewer_envs,
        "import_numpy_seconds": numpy_import,
        "import_package_seconds": package_import,
        "import_sink_seconds": sink_import,
        "import_ratio": package_import / numpy_import,
        "import_sink_ratio": sink_import / numpy_import,
        "goals": GOALS,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"64 single adds + ship / one add of 64 + ship: {singles * 1e3:.1f} / {together * 1e3:.1f} ms = "
        f"{result['adds_ratio']:.1f}x (goal <= 2x)"
    )
    print(
        f"replay (ship every {args.per_ship}) / decoding its JSON: {result['replay_small_over_decode']:.1f}x with "
        f"--metrics-out and --batches-out, {result['replay_small_bare_over_decode']:.1f}x without (goal <= 3x)"
    )
    print(
        f"replay, a ship every {args.per_ship} / every 512 rollouts ({positions} positions): "
        f"{times['replay_small']:.2f} / "
        f"{times['replay_big']:.2f} s = {result['replay_small_over_big']:.1f}x (goal <= 2x)"
    )
    print(
        f"replay (ship every {args.per_ship}) over a per-position Python replay: "
        f"{result['replay_over_python']:.0f}x faster (goal >= 8x)"
    )
    print(
        f"what-if 0..8 / one replay: every {args.per_ship} {result['what_if_small_over_replay']:.1f}x, every 512 "
        f"{result['what_if_big_over_replay']:.1f}x (goal <= 2x); every {args.per_ship}, over the replay without "
        f"outputs: {result['what_if_small_over_bare_replay']:.1f}x"
    )
    print(
        f"a ship over {2 * args.envs} envs / over {args.envs} envs (twice the rollouts): {more_envs:.2f} / "
        f"{fewer_envs:.2f} s = {result['envs_ratio']:.1f}x (goal <= 2.5x; 2x is linear)"
    )
    print(f"import staleness_metrics / import numpy: {package_import * 1e3:.1f} / {numpy_import * 1e3:.0f} ms = "
          f"{result['import_ratio']:.2f}x (goal <= 1x); from staleness_metrics import Sink: "
          f"{result['import_sink_ratio']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
