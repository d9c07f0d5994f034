"""Load: 16 concurrent clients send 500 batches each to the ``serve`` process, with ships in between.

Afterwards every counter equals what was sent (nothing lost, nothing doubled by the re-sends), the
``/steps`` history adds up to the same totals, and the Prometheus exposition agrees with both.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from staleness_metrics.client import StalenessClient
from staleness_metrics.exporters.state import bucket_counts
from staleness_metrics.metrics.buckets import BUCKETS

from .conftest import ServeProcess
from .traffic import Sent, make_rollout

pytestmark = pytest.mark.integration

CLIENTS = 16
BATCHES = 500
PER_BATCH = 2
RUNS = {
    "load-token": {"policy": "token", "max_staleness": 2},
    "load-episode": {"policy": "episode", "max_staleness": 3},
}


class Shipper(threading.Thread):
    """Ships one run at steps 1, 2, 3, ... until stopped; re-sends every 5th ship with its key."""

    def __init__(self, url: str, run: str) -> None:
        super().__init__(daemon=True)
        self.url, self.run_name = url, run
        self.shipped_step = 0  # clients label versions up to it: never above a later ship's T
        self.ships = 0
        self.replays_checked = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def ship(self, client: StalenessClient) -> None:
        step = self.shipped_step + 1
        key = f"{self.run_name}-step-{step}"
        first = client.ship(self.run_name, step, idempotency_key=key)
        self.ships += 1
        if step % 5 == 0:  # as if the answer was lost and the orchestrator retried
            again = client.ship(self.run_name, step, idempotency_key=key)
            assert again == {**first, "replayed": True}
            self.replays_checked += 1
        self.shipped_step = step

    def run(self) -> None:
        try:
            with StalenessClient(self.url) as client:
                while not self.stop.wait(0.002):
                    self.ship(client)
                self.ship(client)  # the last ship takes whatever is still queued
        except BaseException as exc:
            self.error = exc


def send(url: str, run: str, index: int, shipper: Shipper) -> Sent:
    rng = random.Random(index)
    sent = Sent()
    previous: list[dict[str, Any]] = []
    with StalenessClient(url) as client:
        for b in range(BATCHES):
            newest = shipper.shipped_step
            batch = [
                make_rollout(f"c{index}-b{b}-{k}", max(0, newest - rng.randint(0, 5)), newest, rng)
                for k in range(PER_BATCH)
            ]
            if b % 10 == 9:
                batch.insert(0, previous[0])  # a batch mixing a record sent before with new ones
            result = client.add(run, batch)
            assert (result["accepted"], result["duplicates"]) == (PER_BATCH, len(batch) - PER_BATCH)
            sent.record(batch)
            if b % 7 == 0:  # re-sent after a "timeout": all duplicates
                again = client.add(run, batch)
                assert (again["accepted"], again["duplicates"]) == (0, len(batch))
                sent.record(batch)
            previous = batch
    return sent


def prometheus_samples(text: str, run: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of one run: (name, labels without run) -> value."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("run") == run:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "run"))
                samples[(sample.name, labels)] = sample.value
    return samples


def test_concurrent_clients_lose_and_double_nothing(serve_process: Callable[..., ServeProcess]) -> None:
    url = serve_process().url
    with StalenessClient(url) as admin:
        for run, config in RUNS.items():
            admin.create_run(run, config)
        shippers = {run: Shipper(url, run) for run in RUNS}
        for shipper in shippers.values():
            shipper.start()
        runs = list(RUNS)
        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [
                (runs[i % len(runs)], pool.submit(send, url, runs[i % len(runs)], i, shippers[runs[i % len(runs)]]))
                for i in range(CLIENTS)
            ]
            sent = {run: Sent() for run in runs}
            for run, future in futures:
                sent[run] = sent[run] + future.result()
        for shipper in shippers.values():
            shipper.stop.set()
            shipper.join()
            assert shipper.error is None, shipper.error

        exposition = admin.metrics()
        for run in runs:
            shipper, what = shippers[run], sent[run]
            assert what.rollouts == CLIENTS // len(runs) * BATCHES * PER_BATCH
            assert shipper.ships > 10 and shipper.replays_checked > 0  # ships really happened in between

            info = admin.run_info(run)
            totals = info["totals"]
            assert info["queued"] == 0
            assert info["rollouts_received"] == what.rollouts
            assert info["duplicates_ignored"] == what.duplicates
            # Every rollout and every sampled position sent is accounted for exactly once.
            assert totals["rollouts_shipped"] + totals["rollouts_dropped"] == what.rollouts
            assert totals["tokens_sampled"] + totals["tokens_dropped"] == what.sampled_tokens
            assert totals["rollouts_dropped"] > 0 and totals["rollouts_shipped"] > 0

            rows = admin.steps(run)
            assert [row["ship"] for row in rows] == list(range(1, shipper.ships + 1))  # replays add no row
            assert [row["step"] for row in rows] == list(range(1, shipper.shipped_step + 1))
            summed = {name: sum(row["counts"][name] for row in rows) for name in totals}
            assert summed == totals
            assert sum(row["metrics"]["staleness/rollout/dropped"] for row in rows) == totals["rollouts_dropped"]

            prom = prometheus_samples(exposition, run)
            for name in ("tokens_sampled", "tokens_masked", "tokens_dropped", "tokens_unlabelled",
                         "rollouts_shipped", "rollouts_dropped", "samples_dropped"):  # fmt: skip
                assert prom[(f"rl_staleness_{name}_total", (("env", ""),))] == totals[name], name
            assert prom[("rl_staleness_train_step", ())] == shipper.shipped_step
            assert prom[("rl_staleness_max_staleness", ())] == RUNS[run]["max_staleness"]
            histograms = {
                "rl_staleness_token_steps": [row["token_histogram"] for row in rows],
                "rl_staleness_rollout_steps": [row["rollout_histogram"] for row in rows],
            }
            for family, per_ship in histograms.items():
                histogram = np.zeros(max(map(len, per_ship)), dtype=np.int64)
                for counts in per_ship:
                    histogram[: len(counts)] += np.asarray(counts, dtype=np.int64)
                expected = bucket_counts(histogram).cumulative()
                les = [*(f"{b:.1f}" for b in BUCKETS), "+Inf"]
                got = [prom[(f"{family}_bucket", (("env", ""), ("le", le)))] for le in les]
                assert got == expected, family
            assert prom[("rl_staleness_token_steps_count", (("env", ""),))] == totals["tokens_sampled"]
            assert prom[("rl_staleness_rollout_steps_count", (("env", ""),))] == totals["rollouts_shipped"]
