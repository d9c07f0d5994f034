"""Service benchmark: latency over one kept-alive connection, and throughput under 16 clients.

    python bench/service.py [--requests 300] [--clients 16] [--batches 100] [--persist] [--json]
    python bench/service.py --memory [--body-mb 32] [--persist]

``--memory`` measures instead the server's peak resident growth per request body (VmHWM reset through
/proc/<pid>/clear_refs before each, Linux) for hostile and valid bodies of ``--body-mb``, for the last of
the mask-only bodies queued in one run until their journal passes the snapshot threshold (with
``--persist`` that request also writes the run's snapshot), and what an oversized header and idle
connections cost (docs/service.md, "Limits").

Starts ``staleness-metrics serve`` on a free loopback port (a real uvicorn process) and measures with
the project's client (one connection reused per client):
- the first and the second request on a new connection (a small add each), then p50 / p99 of a small
  add (one rollout of 16 positions) and of a small ship over that connection, one client;
- batches/s with ``--clients`` concurrent clients each adding ``--batches`` batches of 4 rollouts
  (ships in between), and the server's CPU share meanwhile (its CPU seconds / wall seconds; 1.0 =
  one core busy): throughput bound by the server's CPU, not by waiting, shows as a high share;
- conservation afterwards: every rollout sent is shipped, dropped or still queued, exactly once;
- the server's CPU time per small add and ship (all its threads, from /proc; the mean over the timed
  pairs after the first): the service's own cost, which waiting for a core on a shared machine inflates
  less than it does the latencies;
- the same small adds and ships on a run in this process (no HTTP): the part of a request's time that is
  the run's and the library's.
The service keeps its runs in memory (``--in-memory``) unless ``--persist`` is given: then it journals
every write to SQLite in a temporary data directory, one fsynced commit per write (the ``serve``
default), and the figures include the disk's fsync time.
Goal: p50 <= 3 ms on loopback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from staleness_metrics.client import StalenessClient


def rollout(rid: str, version: int) -> dict[str, Any]:
    return {"id": rid, "dispatch_version": version, "samples": [{"mask": [0] * 4 + [1] * 12}]}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of a process, in nanoseconds (Linux schedstat: finer than /proc/<pid>/stat's
    ticks, so that one small request's share can be read)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/schedstat") as stat:
            total += int(stat.read().split()[0])
    return total


def quantiles(times: list[float] | list[int]) -> tuple[float, float]:
    times = sorted(times)
    return times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300, help="timed adds and ships, one client")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--batches", type=int, default=100, help="batches per client under load")
    parser.add_argument("--persist", action="store_true", help="journal to SQLite (fsync per write), not memory")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--memory", action="store_true", help="peak memory per body size and header cases")
    parser.add_argument("--body-mb", type=int, default=32, help="body size of --memory, MiB")
    args = parser.parse_args()
    if args.memory:
        with tempfile.TemporaryDirectory(prefix="staleness-bench-") as data_dir:
            store = ["--data-dir", data_dir] if args.persist else ["--in-memory"]
            rows = serve_and_measure_memory(store, args.body_mb, data_dir if args.persist else None)
        if args.json:
            print(json.dumps(rows))
        for row in rows:
            print(f"{row['case']:34s} {row['bytes'] / 2**20:7.1f} MiB -> {row['status']} "
                  f"peak +{row['peak_mb']:7.1f} MiB "
                  f"({row['ratio']:.2f}x) {row['seconds']:.2f} s")  # fmt: skip
        return
    with tempfile.TemporaryDirectory(prefix="staleness-bench-") as data_dir:
        store = ["--data-dir", data_dir] if args.persist else ["--in-memory"]
        result = serve_and_measure(store, args)
    result["store"] = "sqlite" if args.persist else "memory"
    if args.json:
        print(json.dumps(result))
        return
    print(f"store: {'SQLite, fsync per write' if result['store'] == 'sqlite' else 'in memory'}")
    print(
        f"small add on a new connection: first request {result['first_ms']:.2f} ms, second {result['second_ms']:.2f} ms"
    )
    print(f"small add over one connection:  p50 {result['add_p50_ms']:.2f} ms, p99 {result['add_p99_ms']:.2f} ms "
          "(goal p50 <= 3 ms)")  # fmt: skip
    print(f"small ship over one connection: p50 {result['ship_p50_ms']:.2f} ms, p99 {result['ship_p99_ms']:.2f} ms")
    print(f"server CPU per small add + small ship: {result['pair_server_cpu_ms']:.2f} ms")
    print(f"the same calls in process (no HTTP): add p50 {result['in_process_add_p50_ms']:.2f} ms, "
          f"ship p50 {result['in_process_ship_p50_ms']:.2f} ms")  # fmt: skip
    print(f"{args.clients} clients: {result['batches_per_second']:.0f} batches/s, server CPU share "
          f"{result['server_cpu_share']:.2f} of one core")  # fmt: skip
    print(f"conservation: {result['rollouts_sent']} rollouts sent = shipped + dropped + queued: {result['conserved']}")


def serve_and_measure(store: list[str], args: argparse.Namespace) -> dict[str, Any]:
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "staleness_metrics.cli",
            "serve",
            "--port",
            "0",
            "--log-level",
            "warning",
            *store,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        match = re.search(r"http://127\.0\.0\.1:(\d+)", server.stdout.readline())
        assert match, "the service did not say where it listens"
        url = f"http://127.0.0.1:{match.group(1)}"
        return measure(url, server.pid, args)
    finally:
        server.terminate()
        server.wait(timeout=30)


def measure(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    with StalenessClient(url) as setup:
        setup.create_run("latency", {"max_staleness": 4})
    with StalenessClient(url) as client:
        start = time.perf_counter()  # a new connection: the request opens it
        client.add("latency", [rollout("first", 0)])
        first = time.perf_counter() - start
        start = time.perf_counter()  # the same connection, kept alive
        client.add("latency", [rollout("second", 0)])
        second = time.perf_counter() - start
        adds, ships = [], []
        add_cpu: list[float] = []  # the server's CPU time during each request: its own cost, whatever the load
        ship_cpu: list[float] = []
        for i in range(args.requests):
            start, cpu_start = time.perf_counter(), cpu_ns(pid)
            client.add("latency", [rollout(f"a{i}", 0)])
            adds.append(time.perf_counter() - start)
            add_cpu.append(cpu_ns(pid) - cpu_start)
            start, cpu_start = time.perf_counter(), cpu_ns(pid)
            client.ship("latency", 1 + i // 10)
            ships.append(time.perf_counter() - start)
            ship_cpu.append(cpu_ns(pid) - cpu_start)

        client.create_run("load", {"max_staleness": 2})
        step = [1]
        lock = threading.Lock()

        def send(worker: int) -> None:
            with StalenessClient(url) as own:
                for b in range(args.batches):
                    with lock:
                        version = step[0] - 1
                    own.add("load", [rollout(f"w{worker}-{b}-{k}", version) for k in range(4)])
                    if b % 10 == 9:
                        with lock:  # ships in step order
                            step[0] += 1
                            own.ship("load", step[0])

        cpu_before, start = cpu_seconds(pid), time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(send, range(args.clients)))
        wall = time.perf_counter() - start
        cpu = cpu_seconds(pid) - cpu_before
        client.ship("load", step[0] + 1)
        info = client.run_info("load")
    totals = info["totals"]
    sent = args.clients * args.batches * 4
    accounted = totals["rollouts_shipped"] + totals["rollouts_dropped"] + info["queued"]
    add_p50, add_p99 = quantiles(adds)
    ship_p50, ship_p99 = quantiles(ships)
    in_process_add, in_process_ship = in_process(args.requests)
    return {
        "in_process_add_p50_ms": in_process_add * 1e3,
        "in_process_ship_p50_ms": in_process_ship * 1e3,
        "first_ms": first * 1e3,
        "second_ms": second * 1e3,
        "add_p50_ms": add_p50 * 1e3,
        "add_p99_ms": add_p99 * 1e3,
        "ship_p50_ms": ship_p50 * 1e3,
        "ship_p99_ms": ship_p99 * 1e3,
        # Per pair: work a request leaves for after its answer is counted in the next one's time. Without the
        # first ship, which loads what ships need once per process.
        "pair_server_cpu_ms": (sum(add_cpu[1:]) + sum(ship_cpu[1:])) / max(1, len(ship_cpu) - 1) / 1e6,
        "batches_per_second": args.clients * args.batches / wall,
        "server_cpu_share": cpu / wall,
        "rollouts_sent": sent,
        "conserved": accounted == sent and info["rollouts_received"] == sent,
    }


def in_process(requests: int) -> tuple[float, float]:
    """p50 of the same small adds and ships on a run of the service's registry in this process (no HTTP,
    no JSON): what the run and the library cost, the rest of a request's time being the service's."""
    from staleness_metrics.config import StalenessConfig
    from staleness_metrics.server import RunRegistry
    from staleness_metrics.server.models import ShipRequest

    registry = RunRegistry()
    run, _ = registry.create("in-process", StalenessConfig(max_staleness=4))
    adds, ships = [], []
    for i in range(requests):
        start = time.perf_counter()
        run.add([rollout(f"a{i}", 0)])
        adds.append(time.perf_counter() - start)
        start = time.perf_counter()
        run.ship(ShipRequest(step=1 + i // 10))
        ships.append(time.perf_counter() - start)
    registry.close()
    return quantiles(adds)[0], quantiles(ships)[0]


def status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        match = re.search(rf"^{key}:\s+(\d+) kB", status.read(), re.MULTILINE)
    assert match is not None
    return int(match.group(1))


def memory_bodies(size: int) -> list[tuple[str, bytes]]:
    per = 2000
    one = (
        '{"id":"r%d","dispatch_version":0,"samples":[{"mask":[' + ",".join(["1"] * per) + '],"logprobs":['
        + ",".join(["-0.123456"] * per) + '],"weight_versions":[[0,0],[1,1000]]}]}'
    )  # fmt: skip
    return [
        ("empty objects {} (413)", b'{"rollouts":[' + b"{}," * (size // 3) + b"{}]}"),
        ("mask only, one rollout", b'{"rollouts":[{"id":"m","dispatch_version":0,"samples":[{"mask":['
         + b"1," * (size // 2) + b"1]}]}]}"),
        ("mask + logprobs + spans",
         ('{"rollouts":[' + ",".join(one % i for i in range(size // len(one))) + "]}").encode()),
        ("weight_versions pairs", b'{"rollouts":[{"id":"s","dispatch_version":0,"samples":[{"mask":[1],'
         b'"weight_versions":[' + b"[0,0]," * (size // 6) + b"[0,0]]}]}]}"),
        ("mask + 0/1 rl_weights", b'{"rollouts":[{"id":"w","dispatch_version":0,"samples":[{"mask":['
         + b"1," * (size // 4) + b'1],"rl_weights":[' + b"1," * (size // 4) + b"1]}]}]}"),
        ("mask + token_versions", b'{"rollouts":[{"id":"t","dispatch_version":0,"samples":[{"mask":['
         + b"1," * (size // 4) + b'1],"token_versions":[' + b"0," * (size // 4) + b"0]}]}]}"),
    ]  # fmt: skip


def snapshot_seq(data_dir: str | None, run: str) -> int | None:
    """The journal row at which ``run``'s latest snapshot was taken (None: none, or no data directory)."""
    if data_dir is None:
        return None
    import sqlite3

    from staleness_metrics.server.store import DATABASE_NAME

    with contextlib.closing(sqlite3.connect(os.path.join(data_dir, DATABASE_NAME))) as db:
        row = db.execute("SELECT seq FROM snapshots WHERE run = ?", (run,)).fetchone()
    return None if row is None else int(row[0])


def serve_and_measure_memory(store: list[str], body_mb: int, data_dir: str | None = None) -> list[dict[str, Any]]:
    import socket

    import httpx

    from staleness_metrics.server.store import SNAPSHOT_BYTES

    size = body_mb * 2**20
    server = subprocess.Popen(
        [sys.executable, "-m", "staleness_metrics.cli", "serve", "--port", "0", "--log-level", "warning",
         "--max-body-bytes", str(2 * size), *store],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    rows: list[dict[str, Any]] = []
    try:
        assert server.stdout is not None
        match = re.search(r"http://127\.0\.0\.1:(\d+)", server.stdout.readline())
        assert match, "the service did not say where it listens"
        url, pid = f"http://127.0.0.1:{match.group(1)}", server.pid
        with httpx.Client(base_url=url, timeout=600) as http:
            # The engine's compiled loops load numba once per process (about 100 MB resident), at the first
            # batch large enough to use them: loaded here, so that each row is its body's own cost.
            http.put("/v1/runs/warm", json={}).raise_for_status()
            n = 70_000  # above the sink's staging limit: cut and checked at once
            warm = {"id": "w", "dispatch_version": 0,
                    "samples": [{"mask": [1] * n, "rl_weights": [1.0] * n, "token_versions": [0] * n}]}  # fmt: skip
            http.post("/v1/runs/warm/rollouts", json={"rollouts": [warm]}).raise_for_status()
            http.post("/v1/runs/warm/ship", json={"step": 1}).raise_for_status()
            for number, (case, body) in enumerate(memory_bodies(size)):
                http.put(f"/v1/runs/m{number}", json={}).raise_for_status()
                with open(f"/proc/{pid}/clear_refs", "w") as clear:
                    clear.write("5")  # resets VmHWM to the current resident size
                before, start = status_kb(pid, "VmRSS"), time.perf_counter()
                answer = http.post(f"/v1/runs/m{number}/rollouts", content=body,
                                   headers={"content-type": "application/json"})  # fmt: skip
                seconds = time.perf_counter() - start
                grown = (status_kb(pid, "VmHWM") - before) * 1024
                rows.append({"case": case, "bytes": len(body), "status": answer.status_code,
                             "peak_mb": grown / 2**20, "ratio": grown / len(body), "seconds": seconds})  # fmt: skip
            # Mask-only bodies queued in one run until their journal passes SNAPSHOT_BYTES: with a data
            # directory the last request also writes the run's snapshot (the whole queue's text), measured.
            _, mask_body = memory_bodies(size)[1]
            count = -(-SNAPSHOT_BYTES // len(mask_body))  # two bodies of 32 MiB
            http.put("/v1/runs/snapshot", json={}).raise_for_status()
            for number in range(count):
                body = mask_body.replace(b'"id":"m"', b'"id":"m%d"' % number, 1)
                with open(f"/proc/{pid}/clear_refs", "w") as clear:
                    clear.write("5")
                before, start = status_kb(pid, "VmRSS"), time.perf_counter()
                answer = http.post("/v1/runs/snapshot/rollouts", content=body,
                                   headers={"content-type": "application/json"})  # fmt: skip
                seconds = time.perf_counter() - start
                grown = (status_kb(pid, "VmHWM") - before) * 1024
            taken = snapshot_seq(data_dir, "snapshot")
            case = f"mask only, body {count} in a run" + (", snapshot" if taken == count else "")
            rows.append({"case": case, "bytes": len(body), "status": answer.status_code,
                         "peak_mb": grown / 2**20, "ratio": grown / len(body), "seconds": seconds})  # fmt: skip
            before = status_kb(pid, "VmRSS")
            with open(f"/proc/{pid}/clear_refs", "w") as clear:
                clear.write("5")
            start = time.perf_counter()
            with socket.create_connection(("127.0.0.1", int(match.group(1)))) as sock:
                head = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * (32 * 2**20) + b"\r\n\r\n"
                with contextlib.suppress(OSError):  # the server closes once the cap is passed
                    sock.sendall(head)
                status = sock.recv(64).split(b" ")[1:2]
            grown = (status_kb(pid, "VmHWM") - before) * 1024
            rows.append({"case": "32 MiB header", "bytes": len(head), "status": int(status[0]) if status else 0,
                         "peak_mb": grown / 2**20, "ratio": grown / len(head),
                         "seconds": time.perf_counter() - start})  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=30)
    return rows


if __name__ == "__main__":
    main()
