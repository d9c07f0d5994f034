"""StalenessMonitor: the orchestrator plugin around the real sink, with its exporters."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from staleness_metrics import mismatch_sums
from staleness_metrics.config import StalenessConfig
from staleness_metrics.engine.sink import Sink
from staleness_metrics.errors import ConfigError, FieldError, TraceError
from staleness_metrics.exporters import ConsoleExporter, JsonlExporter, PrometheusExporter
from staleness_metrics.exporters.base import ExportContext, MismatchReport
from staleness_metrics.metrics.mismatch import MismatchSums
from staleness_metrics.metrics.report import StepReport
from staleness_metrics.monitor import StalenessMonitor
from tests.exporters.reports import CONFIG, ship_script

# SPEC 3 example: positions 0-1 sampled by version 3, position 2 by version 4 (mask 0 there)
ROLLOUT = {
    "id": "r1",
    "dispatch_version": 3,
    "samples": [{"mask": [1, 1, 0], "weight_versions": [[3, 0], [4, 2]]}],
}


class Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.reports: list[StepReport] = []
        self.context: ExportContext | None = None
        self.closed = 0

    def attach(self, context: ExportContext) -> None:
        self.context = context

    def export(self, report: StepReport) -> None:
        self.reports.append(report)

    def close(self) -> None:
        self.closed += 1


class Broken:
    name = "broken"

    def export(self, report: StepReport) -> None:
        raise RuntimeError("exporter bug")

    def close(self) -> None:
        raise RuntimeError("close bug")


def test_ship_masks_like_the_sink_and_returns_its_metrics() -> None:
    config = StalenessConfig(max_staleness=1)
    stale = {
        "id": "r2",
        "dispatch_version": 0,
        "samples": [{"mask": [1, 1, 1, 1], "weight_versions": [[0, 0], [4, 2]]}],
    }
    sink = Sink(config)
    sink.add([ROLLOUT, stale])
    expected = sink.ship(6)
    recorder = Recorder()
    with StalenessMonitor(config, [recorder], run="exp") as monitor:
        monitor.add([ROLLOUT, stale])
        shipment = monitor.ship(6)
    assert dict(shipment.metrics) == dict(expected.metrics)
    assert [r.record() for r in shipment.rollouts] == [r.record() for r in expected.rollouts]
    masked = next(r.record() for r in shipment.rollouts if r.id == "r2")
    assert masked["samples"][0]["mask"] == [0, 0, 1, 1]  # version 0 is 5 behind T=5: masked
    assert recorder.reports == [shipment.report]
    # r1's two sampled positions (version 3) are both masked: its only sample, and so r1, is dropped
    assert shipment.dropped_rollouts == ("r1",) and shipment.metrics["staleness/rollout/dropped"] == 1
    assert shipment.metrics["staleness/token/masked"] == 0.5


def test_exporters_get_every_report_in_order_with_the_run_context() -> None:
    recorder = Recorder()
    config = StalenessConfig(max_staleness=3, env_breakdown=True)
    monitor = StalenessMonitor(config, [recorder], run="exp-7")
    steps = []
    for records, step in ship_script(4):
        monitor.add(records)
        monitor.sweep(step)
        steps.append(monitor.ship(step).step)
    monitor.close()
    assert [r.step for r in recorder.reports] == steps
    assert recorder.context is not None
    assert recorder.context.run == "exp-7" and recorder.context.env_breakdown
    assert recorder.context.errors is monitor.export_errors


def test_a_raising_exporter_is_counted_and_never_reaches_the_caller() -> None:
    recorder = Recorder()
    monitor = StalenessMonitor(CONFIG, [Broken(), recorder], run="r")
    monitor.add([ROLLOUT])
    shipment = monitor.ship(5)  # Broken.export raised inside
    assert recorder.reports == [shipment.report]  # the exporters after it still got the report
    assert monitor.export_errors.count("broken") == 1
    monitor.close()  # Broken.close raised inside too
    monitor.close()  # and closing twice is harmless
    assert monitor.export_errors.count("broken") == 2
    assert recorder.closed == 1


def test_exporters_of_one_name_are_counted_apart_as_name_2() -> None:
    monitor = StalenessMonitor(CONFIG, [Broken(), Recorder(), Broken()], run="r")
    monitor.add([ROLLOUT])
    monitor.ship(5)
    assert monitor.export_errors.snapshot() == {"broken": 1, "recorder": 0, "broken#2": 1}
    monitor.close()
    assert monitor.export_errors.snapshot() == {"broken": 2, "recorder": 0, "broken#2": 2}


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a disk always full)")
def test_two_failing_jsonl_exporters_each_have_their_series_and_their_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Per exporter (SPEC 8): a second JSONL exporter's failures are not summed into the first's,
    nor kept out of the log by its rate limit."""
    good = JsonlExporter(tmp_path / "good.jsonl")
    full = [JsonlExporter("/dev/full", retry_initial=0.01, retry_max=0.01) for _ in range(2)]
    prometheus = PrometheusExporter(port=None)
    monitor = StalenessMonitor(CONFIG, [good, *full, prometheus], run="r")
    assert [e.name for e in (good, *full)] == ["jsonl", "jsonl#2", "jsonl#3"]
    monitor.add([ROLLOUT])
    monitor.ship(5)
    deadline = time.monotonic() + 60  # each full one failed and logged it (a hang guard, not a speed check)
    while sum("No space left" in r.getMessage() for r in caplog.records) < 2:
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.02)
    monitor.close(timeout=0.5)  # the full ones retry until then
    counted = {
        sample.labels["exporter"]: sample.value
        for family in text_string_to_metric_families(prometheus.exposition().decode())
        if family.name == "rl_staleness_export_errors"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert counted["jsonl"] == 0 and counted["jsonl#2"] >= 1 and counted["jsonl#3"] >= 1
    assert len((tmp_path / "good.jsonl").read_text().splitlines()) == 1
    logged = [r.getMessage() for r in caplog.records if "No space left" in r.getMessage()]
    assert sorted(line.split(":")[0] for line in logged) == ["exporter jsonl#2", "exporter jsonl#3"]
    assert all("'/dev/full'" in line for line in logged)  # naming the file


def test_a_ship_after_close_still_masks_and_counts_the_report_it_could_not_export() -> None:
    recorder = Recorder()
    monitor = StalenessMonitor(CONFIG, [recorder], run="r")
    monitor.close()
    monitor.add([ROLLOUT])
    shipment = monitor.ship(5)
    assert shipment.ids == ["r1"] and recorder.reports == []
    assert monitor.export_errors.count("recorder") == 1  # visible in rl_staleness_export_errors_total


def test_invalid_input_still_raises_in_strict_mode() -> None:
    with StalenessMonitor(CONFIG, []) as monitor, pytest.raises(TraceError, match="dispatch_version"):
        monitor.add({"id": "bad", "samples": [{"mask": [1]}]})


def test_config_and_sink_must_agree() -> None:
    with pytest.raises(ConfigError):
        StalenessMonitor(StalenessConfig(max_staleness=2), sink=Sink(StalenessConfig(max_staleness=3)))
    monitor = StalenessMonitor(sink=Sink(StalenessConfig(max_staleness=3)))
    assert monitor.config.max_staleness == 3


def test_close_flushes_queued_exporters(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    monitor = StalenessMonitor(CONFIG, [JsonlExporter(path)])
    for records, step in ship_script(5):
        monitor.add(records)
        monitor.ship(step)
    monitor.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [8, 9, 10, 11, 12]


def test_adds_and_ships_from_two_threads_conserve_every_rollout() -> None:
    monitor = StalenessMonitor(CONFIG, [])
    script = list(ship_script(30, per_step=4))
    added = threading.Event()
    shipped: list[Any] = []

    def producer() -> None:
        for records, _ in script:
            monitor.add(records)
        added.set()

    thread = threading.Thread(target=producer)
    thread.start()
    step = script[-1][1] + 1  # versions in the script never exceed this step's T
    while not added.is_set():
        shipped.append(monitor.ship(step))
    thread.join()
    shipped.append(monitor.ship(step))
    monitor.close()
    shipped_ids = [r.id for s in shipped for r in s.rollouts]
    dropped_ids = [i for s in shipped for i in s.dropped_rollouts]
    all_ids = [r["id"] for records, _ in script for r in records]
    assert sorted(shipped_ids + dropped_ids) == sorted(all_ids)


def test_readme_example(capsys: pytest.CaptureFixture[str]) -> None:
    """The five lines of the README (with port=0 instead of the default 9487)."""
    rollouts, step = [ROLLOUT], 5
    # --- README ---
    monitor = StalenessMonitor(
        StalenessConfig(max_staleness=8), [PrometheusExporter(port=0), ConsoleExporter()], run="exp-42"
    )
    monitor.add(rollouts)  # whenever rollouts finish (SPEC 3 records)
    shipment = monitor.ship(step)  # in the batch callback: masks the batch, exports without blocking
    batch, metrics = [r.record() for r in shipment.rollouts], shipment.metrics  # train on it; log the dict
    monitor.close()  # at the end of training: flushes the exporters
    # --- end ---
    assert batch[0]["id"] == "r1" and metrics["staleness/rollout/max"] == 1
    assert capsys.readouterr().out.startswith("step 5 | Max Staleness 1 | ")


def test_console_through_the_monitor_uses_the_metrics_dict() -> None:
    stream = io.StringIO()
    with StalenessMonitor(StalenessConfig(max_staleness=8), [ConsoleExporter(stream)]) as monitor:
        monitor.add([ROLLOUT])
        monitor.ship(5)
    assert stream.getvalue() == "step 5 | Max Staleness 1 | token mean 1.00 | masked 0.0% | dropped 0 rollouts\n"


# ---------------------------------------------------------------------------------------------- SPEC 11 live path


class MismatchRecorder(Recorder):
    name = "mismatch-recorder"

    def __init__(self) -> None:
        super().__init__()
        self.mismatch: list[MismatchReport] = []

    def export_mismatch(self, report: MismatchReport) -> None:
        self.mismatch.append(report)


class BrokenMismatch(Broken):
    name = "broken-mismatch"

    def export_mismatch(self, report: MismatchReport) -> None:
        raise RuntimeError("exporter bug")


def test_record_mismatch_merges_calls_of_one_step_and_reaches_the_exporters() -> None:
    recorder, broken = MismatchRecorder(), BrokenMismatch()
    monitor = StalenessMonitor(StalenessConfig(), [recorder, broken])
    monitor.add(ROLLOUT)
    shipment = monitor.ship(6)
    assert shipment.lags.tolist() == [2, 2, -1]
    rank0 = mismatch_sums(shipment.lags[:2], [-1.0, -1.0], [-1.0, -0.5])
    rank1 = mismatch_sums(shipment.lags[2:], [-1.0], [-1.0])  # its only position is not sampled
    monitor.record_mismatch(6, rank0)
    total = monitor.record_mismatch(6, rank1.to_dict())  # the dict form, as sent from another process
    assert total == rank0 + rank1 == monitor.mismatch(6)
    assert [r.delta for r in recorder.mismatch] == [rank0, rank1]
    assert recorder.mismatch[-1].sums == total and recorder.mismatch[-1].step == 6
    assert total.metrics()["staleness/mismatch/lag_2/tokens"] == 2
    assert monitor.export_errors.count("broken-mismatch") == 1 + 2  # the ship, then each call: counted, not raised


def test_record_mismatch_refuses_a_step_never_shipped_and_bad_sums() -> None:
    recorder = MismatchRecorder()
    monitor = StalenessMonitor(StalenessConfig(), [recorder])
    monitor.add(ROLLOUT)
    monitor.ship(6)
    sums = mismatch_sums([0], [-1.0], [-1.0])
    with pytest.raises(ValueError, match="step: no batch was shipped for step 7"):
        monitor.record_mismatch(7, sums)
    bad = sums.to_dict()
    del bad["lags"]["16"]
    with pytest.raises(ValueError, match=r"lags\.16: missing lag bucket"):
        monitor.record_mismatch(6, bad)
    with pytest.raises(ValueError, match="step: must be an integer"):
        monitor.record_mismatch(True, sums)  # type: ignore[arg-type]
    assert recorder.mismatch == [] and monitor.mismatch(6) is None and monitor.mismatch(7) is None


@pytest.mark.parametrize("kind", [np.int64, np.uint64, np.int32])
def test_record_mismatch_takes_the_numpy_step_ship_took(kind: type[np.integer[Any]]) -> None:
    """Steps may be numpy integers: ship took ``step``, so record_mismatch does too (as an int)."""
    recorder = MismatchRecorder()
    monitor = StalenessMonitor(StalenessConfig(), [recorder])
    monitor.add(ROLLOUT)
    step = kind(6)
    monitor.ship(step)
    sums = mismatch_sums([0], [-1.0], [-1.0])
    assert monitor.record_mismatch(step, sums) == sums == monitor.mismatch(6)
    assert [type(r.step) for r in recorder.mismatch] == [int]  # (np.uint64 arithmetic would wrap)
    with pytest.raises(FieldError, match="step: must be an integer"):
        monitor.record_mismatch(kind(0), sums)


def test_shipped_steps_are_kept_as_runs_so_a_long_run_s_checkpoint_stays_small() -> None:
    """Steps never decrease: the steps shipped are runs ``[first, last]``, which answer which steps take
    mismatch sums as the steps did; a checkpoint saved as a list of steps (before runs) loads to the same."""
    from staleness_metrics.state_checks import digests_of

    monitor = StalenessMonitor(StalenessConfig())
    for i, step in enumerate([*range(1, 301), 305, 306, 306, 310]):
        monitor.add({"id": f"r{i}", "dispatch_version": 0, "samples": [{"mask": [1]}]})
        monitor.ship(step)
    state = monitor.state_dict()
    assert state["shipped_steps"] == [[1, 300], [305, 306], [310, 310]]
    old = {**state, "shipped_steps": [*range(1, 301), 305, 306, 310]}  # as saved before runs
    old["digests"] = digests_of({k: v for k, v in old.items() if k != "digests"}, skip=("sink",))
    for saved in (state, old):
        resumed = StalenessMonitor(StalenessConfig())
        resumed.load_state_dict(json.loads(json.dumps(saved)))
        assert resumed.state_dict()["shipped_steps"] == state["shipped_steps"]
        for step in (1, 150, 300, 305, 306, 310):
            resumed.record_mismatch(step, MismatchSums.zero())
        for step in (301, 304, 307, 311):
            with pytest.raises(FieldError, match=f"no batch was shipped for step {step}"):
                resumed.record_mismatch(step, MismatchSums.zero())
    for runs, named in (([[5, 3]], r"steps\[0\]: 3 is below 5"), ([[1, 4], 4], r"steps\[1\]: 4 is below 5")):
        bad = {**state, "shipped_steps": runs}
        bad["digests"] = digests_of({k: v for k, v in bad.items() if k != "digests"}, skip=("sink",))
        with pytest.raises(ConfigError, match=named):
            StalenessMonitor(StalenessConfig()).load_state_dict(bad)


def test_record_mismatch_refuses_an_env_no_exposition_can_carry() -> None:
    """An env with a lone surrogate (bytes decoded with ``surrogateescape``) is refused as ``add`` refuses it:
    a FieldError naming env, nothing recorded, and every later scrape and checkpoint still works."""
    recorder, prometheus = MismatchRecorder(), PrometheusExporter(port=None)
    monitor = StalenessMonitor(StalenessConfig(env_breakdown=True), [recorder, prometheus], run="x")
    monitor.add({**ROLLOUT, "env": "math"})
    monitor.ship(6)
    sums = mismatch_sums([0, 2], [-1.0, -1.0], [-1.1, -1.2])
    with pytest.raises(FieldError, match="env: not valid Unicode: lone surrogate U\\+DCFF at character 4") as raised:
        monitor.record_mismatch(6, sums, env="math\udcff")
    assert raised.value.field == "env"
    assert recorder.mismatch == [] and monitor.mismatch(6) is None and monitor.state_dict()["env_mismatch"] == []
    monitor.record_mismatch(6, sums, env="math")
    families = {f.name: f for f in text_string_to_metric_families(prometheus.exposition().decode())}
    envs = {s.labels["env"] for s in families["rl_staleness_mismatch_tokens"].samples if s.value}
    assert envs == {"", "math"}
    monitor.close()


@pytest.mark.parametrize("env", [None, "math"])
def test_record_mismatch_refuses_a_merge_past_int64_and_keeps_the_total(env: str | None) -> None:
    """Two posts in range whose merge is not (a count would wrap negative): the second is refused, recording
    nothing, the step's (and the env's) total kept, and the checkpoint still loads. (A sum cannot pass float64:
    each is capped per token.)"""
    recorder = MismatchRecorder()
    monitor = StalenessMonitor(StalenessConfig(env_breakdown=True), [recorder])
    monitor.add(ROLLOUT)
    monitor.ship(6)
    big = mismatch_sums([0], [-1.0], [-1.0]).to_dict()
    big["lags"]["0"]["tokens"] = 2**62
    first = monitor.record_mismatch(6, big, env=env)
    with pytest.raises(FieldError, match="sums: the step's merged sums overflow"):
        monitor.record_mismatch(6, big, env=env)
    assert monitor.mismatch(6) == first and len(recorder.mismatch) == 1
    StalenessMonitor(StalenessConfig(env_breakdown=True)).load_state_dict(json.loads(json.dumps(monitor.state_dict())))


def test_sums_re_applied_while_absorbing_move_the_counters_and_publish_nothing() -> None:
    """A restart re-applies journalled posts: counters catch up, row exporters write nothing twice."""
    recorder = MismatchRecorder()
    prometheus = PrometheusExporter(port=None)
    monitor = StalenessMonitor(StalenessConfig(), [recorder, prometheus], run="resumed")
    monitor.add(ROLLOUT)
    shipment = monitor.ship(6)
    sums = mismatch_sums(shipment.lags[:2], [-1.0, -1.0], [-1.0, -0.5])
    with monitor.absorbing():
        assert monitor.record_mismatch(6, sums) == sums
    assert recorder.mismatch == []  # not published again
    text = prometheus.exposition().decode()
    assert 'rl_staleness_mismatch_tokens_total{env="",lag="2",run="resumed"} 2.0' in text
    assert monitor.mismatch(6) == sums


# ---------------------------------------------------------------------------------------------- close


class SlowToClose:
    """An exporter whose ``close`` takes its whole ``close_timeout`` (a receiver that never answers)."""

    def __init__(self, name: str, close_timeout: float) -> None:
        self.name = name
        self.close_timeout = close_timeout
        self.closed = threading.Event()

    def export(self, report: StepReport) -> None:
        pass

    def close(self) -> None:
        time.sleep(self.close_timeout)
        self.closed.set()


class HangsOnClose:
    """An exporter whose ``close`` never returns by itself (until the test releases it)."""

    name = "hangs"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def export(self, report: StepReport) -> None:
        pass

    def close(self) -> None:
        self.entered.set()
        self.release.wait()


def test_close_closes_every_exporter_at_once_and_returns_despite_one_that_hangs() -> None:
    timeout = 1.0
    slow = [SlowToClose(f"slow-{n}", timeout) for n in range(4)]
    hanging = HangsOnClose()
    monitor = StalenessMonitor(CONFIG, [*slow, hanging])
    started = time.monotonic()
    monitor.close()
    elapsed = time.monotonic() - started
    try:
        assert all(exporter.closed.is_set() for exporter in slow)  # every slow one finished its close
        assert hanging.entered.is_set()  # the hanging one was asked to close too
        # One after another, the slow ones alone would take 4 timeouts, and the hanging one for ever.
        assert elapsed < 4 * timeout
        assert monitor.export_errors.count("hangs") == 1  # the unfinished close is counted
        assert all(monitor.export_errors.count(exporter.name) == 0 for exporter in slow)
    finally:
        hanging.release.set()


def test_errors_name_their_field_as_attributes_and_stay_value_errors() -> None:
    """The service answers 422 from ``.field`` and ``.reason``; callers catching ValueError still do."""
    monitor = StalenessMonitor(CONFIG, [])
    sums = mismatch_sums([0], [-1.0], [-1.0])
    with pytest.raises(ValueError) as unshipped:
        monitor.record_mismatch(7, sums)
    assert isinstance(unshipped.value, FieldError) and unshipped.value.field == "step"
    assert str(unshipped.value) == f"step: {unshipped.value.reason}"
    broken = sums.to_dict()
    del broken["lags"]["3"]
    with pytest.raises(FieldError) as missing:
        MismatchSums.from_dict(broken)
    assert (missing.value.field, missing.value.reason) == ("lags.3", "missing lag bucket")
    with pytest.raises(ConfigError) as setting:
        StalenessConfig.from_mapping({"max_staleness": -1})
    assert setting.value.field == "max_staleness" and str(setting.value).endswith(setting.value.reason)


# ---------------------------------------------------------------------------------------------- Ctrl-C inside a call


def interrupt(*args: Any, **kwargs: Any) -> None:
    raise KeyboardInterrupt  # as a Ctrl-C landing there


def scraped(prometheus: PrometheusExporter) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample a Prometheus scrape reads (creation times left out)."""
    families = text_string_to_metric_families(prometheus.exposition().decode())
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in families
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_a_ship_interrupted_by_ctrl_c_exports_nothing_and_the_next_ship_is_an_uninterrupted_run_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import staleness_metrics.engine.sink as sink_module

    def record(rid: str, version: int) -> dict[str, Any]:
        return {"id": rid, "dispatch_version": version, "samples": [{"mask": [1, 1]}]}

    config, runs = StalenessConfig(max_staleness=1), []
    for interrupted in (True, False):
        recorder, prometheus = Recorder(), PrometheusExporter(port=None)
        monitor = StalenessMonitor(config, [recorder, prometheus], run="r")
        monitor.add([record("a", 4), record("b", 2)])
        if interrupted:
            with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
                patch.setattr(sink_module, "compute_report", interrupt)
                monitor.ship(5)
            assert recorder.reports == []
            with pytest.raises(FieldError, match="no batch was shipped for step 5"):
                monitor.record_mismatch(5, mismatch_sums([0], [-1.0], [-1.0]))
            checkpoint = json.loads(json.dumps(monitor.state_dict()))
            StalenessMonitor(config, [PrometheusExporter(port=None)], run="r").load_state_dict(checkpoint)
        else:
            monitor.sweep(5)  # (the interrupted ship's sweep did happen)
        monitor.add([record("c", 5)])
        shipment = monitor.ship(6)
        totals = monitor.sink.totals
        assert monitor.sink.tokens_entered == totals.tokens_sampled + totals.tokens_dropped + monitor.sink.tokens_queued
        runs.append((shipment.ids, shipment.metrics, [r.step for r in recorder.reports], scraped(prometheus)))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("at", ["observe_mismatch", "observe_env_mismatch"])
def test_record_mismatch_interrupted_by_ctrl_c_keeps_nothing_and_its_retry_counts_once(
    at: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prometheus = PrometheusExporter(port=None)
    monitor = StalenessMonitor(StalenessConfig(env_breakdown=True), [prometheus], run="r")
    monitor.add({**ROLLOUT, "env": "math"})
    shipment = monitor.ship(6)
    sums = mismatch_sums(shipment.lags[:2], [-1.0, -1.0], [-1.0, -0.5])
    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(monitor.sink, at, interrupt)
        monitor.record_mismatch(6, sums, env="math")
    assert monitor.mismatch(6) is None and monitor.state_dict()["env_mismatch"] == []
    assert monitor.record_mismatch(6, sums, env="math") == sums == monitor.mismatch(6)  # the retry
    assert monitor.state_dict()["env_mismatch"] == [[6, "math", sums.to_dict()]]
    exported = scraped(prometheus)
    for env in ("", "math"):
        assert sum(v for (name, labels), v in exported.items()
                   if name == "rl_staleness_mismatch_tokens_total" and ("env", env) in labels) == 2  # fmt: skip


def test_record_mismatch_after_close_counts_and_logs_what_each_mismatch_exporter_loses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As a ship after close: the sums are recorded, each exporter that takes them counts them lost."""
    recorder, plain = MismatchRecorder(), Recorder()
    monitor = StalenessMonitor(StalenessConfig(), [recorder, plain])
    monitor.add(ROLLOUT)
    monitor.ship(6)
    monitor.close()
    sums = mismatch_sums([0], [-1.0], [-1.0])
    assert monitor.record_mismatch(6, sums) == sums == monitor.mismatch(6)
    assert recorder.mismatch == [] and monitor.export_errors.snapshot() == {"mismatch-recorder": 1, "recorder": 0}
    logged = [r.getMessage() for r in caplog.records]
    assert logged == ["exporter mismatch-recorder: record_mismatch after the monitor was closed; report not exported"]
