"""Run ``staleness-metrics replay`` on an event stream and compare its output files with the reference.

``run_cli_in_process`` calls ``staleness_metrics.cli.main`` (fast, for many streams); ``run_cli_subprocess``
runs ``python -m staleness_metrics.cli`` or the ``staleness-metrics`` console script (what a user runs).
``differences`` returns human-readable lines, empty when the CLI agrees with the reference.

From the project root: ``python -m tests.reference.compare EVENTS.jsonl --policy token --max-staleness 2``
prints the differences for one stream file.
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
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .spec_reference import (
    ReferenceEventError,
    ReferenceTraceError,
    parse_rollout,
    replay_reference_lines,
)
from .streams import ReplayConfig

PROJECT_ROOT = Path(__file__).resolve().parents[2]
INT_KEYS = (
    "max", "p50", "p90", "p99", "dropped", "held", "max_staleness", "tokens", "floor_age", "suggested", "crossed",
)  # fmt: skip
FLOAT_KEYS = (
    "mean", "masked", "unlabelled", "k3", "excess_k3", "abs_log_ratio", "out_of_band", "ess", "coverage", "floor",
    "budget", "excess_at_bound", *(f"lag_{lag}" for lag in range(1, 17)),  # the last part of curve/lag_<b>
)  # fmt: skip
STRING_KEYS = ("floor_source",)
BATCH_KEYS = {"step", "shipped", "dropped_rollouts", "dropped_samples", "held"}


@dataclass
class CliResult:
    code: int
    stderr: str
    metrics: list[dict[str, Any]] | None  # None when the file was not written
    batches: list[dict[str, Any]] | None


def write_events(events: list[dict[str, Any]], path: Path) -> list[str]:
    lines = [json.dumps(event) for event in events]
    path.write_text("".join(line + "\n" for line in lines))
    return lines


def _read_jsonl(path: Path) -> list[dict[str, Any]] | None:
    if not path.exists():
        return None
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def replay_argv(events_path: Path, config: ReplayConfig, out_dir: Path) -> list[str]:
    return [
        "replay",
        str(events_path),
        *config.cli_args(),
        "--metrics-out",
        str(out_dir / "metrics.jsonl"),
        "--batches-out",
        str(out_dir / "batches.jsonl"),
    ]


def run_cli_in_process(events_path: Path, config: ReplayConfig, out_dir: Path) -> CliResult:
    from staleness_metrics.cli import main

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(replay_argv(events_path, config, out_dir))
        except SystemExit as exit_:  # argparse errors exit through SystemExit
            code = exit_.code if isinstance(exit_.code, int) else 1
    return CliResult(
        code,
        stderr.getvalue(),
        _read_jsonl(out_dir / "metrics.jsonl"),
        _read_jsonl(out_dir / "batches.jsonl"),
    )


def run_cli_subprocess(
    events_path: Path, config: ReplayConfig, out_dir: Path, console_script: bool = False
) -> CliResult:
    if console_script:
        command = [str(Path(sys.executable).parent / "staleness-metrics")]
    else:
        command = [sys.executable, "-m", "staleness_metrics.cli"]
    done = subprocess.run(
        [*command, *replay_argv(events_path, config, out_dir)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    return CliResult(
        done.returncode,
        done.stderr,
        _read_jsonl(out_dir / "metrics.jsonl"),
        _read_jsonl(out_dir / "batches.jsonl"),
    )


# ---------------------------------------------------------------------------------------------- compare


def _key_kind(key: str) -> str:
    last = key.rsplit("/", 1)[-1]
    if key == "step" or last in INT_KEYS:
        return "int"
    if last in FLOAT_KEYS:
        return "float"
    if last in STRING_KEYS:
        return "string"
    return "unknown"


def _same_number(expected: Any, got: Any, kind: str) -> bool:
    if kind == "int":
        return type(got) is int and got == expected
    if kind == "float":
        return type(got) is float and math.isclose(got, expected, rel_tol=1e-12, abs_tol=1e-15)
    if kind == "string":
        return type(got) is str and got == expected
    return bool(got == expected)


def compare_metrics(expected: dict[str, Any], got: dict[str, Any], where: str) -> list[str]:
    out: list[str] = []
    for key in sorted(set(expected) - set(got)):
        out.append(f"{where}: key {key} missing (reference {expected[key]!r})")
    for key in sorted(set(got) - set(expected)):
        out.append(f"{where}: unexpected key {key} = {got[key]!r}")
    for key in sorted(set(expected) & set(got)):
        if not _same_number(expected[key], got[key], _key_kind(key)):
            out.append(f"{where}: {key} = {got[key]!r}, reference {expected[key]!r}")
    return out


def _normalise_sample(sample: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in sample.items() if v is not None}
    out["mask"] = [int(x) for x in out.get("mask", [])]
    for name in ("rl_weights", "ce_weights", "ref_kl_weights"):
        if name in out:
            out[name] = [float(x) for x in out[name]]
    for name in ("logprobs", "trainer_logprobs"):  # R16, R18: null where missing
        if name in out:
            out[name] = [None if x is None else float(x) for x in out[name]]
    if "weight_versions" in out:
        out["weight_versions"] = [list(pair) for pair in out["weight_versions"]]
    return out


def _normalise_rollout(rollout: dict[str, Any], completion_default: int | None) -> dict[str, Any]:
    """Fill SPEC 3 defaults, so that writing a default out explicitly is not a difference."""
    out = {k: v for k, v in rollout.items() if v is not None}
    out.setdefault("source", "live")
    out.setdefault("agentic", False)
    if "completion_version" not in out and completion_default is not None:
        out["completion_version"] = completion_default
    out["samples"] = [_normalise_sample(s) for s in out.get("samples", [])]
    return out


def _completion_defaults(events: list[dict[str, Any]]) -> dict[str, int | None]:
    defaults: dict[str, int | None] = {}
    for event in events:
        if isinstance(event, dict) and event.get("type") == "rollout":
            try:
                rollout = parse_rollout(event.get("rollout"))
            except Exception:  # invalid ones are never shipped
                continue
            if rollout.id not in defaults:
                defaults[rollout.id] = None if rollout.frozen else rollout.completion()
    return defaults


def compare_batches(
    expected: dict[str, Any], got: dict[str, Any], where: str, completion: dict[str, int | None]
) -> list[str]:
    out: list[str] = []
    if set(got) != BATCH_KEYS:
        out.append(f"{where}: batch keys {sorted(got)}, expected {sorted(BATCH_KEYS)}")
    if got.get("step") != expected["step"]:
        out.append(f"{where}: step {got.get('step')!r}, reference {expected['step']!r}")
    for name in ("dropped_rollouts", "held"):
        want, have = Counter(expected[name]), Counter(got.get(name) or [])
        if want != have:
            out.append(f"{where}: {name} {sorted(have.elements())}, reference {sorted(want.elements())}")
    want_samples = Counter(tuple(x) for x in expected["dropped_samples"])
    have_samples = Counter(tuple(x) for x in got.get("dropped_samples") or [])
    if want_samples != have_samples:
        out.append(
            f"{where}: dropped_samples {sorted(have_samples.elements())}, reference {sorted(want_samples.elements())}"
        )
    want_shipped = {r["id"]: r for r in expected["shipped"]}
    have_list = got.get("shipped") or []
    have_ids = Counter(r.get("id") for r in have_list)
    if have_ids != Counter(list(want_shipped)):
        out.append(f"{where}: shipped ids {sorted(map(str, have_ids.elements()))}, reference {sorted(want_shipped)}")
    for rollout in have_list:
        rid = rollout.get("id")
        if rid not in want_shipped:
            continue
        default = completion.get(rid)
        reference = _normalise_rollout(want_shipped[rid], default)
        engine = _normalise_rollout(rollout, default)
        for key in sorted(set(reference) | set(engine)):
            if key != "samples" and reference.get(key) != engine.get(key):
                out.append(f"{where}: shipped {rid}.{key} = {engine.get(key)!r}, reference {reference.get(key)!r}")
        if len(reference["samples"]) != len(engine["samples"]):
            out.append(
                f"{where}: shipped {rid} has {len(engine['samples'])} samples, reference {len(reference['samples'])}"
            )
            continue
        for i, (ws, hs) in enumerate(zip(reference["samples"], engine["samples"], strict=True)):
            for key in sorted(set(ws) | set(hs)):
                if ws.get(key) != hs.get(key):
                    got, want_value = hs.get(key), ws.get(key)
                    out.append(f"{where}: shipped {rid}.samples[{i}].{key} = {got!r}, reference {want_value!r}")
    return out


def differences(events: list[dict[str, Any]], lines: list[str], config: ReplayConfig, result: CliResult) -> list[str]:
    """Every way the CLI's result differs from the reference on this stream (empty list: agreement)."""
    try:
        metrics, batches = replay_reference_lines(lines, **config.reference_options())
    except (ReferenceTraceError, ReferenceEventError) as error:
        out: list[str] = []
        if result.code != 2:
            out.append(f"exit {result.code}, reference exits 2 with: {error}")
        if result.metrics is not None or result.batches is not None:
            out.append("output files written although the input is rejected")
        message = result.stderr.strip().splitlines()
        if len(message) != 1:
            out.append(f"expected a one-line message, got {result.stderr!r}")
        elif not message[0].split("error: ")[-1].startswith(f"line {error.line}: "):
            out.append(f"message {message[0]!r}, reference {error}")
        elif isinstance(error, ReferenceTraceError):
            if f"rollout {error.rollout_id!r}" not in message[0]:
                out.append(f"message {message[0]!r} does not name rollout {error.rollout_id!r} ({error})")
            elif f"field {error.field}" not in message[0]:
                out.append(f"message {message[0]!r} names another field than the reference ({error})")
        return out
    if result.code != 0:
        return [f"exit {result.code} ({result.stderr.strip()!r}), reference accepts the stream"]
    if result.metrics is None or result.batches is None:
        return ["an output file was not written"]
    out = []
    if len(result.metrics) != len(metrics):
        out.append(f"{len(result.metrics)} metrics lines, reference {len(metrics)}")
    if len(result.batches) != len(batches):
        out.append(f"{len(result.batches)} batches lines, reference {len(batches)}")
    for number, (want, have) in enumerate(zip(metrics, result.metrics, strict=False), start=1):
        out += compare_metrics(want, have, f"metrics line {number} (step {want['step']})")
    completion = _completion_defaults(events)
    for number, (want, have) in enumerate(zip(batches, result.batches, strict=False), start=1):
        out += compare_batches(want, have, f"batches line {number} (step {want['step']})", completion)
    return out


def check_stream(
    events: list[dict[str, Any]], config: ReplayConfig, how: str = "in-process", work: Path | None = None
) -> list[str]:
    """Write the stream, run the CLI (``in-process``, ``module`` or ``script``) and compare."""
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        folder = Path(tmp)
        events_path = folder / "events.jsonl"
        lines = write_events(events, events_path)
        if how == "in-process":
            result = run_cli_in_process(events_path, config, folder)
        else:
            result = run_cli_subprocess(events_path, config, folder, console_script=how == "script")
        return differences(events, lines, config, result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.reference.compare", description=__doc__)
    parser.add_argument("events", type=Path)
    parser.add_argument("--policy", default="token")
    parser.add_argument("--max-staleness", type=int, default=8)
    parser.add_argument("--max-token-staleness", type=int)
    parser.add_argument("--sync-interval", type=int, default=1)
    parser.add_argument("--retry-expired", action="store_true")
    parser.add_argument("--lenient", action="store_true")
    parser.add_argument("--env-breakdown", action="store_true")
    args = parser.parse_args(argv)
    config = ReplayConfig(
        args.policy,
        args.max_staleness,
        args.max_token_staleness,
        args.sync_interval,
        args.retry_expired,
        args.lenient,
        args.env_breakdown,
    )
    events = [json.loads(line) for line in args.events.read_text().splitlines() if line.strip()]
    found = check_stream(events, config, how="module")
    print("\n".join(found) if found else "no differences")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
