"""W&B exporter: an offline run read back from its .wandb file, the legacy dual-write, failures."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import wandb

from staleness_metrics.errors import ConfigError
from staleness_metrics.exporters.base import ExportContext, ExportErrors, MismatchReport
from staleness_metrics.exporters.wandb import WandbExporter, histogram_bins
from staleness_metrics.metrics.metric_table import LEGACY_KEYS, METRICS, WANDB_KEYS, Source
from staleness_metrics.metrics.mismatch import MismatchSums, mismatch_sums
from staleness_metrics.monitor import StalenessMonitor
from tests.exporters.reports import CONFIG, FAR_CONFIG, FAR_SHIPS, far_records, far_staleness, hand_report, ship_script
from tests.exporters.wandb_reader import find_run_file, read_run

COSTS = dataclasses.replace(CONFIG, floor_min_tokens=2)  # SPEC 14 from the scripts' few tokens

TABLE_KEYS = set(WANDB_KEYS)  # templated keys spelled out per bucket
MAX_KEYS = {key for key, m in WANDB_KEYS.items() if m.wandb_summary == "max"}
HISTOGRAM_KEY = next(m for m in METRICS if m.source is Source.TOKEN_HISTOGRAM).wandb_key
STEP_KEY = "trainer/step"
# Starting and finishing an offline run takes seconds on a loaded machine: these tests read the finished
# run file, so they give close() room for it (a hang guard, not a speed check).
FINISH_TIMEOUT = 120.0


def offline_init(directory: Path) -> dict[str, Any]:
    return {
        "mode": "offline",
        "dir": str(directory),
        "project": "staleness-tests",
        "settings": wandb.Settings(x_disable_stats=True, console="off", silent=True),
    }


def allowed_key(key: str) -> bool:
    """A key the exporter may write: the table's, its per-env form, a legacy key or the axis."""
    if key in TABLE_KEYS or key in LEGACY_KEYS or key == STEP_KEY or key.startswith("_"):
        return True
    if HISTOGRAM_KEY is not None and key.startswith(HISTOGRAM_KEY + "/"):  # the histogram's nested fields
        return True
    parts = key.split("/")
    return key.startswith("staleness/env/") and "staleness/" + "/".join(parts[3:]) in TABLE_KEYS


@pytest.fixture(autouse=True)
def _no_active_wandb_run() -> Iterator[None]:
    """The exporter logs into the active ``wandb.run`` when there is one: a run left open by another test
    would swallow this test's rows (and this test's must not leak into the next)."""
    assert wandb.run is None, "a W&B run was left open before this test"
    yield
    leaked = wandb.run
    if leaked is not None:
        leaked.finish()
        pytest.fail("the test left a W&B run open")


class FakeRun:
    """Records define_metric and log calls; ``fail`` makes the next that many ``log`` calls raise."""

    def __init__(self) -> None:
        self.defined: dict[str, dict[str, Any]] = {}
        self.rows: list[dict[str, Any]] = []
        self.fail = 0
        self.attempts = 0
        self.finished = False
        self.gate = threading.Event()
        self.gate.set()

    def define_metric(self, name: str, **options: Any) -> None:
        self.defined[name] = options

    def log(self, row: dict[str, Any], commit: bool = True) -> None:
        self.gate.wait()
        self.attempts += 1
        if self.fail:
            self.fail -= 1
            raise RuntimeError("wandb service unavailable")
        self.rows.append(dict(row))

    def finish(self) -> None:
        self.finished = True


@pytest.mark.integration
def test_offline_run_has_rows_axis_summaries_and_legacy_keys(tmp_path: Path) -> None:
    exporter = WandbExporter(init_kwargs=offline_init(tmp_path), legacy_keys=True, close_timeout=FINISH_TIMEOUT)
    expected: list[dict[str, Any]] = []
    with StalenessMonitor(COSTS, [exporter], run="ignored-by-wandb") as monitor:
        for records, step in ship_script(3):
            monitor.add(records)
            shipment = monitor.ship(step)
            expected.append({STEP_KEY: step, **shipment.metrics})
    # close() finished the run the exporter started: the file is complete
    run = read_run(find_run_file(tmp_path))

    rows = [r for r in run.history if STEP_KEY in r]
    assert [r[STEP_KEY] for r in rows] == [e[STEP_KEY] for e in expected]
    for row, want in zip(rows, expected, strict=True):
        for key, value in want.items():
            if isinstance(value, str):  # SPEC 14's floor source: a string in W&B
                assert row[key] == value, key
            else:
                assert row[key] == pytest.approx(value, abs=0), key
        assert all(allowed_key(k) for k in row), [k for k in row if not allowed_key(k)]
        # the legacy dual-write carries the same values under the old keys
        for old, entry in LEGACY_KEYS.items():
            if entry.new is not None and entry.new in want:
                assert row[old] == want[entry.new], old
        assert "off_policy/token/max" not in row  # removed keys are not written
        assert any(k.startswith("staleness/env/math/") for k in row)  # per-env keys of the breakdown

    assert run.metrics[STEP_KEY].step_metric == ""
    assert run.metrics["staleness/*"].step_metric == STEP_KEY
    logged_max_keys = {key for key in MAX_KEYS if any(key in e for e in expected)}
    assert {"staleness/rollout/max", "staleness/mismatch/excess_k3", "staleness/mismatch/lag_0/k3"} <= logged_max_keys
    for key in logged_max_keys:
        assert run.metrics[key].summary_max and run.metrics[key].step_metric == STEP_KEY, key
        assert run.summary[key] == {"max": max(e[key] for e in expected if key in e)}, key
    assert run.metrics["staleness/env/math/rollout/max"].summary_max
    for old in ("off_policy/max", "off_policy/mean", "off_policy/token/masked", "off_policy/dropped"):
        assert run.metrics[old].hidden and run.metrics[old].step_metric == STEP_KEY, old
    assert run.metrics["off_policy/max"].summary_max
    assert not run.metrics["staleness/rollout/max"].hidden


@pytest.mark.integration
def test_token_staleness_histogram_is_a_wandb_histogram(tmp_path: Path) -> None:
    assert HISTOGRAM_KEY == "staleness/token/histogram"
    exporter = WandbExporter(init_kwargs=offline_init(tmp_path), close_timeout=FINISH_TIMEOUT)
    histograms = []
    with StalenessMonitor(CONFIG, [exporter], run="r") as monitor:
        for records, step in ship_script(2):
            monitor.add(records)
            histograms.append(monitor.ship(step).report.tally.token_histogram)
    rows = [r for r in read_run(find_run_file(tmp_path)).history if STEP_KEY in r]
    for row, counts in zip(rows, histograms, strict=True):
        # the history record stores the histogram's fields under nested keys
        assert row[f"{HISTOGRAM_KEY}/_type"] == "histogram"
        assert row[f"{HISTOGRAM_KEY}/values"] == [int(c) for c in np.trim_zeros(counts, "b")]
        assert row[f"{HISTOGRAM_KEY}/bins"] == [s - 0.5 for s in range(len(np.trim_zeros(counts, "b")) + 1)]


@pytest.mark.integration
def test_uses_the_callers_run_and_leaves_it_open(tmp_path: Path) -> None:
    run = wandb.init(**offline_init(tmp_path))
    try:
        exporter = WandbExporter(run)
        exporter.export(hand_report(3, {"": [[1, 2]]}))
        exporter.close()
        run.log({"loss": 0.5})  # the caller's run is still usable
    finally:
        run.finish()
    history = read_run(find_run_file(tmp_path)).history
    assert [r[STEP_KEY] for r in history if STEP_KEY in r] == [3]
    assert any(r.get("loss") == 0.5 for r in history)


def test_legacy_keys_default_off_and_selectable() -> None:
    report = hand_report(2, {"": [[1, 3]]})
    assert not any(k.startswith("off_policy/") for k in WandbExporter(FakeRun()).row(report))
    chosen = WandbExporter(FakeRun(), legacy_keys=["off_policy/max"]).row(report)
    assert chosen["off_policy/max"] == report.metrics["staleness/rollout/max"]
    assert "off_policy/mean" not in chosen
    with pytest.raises(ConfigError, match="removed"):
        WandbExporter(FakeRun(), legacy_keys=["off_policy/token/max"])
    with pytest.raises(ConfigError, match="not a legacy key"):
        WandbExporter(FakeRun(), legacy_keys=["loss"])


def test_keys_outside_the_table_are_not_logged() -> None:
    report = hand_report(2, {"": [[1]]})
    report = type(report)(**{**report.__dict__, "metrics": {**report.metrics, "mystery/key": 1}})
    errors = ExportErrors()
    exporter = WandbExporter(FakeRun())
    exporter.attach(ExportContext(errors=errors))
    assert "mystery/key" not in exporter.row(report)
    assert errors.count("wandb") == 1


def test_wandb_raising_is_counted_retried_and_nothing_is_lost() -> None:
    fake = FakeRun()
    fake.fail = 3
    exporter = WandbExporter(fake, retry_initial=0.01, retry_max=0.05)
    monitor = StalenessMonitor(CONFIG, [exporter], run="r")
    steps = []
    for records, step in ship_script(4):
        monitor.add(records)
        monitor.ship(step)  # returns although log raises
        steps.append(step)
    assert exporter.flush(timeout=60)
    assert monitor.export_errors.count("wandb") == 3
    assert [r[STEP_KEY] for r in fake.rows] == steps
    monitor.close()
    assert not fake.finished  # not our run


def test_blocked_wandb_does_not_hold_up_ships() -> None:
    fake = FakeRun()
    fake.gate.clear()  # log() blocks
    exporter = WandbExporter(fake)
    monitor = StalenessMonitor(CONFIG, [exporter], run="r")
    for records, step in ship_script(3):
        monitor.add(records)
        monitor.ship(step)
    assert fake.rows == []  # every ship returned while W&B was stuck
    fake.gate.set()
    assert exporter.flush(timeout=60)
    assert len(fake.rows) == 3
    monitor.close()


def test_export_only_queues_the_row_of_many_envs_is_built_on_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ship`` only appends: matching the per-env keys to the table (all envs) is the worker's work."""
    fake = FakeRun()
    exporter = WandbExporter(fake)
    built_on: list[threading.Thread] = []
    build = exporter.row

    def row(report: Any) -> dict[str, Any]:
        built_on.append(threading.current_thread())
        return build(report)

    monkeypatch.setattr(exporter, "row", row)
    report = hand_report(3, {f"env{i}": [[i % 5, 1]] for i in range(300)}, env_breakdown=True)
    exporter.export(report)
    exporter.export_mismatch(MismatchReport(3, MismatchSums.zero(), MismatchSums.zero()))
    assert exporter.flush(timeout=60)
    assert len(built_on) == 2 and threading.current_thread() not in built_on
    assert {k: v for k, v in fake.rows[0].items() if k in report.metrics} == report.metrics  # every env's keys
    exporter.close()


def test_histogram_bins_centre_integer_staleness() -> None:
    counts, edges = histogram_bins(np.array([2, 0, 5, 0, 0]))
    assert counts == [2, 0, 5]
    assert edges == [-0.5, 0.5, 1.5, 2.5]
    long_counts, long_edges = histogram_bins(np.ones(1030, dtype=np.int64))
    assert len(long_counts) <= 512 and len(long_edges) == len(long_counts) + 1
    assert long_edges[0] == -0.5 and long_edges[-1] == 1029.5
    assert sum(long_counts) == 1030


@pytest.mark.integration
def test_offline_run_holds_the_mismatch_keys_of_the_sink_and_of_the_live_path(tmp_path: Path) -> None:
    """SPEC 11: a ship whose records carry trainer log-probs logs the family with its step; sums the
    trainer records later (two ranks) add rows for the step holding the merged values."""
    exporter = WandbExporter(init_kwargs=offline_init(tmp_path), close_timeout=FINISH_TIMEOUT)
    rng = np.random.default_rng(3)
    lags = np.array([0, 0, 1, 2, 2, 5, 40, 100])
    sampler = -rng.random(len(lags))
    trainer = sampler + 0.1 * lags / 10 + rng.normal(0, 0.01, len(lags))
    rank0 = mismatch_sums(lags[:5], sampler[:5], trainer[:5], masked=lags[:5] > 3)
    rank1 = mismatch_sums(lags[5:], sampler[5:], trainer[5:], masked=lags[5:] > 3)
    with StalenessMonitor(COSTS, [exporter], run="r") as monitor:
        shipped = []
        for records, step in ship_script(2):
            monitor.add(records)
            shipped.append(monitor.ship(step))
        monitor.record_mismatch(shipped[-1].step, rank0)
        live0 = monitor.mismatch_metrics(shipped[-1].step)
        monitor.record_mismatch(shipped[-1].step, rank1)
        live = monitor.mismatch_metrics(shipped[-1].step)
    run = read_run(find_run_file(tmp_path))
    rows = [r for r in run.history if STEP_KEY in r]
    assert [r[STEP_KEY] for r in rows] == [shipped[0].step, shipped[1].step, shipped[1].step, shipped[1].step]
    for row, shipment in zip(rows, shipped, strict=False):  # the sink path: the ship's own keys
        assert shipment.report.mismatch is not None
        family = {
            k: v for k, v in shipment.metrics.items() if k.startswith(("staleness/mismatch/", "staleness/bound/"))
        }
        assert "staleness/mismatch/floor" in family and isinstance(family["staleness/mismatch/floor_source"], str)
        assert family and {k: row[k] for k in family} == family
    # The live rows: the step's merged sums, their excess over SPEC 14's floor, and SPEC 14's keys.
    assert live0 is not None and live is not None
    floor = live["staleness/mismatch/floor"]
    assert isinstance(floor, float) and live["staleness/mismatch/floor_source"] in ("lag0", "carried", "min_lag")
    merged = (rank0 + rank1).metrics(floor=floor)
    assert merged.items() <= live.items()
    assert merged["staleness/mismatch/lag_inf/tokens"] == merged["staleness/mismatch/lag_64/tokens"] == 1
    assert "staleness/mismatch/lag_32/tokens" not in merged  # 40 is in 33..64, 100 above 64
    assert {k: v for k, v in rows[-1].items() if k.startswith("staleness/")} == live
    assert {k: v for k, v in rows[-2].items() if k.startswith("staleness/")} == live0
    assert run.metrics["staleness/mismatch/excess_k3"].summary_max
    everything = [r for r in rows if "staleness/mismatch/excess_k3" in r]
    assert run.summary["staleness/mismatch/excess_k3"] == {
        "max": max(r["staleness/mismatch/excess_k3"] for r in everything)
    }
    assert MismatchSums.zero().metrics() == {}  # nothing covered: no keys at all


class SlowInit:
    """Stands in for ``wandb.init``: blocks until released (the seconds a real start takes), records the
    thread it was called on, and returns a :class:`FakeRun`."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.called = threading.Event()
        self.thread: threading.Thread | None = None
        self.run = FakeRun()

    def __call__(self, **kwargs: Any) -> FakeRun:
        self.thread = threading.current_thread()
        self.called.set()
        self.release.wait()
        return self.run


def test_constructing_never_waits_for_wandb_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """The W&B run starts on the exporter's worker: construction and ships return while it starts."""
    init = SlowInit()
    monkeypatch.setattr(wandb, "init", init)
    exporter = WandbExporter(init_kwargs={"project": "p"}, close_timeout=FINISH_TIMEOUT)
    assert init.called.wait(60)  # wandb.init is running, blocked ...
    assert init.thread is not threading.current_thread()  # ... on another thread than the caller's
    assert exporter.run is None
    exporter.export(hand_report(1, {"": [[1, 2]]}))  # returns while the run is still starting
    assert init.run.rows == []
    init.release.set()
    assert exporter.flush(timeout=60)
    assert exporter.run is init.run and [row[STEP_KEY] for row in init.run.rows] == [1]
    exporter.close()
    assert init.run.finished  # the exporter's own run is finished on close


def test_close_does_not_wait_for_a_start_that_hangs_and_finishes_the_late_run(monkeypatch: pytest.MonkeyPatch) -> None:
    init = SlowInit()
    monkeypatch.setattr(wandb, "init", init)
    errors = ExportErrors()
    exporter = WandbExporter(init_kwargs={"project": "p"})
    exporter.attach(ExportContext(errors=errors))
    exporter.export(hand_report(1, {"": [[1]]}))
    assert init.called.wait(60)
    exporter.close(timeout=0.2)  # returns although wandb.init has not
    assert errors.count("wandb") >= 1  # the unsent row is counted as dropped
    assert exporter.queue.worker_is_daemon
    init.release.set()  # the start completes after close gave up on it: that run is finished, not leaked
    exporter.queue._worker.join(60)
    assert init.run.finished and init.run.rows == []


def test_an_active_run_is_used_without_starting_one(monkeypatch: pytest.MonkeyPatch) -> None:
    active = FakeRun()
    monkeypatch.setattr(wandb, "run", active)
    monkeypatch.setattr(wandb, "init", lambda **kwargs: pytest.fail("started a run although one is active"))
    exporter = WandbExporter()
    assert exporter.run is active
    exporter.export(hand_report(2, {"": [[1]]}))
    exporter.close(timeout=60)
    assert [row[STEP_KEY] for row in active.rows] == [2] and not active.finished  # the caller's run stays open
    monkeypatch.setattr(wandb, "run", None)


def test_an_env_key_only_the_live_path_logs_gets_its_max_summary(tmp_path: Path) -> None:
    """A trainer's per-env sums for a ship whose records carried no trainer log-probs: the env's k3 keys
    are maxima in the run's summary too, however the worker's timing falls."""
    exporter = WandbExporter(init_kwargs=offline_init(tmp_path), close_timeout=FINISH_TIMEOUT)
    lags = np.array([0, 0, 1, 2, 2, 3])
    sampler = np.full(len(lags), -0.5)
    with StalenessMonitor(COSTS, [exporter], run="r") as monitor:
        for records, step in ship_script(1):
            for sample in (sample for record in records for sample in record["samples"]):
                del sample["trainer_logprobs"]
            monitor.add(records)
            shipped = monitor.ship(step)
        monitor.record_mismatch(shipped.step, mismatch_sums(lags, sampler, sampler + 0.05 * lags), env="math")
    run = read_run(find_run_file(tmp_path))
    logged = {key for row in run.history for key in row if key.startswith("staleness/env/math/mismatch/")}
    maxima = {key for key in logged if "staleness/" + key.removeprefix("staleness/env/math/") in MAX_KEYS}
    assert "staleness/env/math/mismatch/k3" in maxima
    assert all(run.metrics[key].summary_max for key in maxima)
    assert run.summary["staleness/env/math/mismatch/k3"] == {
        "max": max(r.get("staleness/env/math/mismatch/k3", -1) for r in run.history)
    }


@pytest.mark.integration
def test_an_env_name_with_a_star_is_logged_with_its_exact_values(tmp_path: Path) -> None:
    """wandb's define_metric takes "*" for a glob and refuses it inside a name: the keys of env "a*b" are
    logged all the same (x-axis from ``staleness/*``), the other env's keep their max summary."""
    exporter = WandbExporter(init_kwargs=offline_init(tmp_path), close_timeout=FINISH_TIMEOUT)
    reports = [hand_report(step, {"a*b": [[1, step]], "math": [[step]]}, env_breakdown=True) for step in (1, 2)]
    for report in reports:
        exporter.export(report)
    exporter.close()
    run = read_run(find_run_file(tmp_path))
    rows = [r for r in run.history if STEP_KEY in r]
    assert [r[STEP_KEY] for r in rows] == [1, 2]
    for row, report in zip(rows, reports, strict=True):
        star = {k: v for k, v in report.metrics.items() if k.startswith("staleness/env/a*b/")}
        assert "staleness/env/a*b/rollout/max" in star and {k: row[k] for k in star} == star
    assert run.metrics["staleness/env/math/rollout/max"].summary_max
    assert run.summary["staleness/env/math/rollout/max"] == {"max": 2}


@pytest.mark.integration
def test_the_histograms_last_bin_reaches_the_highest_staleness_from_4096_up(tmp_path: Path) -> None:
    """Staleness from 4096 up is folded into the histogram's last index: its bin spans up to the highest."""
    exporter = WandbExporter(init_kwargs=offline_init(tmp_path), close_timeout=FINISH_TIMEOUT)
    with StalenessMonitor(FAR_CONFIG, [exporter], run="r") as monitor:
        for ship, (step, _) in enumerate(FAR_SHIPS):
            monitor.add(far_records(ship))
            monitor.ship(step)
    rows = [r for r in read_run(find_run_file(tmp_path)).history if STEP_KEY in r]
    for ship, row in enumerate(rows):
        shipped = far_staleness(ship + 1)[0][len(far_staleness(ship)[0]) :]
        bins, values = row[f"{HISTOGRAM_KEY}/bins"], row[f"{HISTOGRAM_KEY}/values"]
        assert bins[-1] == max(shipped) + 0.5 and bins[-2] < 4096 <= bins[-1]
        assert sum(values) == len(shipped) and values[-1] == sum(s >= 4096 for s in shipped)


@pytest.mark.integration
def test_env_names_with_a_dot_or_a_backslash_keep_their_max_summary(tmp_path: Path) -> None:
    """define_metric reads "." in a name as nesting (escaped: "\\.") and has no escape for "\\." itself: env
    "x.y"'s and "a\\b"'s maxima get summary="max"; env "a\\.b"'s keys are logged but not defined (they
    would name env "a.b"'s)."""
    exporter = WandbExporter(init_kwargs=offline_init(tmp_path), close_timeout=FINISH_TIMEOUT)
    envs = ("x.y", "a\\b", "a\\.b")
    reports = [
        hand_report(step, {env: [[stale]] for env in envs}, env_breakdown=True) for step, stale in ((1, 3), (2, 1))
    ]
    for report in reports:
        exporter.export(report)
    exporter.close()
    run = read_run(find_run_file(tmp_path))
    rows = [r for r in run.history if STEP_KEY in r]
    for row, report in zip(rows, reports, strict=True):
        assert {k: row[k] for k in report.metrics} == dict(report.metrics)
    for env in envs[:2]:
        assert run.summary[f"staleness/env/{env}/rollout/max"] == {"max": 3}, env
    assert not any(name.startswith("staleness/env/a\\.b/") for name in run.metrics)
