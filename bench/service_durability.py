"""Service durability benchmark: the real ``serve`` command in a subprocess, figures measured in the same run.

    python bench/service_durability.py [--writes 400] [--clients 4] [--positions 28000000]

Reports:
- writes per second (rollout batches and ships) with persistence on (SQLite, WAL, fsync per write)
  beside the same load on ``--in-memory``, and their ratio;
- the server's peak memory for one large valid body: resident memory growth (peak ``VmHWM`` minus the
  resident size before the request) as a multiple of the body's size;
- restart of a data directory of ``--runs`` runs (default 100, each with rollouts, ships and a journal
  tail after its snapshot): seconds from starting the command until ``/healthz`` answers 200 with every
  run available (loaded: /healthz waits for the stored runs after a restart), and until the first read of
  the last run answers; and the server's CPU seconds until it listens and until /healthz is 200 (the
  figures that do not depend on how busy the machine is).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def serve(args: Sequence[str]) -> Iterator[tuple[str, int]]:
    """``staleness-metrics serve --port 0 ARGS``: yields (url, pid)."""
    command = [sys.executable, "-m", "staleness_metrics.cli", "serve", "--port", "0", "--log-level", "warning"]
    process = subprocess.Popen([*command, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        match = re.search(r"http://127\.0\.0\.1:\d+", process.stdout.readline())
        if match is None:
            raise RuntimeError(f"serve did not start: {process.stderr.read() if process.stderr else ''}")
        yield match.group(0), process.pid
    finally:
        process.terminate()
        process.wait()


def _rollouts(client: int, index: int, per_batch: int = 4, positions: int = 64) -> list[dict[str, object]]:
    return [
        {
            "id": f"c{client}-{index}-{j}",
            "group_id": f"g{index}",
            "dispatch_version": index // 8,
            "samples": [{"mask": [1] * positions, "weight_versions": [[index // 8, 0]]}],
        }
        for j in range(per_batch)
    ]


def writes_per_second(url: str, writes: int, clients: int) -> float:
    """``clients`` threads each sending ``writes / clients`` requests (one ship every eighth), timed."""
    with httpx.Client(base_url=url, timeout=120) as http:
        http.put("/v1/runs/bench", json={"max_staleness": 4}).raise_for_status()
    per_client = writes // clients

    def client(number: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            for i in range(per_client):
                if number == 0 and i % 8 == 7:
                    step = i // 8 + 2
                    http.post("/v1/runs/bench/ship", json={"step": step}, headers={"Idempotency-Key": f"s{i}"})
                else:
                    http.post("/v1/runs/bench/rollouts", json={"rollouts": _rollouts(number, i)}).raise_for_status()

    threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return per_client * clients / (time.perf_counter() - start)


def persisted_vs_in_memory(writes: int, clients: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as data_dir, serve(["--data-dir", data_dir]) as (url, _):
        persisted = writes_per_second(url, writes, clients)
    with serve(["--in-memory"]) as (url, _):
        in_memory = writes_per_second(url, writes, clients)
    return {"persisted_writes_per_s": persisted, "in_memory_writes_per_s": in_memory, "ratio": persisted / in_memory}


def _status(pid: int, key: str) -> int:
    """A ``/proc/PID/status`` figure in bytes (``VmRSS``, ``VmHWM``)."""
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
    assert match is not None
    return int(match.group(1)) * 1024


def large_body(positions: int) -> bytes:
    """One valid rollout of ``positions`` sampled positions with two version spans (``1,`` per position)."""
    record = {
        "id": "big",
        "dispatch_version": 0,
        "samples": [{"mask": [1] * positions, "weight_versions": [[0, 0], [1, positions // 2]]}],
    }
    return json.dumps({"rollouts": [record]}, separators=(",", ":")).encode()


def peak_memory_for_body(positions: int, args: Sequence[str] = ("--in-memory",)) -> dict[str, float]:
    body = large_body(positions)
    with (
        serve([*args, "--max-body-bytes", str(len(body) + 1)]) as (url, pid),
        httpx.Client(base_url=url, timeout=600) as http,
    ):
        http.put("/v1/runs/big", json={}).raise_for_status()
        before = _status(pid, "VmRSS")
        response = http.post("/v1/runs/big/rollouts", content=body, headers={"content-type": "application/json"})
        response.raise_for_status()
        peak = _status(pid, "VmHWM")
    return {
        "body_mb": len(body) / 2**20,
        "rss_before_mb": before / 2**20,
        "peak_rss_mb": peak / 2**20,
        "growth_per_body_byte": (peak - before) / len(body),
    }


def fill_runs(url: str, runs: int, batches: int = 6) -> None:
    """``runs`` runs, each with ``batches`` rollout batches and a ship after every other one."""
    with httpx.Client(base_url=url, timeout=120) as http:
        for r in range(runs):
            run = f"run-{r:03d}"
            http.put(f"/v1/runs/{run}", json={"max_staleness": 4}).raise_for_status()
            for i in range(batches):
                http.post(f"/v1/runs/{run}/rollouts", json={"rollouts": _rollouts(r, i)}).raise_for_status()
                if i % 2 == 1:
                    http.post(f"/v1/runs/{run}/ship", json={"step": i + 1}).raise_for_status()


def restart_seconds(data_dir: str, runs: int) -> dict[str, float]:
    """Start ``serve`` on a filled directory: seconds until /healthz is 200 and the last run answers."""
    command = [sys.executable, "-m", "staleness_metrics.cli", "serve", "--port", "0", "--log-level", "warning"]
    start = time.perf_counter()
    process = subprocess.Popen(
        [*command, "--data-dir", data_dir], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        match = re.search(r"http://127\.0\.0\.1:\d+", process.stdout.readline())
        if match is None:
            raise RuntimeError(f"serve did not start: {process.stderr.read() if process.stderr else ''}")
        listening = time.perf_counter() - start
        cpu = _cpu_seconds(process.pid)
        with httpx.Client(base_url=match.group(0), timeout=120) as http:
            while http.get("/healthz").status_code != 200:
                time.sleep(0.01)
            healthy = time.perf_counter() - start
            cpu_healthy = _cpu_seconds(process.pid)
            http.get(f"/v1/runs/run-{runs - 1:03d}").raise_for_status()
            answered = time.perf_counter() - start
    finally:
        process.terminate()
        process.wait()
    return {
        "listening_s": listening,
        "healthy_s": healthy,
        "last_run_s": answered,
        "cpu_until_listening_s": cpu,
        "cpu_until_healthy_s": cpu_healthy,
    }


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far: the part of a start that does not depend on how busy
    the machine is (wall time on a shared machine is this divided by the share of a core it got)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def restart_of_runs(runs: int, repeats: int = 3) -> dict[str, float]:
    """The best of ``repeats`` restarts of a directory of ``runs`` runs (left by a clean shutdown)."""
    with tempfile.TemporaryDirectory() as data_dir:
        with serve(["--data-dir", data_dir]) as (url, _):
            fill_runs(url, runs)
        times = [restart_seconds(data_dir, runs) for _ in range(repeats)]
    return {key: min(t[key] for t in times) for key in times[0]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writes", type=int, default=400)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--positions", type=int, default=28_000_000, help="positions of the large body")
    parser.add_argument("--runs", type=int, default=100, help="runs in the data directory of the restart row")
    parser.add_argument("--only-restart", action="store_true", help="measure the restart row only")
    args = parser.parse_args(argv)
    restart = restart_of_runs(args.runs)
    print(
        f"restart, {args.runs} runs: listening after {restart['listening_s']:.2f} s, /healthz 200 after "
        f"{restart['healthy_s']:.2f} s, last run answered after {restart['last_run_s']:.2f} s; "
        f"{restart['cpu_until_listening_s']:.2f} CPU s until listening, {restart['cpu_until_healthy_s']:.2f} until "
        "/healthz 200 (best of 3)"
    )
    if args.only_restart:
        return 0
    rates = persisted_vs_in_memory(args.writes, args.clients)
    print(
        f"writes/s, {args.clients} clients: persisted {rates['persisted_writes_per_s']:.0f}, "
        f"in memory {rates['in_memory_writes_per_s']:.0f} (persisted / in memory = {rates['ratio']:.2f})"
    )
    for label, store in (("in memory", ["--in-memory"]), ("persisted", None)):
        with tempfile.TemporaryDirectory() as data_dir:
            memory = peak_memory_for_body(args.positions, store or ["--data-dir", data_dir])
        print(
            f"large body ({label}): {memory['body_mb']:.0f} MB, server RSS {memory['rss_before_mb']:.0f} MB -> "
            f"peak {memory['peak_rss_mb']:.0f} MB: growth {memory['growth_per_body_byte']:.1f}x the body"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
