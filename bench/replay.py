"""Replay benchmark: positions per second end to end, and the ratio to decoding the JSON alone.

    python bench/replay.py [--positions 2000000] [--repeat 3] [--json]

Generates an event stream (rollouts of 1-2 samples of 256-1024 positions with a prompt of mask 0,
``weight_versions`` or ``token_versions`` labels, rl weights and log-probabilities; a ship every 64
rollouts) into a temporary file, then times, alternately in the same process:
- decoding every line with orjson into Python objects, nothing else (the goal's yardstick);
- parsing every line with simdjson, nothing else (what the replay reads rollout lines with: it copies
  the lists of numbers out of simdjson's tape, and decodes other lines with orjson);
- ``staleness-metrics replay FILE --metrics-out M --batches-out B`` run in process;
- ``staleness-metrics what-if FILE --max-staleness 0..8`` (nine bounds).
Goals: replay <= 3x the decoder alone; nine what-if bounds <= 2x one replay.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import simdjson

from staleness_metrics.cli import main as cli_main


def generate(path: Path, positions: int, seed: int = 0, per_ship: int = 64) -> int:
    """Write a stream of about ``positions`` positions, a ship every ``per_ship`` rollouts; returns how many
    positions were written."""
    rng = np.random.default_rng(seed)
    written = rollouts = 0
    step = 1
    with path.open("wb") as out:
        while written < positions:
            samples = []
            dispatch = max(0, step - 1 - int(rng.integers(0, 6)))
            for _ in range(int(rng.integers(1, 3))):
                n = int(rng.integers(256, 1025))
                prompt = n // 4
                mask = [0] * prompt + [1] * (n - prompt)
                sample: dict[str, Any] = {"mask": mask}
                if rng.random() < 0.5:
                    cuts = sorted({prompt, *rng.integers(prompt, n, size=2).tolist()})
                    sample["weight_versions"] = [[min(dispatch + k, step - 1), c] for k, c in enumerate(cuts)]
                else:
                    versions = np.full(n, dispatch)
                    versions[prompt + (n - prompt) // 2 :] = min(dispatch + 1, step - 1)
                    versions[rng.random(n) < 0.05] = -1
                    sample["token_versions"] = versions.tolist()
                sample["rl_weights"] = [float(m) for m in mask]
                sample["logprobs"] = np.round(-rng.random(n) * 3, 6).tolist()
                samples.append(sample)
                written += n
            record = {"id": f"r{rollouts}", "group_id": f"g{rollouts // 8}", "env": ("math", "code")[rollouts % 2],
                      "dispatch_version": dispatch, "samples": samples}  # fmt: skip
            out.write(orjson.dumps({"type": "rollout", "rollout": record}) + b"\n")
            rollouts += 1
            if rollouts % per_ship == 0:
                step += 1
                out.write(orjson.dumps({"type": "ship", "step": step}) + b"\n")
        out.write(orjson.dumps({"type": "ship", "step": step + 1}) + b"\n")
    return written


def decode_only(path: Path) -> None:
    with path.open("rb") as handle:
        for line in handle:
            orjson.loads(line)


def parse_only(path: Path) -> None:
    parser = simdjson.Parser()
    with path.open("rb") as handle:
        for line in handle:
            document = parser.parse(line)
            del document  # the parser is reused: no proxy of the last line may be left


def replay_once(path: Path, folder: Path) -> None:
    code = cli_main(["replay", str(path), "--metrics-out", str(folder / "m.jsonl"),
                     "--batches-out", str(folder / "b.jsonl"), "--no-progress"])  # fmt: skip
    assert code == 0


def what_if_once(path: Path) -> None:
    assert cli_main(["what-if", str(path), "--max-staleness", "0..8", "--json"]) == 0


def best(run: Any) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=2_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args()

    import contextlib
    import io

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = folder / "events.jsonl"
        positions = generate(path, args.positions)
        decode = parse = replay = what_if = math.inf
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            for _ in range(args.repeat):
                decode = min(decode, best(lambda: decode_only(path)))
                parse = min(parse, best(lambda: parse_only(path)))
                replay = min(replay, best(lambda: replay_once(path, folder)))
                what_if = min(what_if, best(lambda: what_if_once(path)))
        size = path.stat().st_size
    result = {
        "positions": positions,
        "bytes": size,
        "decode_seconds": decode,
        "parse_seconds": parse,
        "replay_seconds": replay,
        "what_if_seconds": what_if,
        "replay_positions_per_second": positions / replay,
        "replay_over_decode": replay / decode,
        "what_if_over_replay": what_if / replay,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"stream: {positions} positions, {size / 2**20:.0f} MiB")
    print(f"decode alone (orjson)          {decode:7.2f} s")
    print(f"parse alone (simdjson)         {parse:7.2f} s")
    print(f"replay --metrics-out --batches-out {replay:7.2f} s   {positions / replay / 1e6:.2f} M positions/s, "
          f"{replay / decode:.1f}x the decoder (goal <= 3x)")  # fmt: skip
    print(f"what-if 0..8 (nine bounds)     {what_if:7.2f} s   {what_if / replay:.1f}x one replay (goal <= 2x)")


if __name__ == "__main__":
    main()
