"""The demo: the simulated pipeline driving the real monitor and exporters, writing a run directory
(:mod:`staleness_metrics.replay.run_dir`) that ``staleness-metrics report`` reads whole."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ..config import StalenessConfig
from ..engine.shipment import Shipment
from ..engine.warm_up import warm_up
from ..exporters import ConsoleExporter, Exporter, JsonlExporter
from ..exporters.console import format_line
from ..metrics import keys
from ..metrics.report import Tally
from ..monitor import StalenessMonitor
from ..replay.run_dir import write_run_file
from .simulation import SimulatedTrainer, Simulation, StepEvents

RUN_NAME = "staleness-demo"


@dataclass
class DemoOptions:
    steps: int = 60
    speed: float = 4.0  # steps per second; 0 = as fast as possible
    config: StalenessConfig = field(default_factory=lambda: StalenessConfig(env_breakdown=True))
    seed: int = 0
    prometheus_port: int | None = 9487
    out_dir: Path = Path("staleness-demo")
    metrics_out: Path | None = None
    wandb: bool = True
    live: bool | None = None  # the rich live table; None = when stdout is a terminal


def _prometheus(port: int | None, say: Callable[[str], None]) -> Exporter | None:
    if port is None:
        return None
    try:
        from ..exporters import PrometheusExporter
    except ImportError as exc:  # the base install has numpy only: the demo runs without an endpoint
        say(f"no Prometheus endpoint: needs {exc.name or exc} (pip install 'staleness-metrics[prometheus]')")
        return None

    # a taken port is handled here (a free one instead): the exporter's own warning would confuse
    quiet = logging.getLogger("staleness_metrics.exporters")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        exporter = PrometheusExporter(port, "127.0.0.1")
    finally:
        quiet.setLevel(level)
    if exporter.url is None and port != 0:
        exporter.close()
        say(f"port {port} is taken on 127.0.0.1: serving Prometheus metrics on a free port instead")
        exporter = PrometheusExporter(0, "127.0.0.1")
    return exporter


def _wandb(out_dir: Path, options: DemoOptions, say: Callable[[str], None]) -> tuple[Exporter | None, Any]:
    """An offline W&B run (ours to finish) and its exporter, when wandb is installed."""
    if not options.wandb:
        return None, None
    try:
        import wandb
    except ImportError:
        return None, None
    from ..exporters import WandbExporter

    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        run = wandb.init(
            project=RUN_NAME,
            mode="offline",
            dir=str(out_dir),
            config={"max_staleness": options.config.max_staleness, "policy": options.config.policy},
            settings=wandb.Settings(x_disable_stats=True, console="off"),
        )
    except Exception as exc:  # W&B is a bonus here: never let it stop the demo
        say(f"W&B offline run not started ({type(exc).__name__}: {exc})")
        return None, None
    return WandbExporter(run), run


def _otlp(say: Callable[[str], None]) -> Exporter | None:
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return None
    try:
        from ..exporters import OtlpExporter

        return OtlpExporter(service_name=os.environ.get("OTEL_SERVICE_NAME", RUN_NAME))
    except Exception as exc:
        say(f"OTLP export not started ({type(exc).__name__}: {exc})")
        return None


# the live table's columns, and the report keys (with their format) of those between the counts
_COLS = ["env", "rollouts", "token mean", "p99", "masked", "max", "in flight", "in queue", "dropped"]
_CELLS = (
    (keys.TOKEN_MEAN, ".2f"),
    (keys.TOKEN_P99, "d"),
    (keys.TOKEN_MASKED, ".1%"),
    (keys.ROLLOUT_MAX, "d"),
    (keys.ROLLOUT_IN_FLIGHT_MEAN, ".2f"),
    (keys.ROLLOUT_IN_QUEUE_MEAN, ".2f"),
)


class _LiveTable:
    """The rich table under the step lines: per env, the last ship and the run so far."""

    def __init__(self, options: DemoOptions) -> None:
        from rich.console import Console
        from rich.live import Live

        self._options = options
        self.live = Live(console=Console(), refresh_per_second=4, transient=False)

    def update(
        self,
        events: StepEvents,
        shipment: Shipment,
        totals: Tally,
        cost: Mapping[str, object] | None,
    ) -> None:
        from rich.table import Table
        from rich.text import Text

        report = shipment.report
        # the step line goes above the table, through the live display's own console
        line = Text(format_line(report))
        line.highlight_words(["Max Staleness"], style="bold")
        self.live.console.print(line)
        c = self._options.config
        t = totals
        masked = f"{100 * t.tokens_masked / t.tokens_sampled:.2f}%" if t.tokens_sampled else "-"
        table = Table(
            title=f"step {report.step}/{self._options.steps} · policy v{events.policy_version} · "
            f"queue {events.queued} · in flight {events.in_flight} · "
            f"{c.policy} policy, max_staleness {c.max_staleness}",
            caption=f"run so far: {t.rollouts_shipped} live + {t.rollouts_frozen} frozen rollouts "
            f"shipped, {t.rollouts_dropped} dropped, {masked} of sampled tokens masked"
            f"{_cost_caption(cost)}",
        )
        for name in _COLS:
            table.add_column(name, justify="left" if name == "env" else "right")

        def row(name: str, metrics: Mapping[str, Any], tally: Tally) -> None:
            frozen = f" (+{tally.rollouts_frozen} frozen)" if tally.rollouts_frozen else ""
            cells = [format(metrics[key], fmt) if key in metrics else "-" for key, fmt in _CELLS]
            table.add_row(name, f"{tally.rollouts_shipped}{frozen}", *cells, str(tally.rollouts_dropped))

        for env in sorted(report.env_metrics):
            row(env or "(none)", report.env_metrics[env], report.env_tally[env])
        row("all", report.metrics, report.tally)
        self.live.update(table, refresh=True)


def _cost_caption(metrics: Mapping[str, object] | None) -> str:
    """What staleness cost the trainer at this step (SPEC 11) and the bound it suggests (SPEC 14)."""
    row = metrics or {}
    k3 = row.get(keys.MISMATCH_K3)
    if not isinstance(k3, float):
        return ""
    text = f"\ntrainer mismatch k3 {k3:.4f}"
    floor = row.get(keys.MISMATCH_FLOOR)
    if not isinstance(floor, float):
        return text + " (no floor yet)"
    text += f", floor {floor:.4g} ({row.get(keys.MISMATCH_FLOOR_SOURCE)})"
    excess = row.get(keys.MISMATCH_EXCESS_K3)
    text += f", excess {excess:.4g}" if isinstance(excess, float) else ""
    at_bound, suggested = row.get(keys.BOUND_EXCESS_AT_BOUND), row.get(keys.BOUND_SUGGESTED)
    text += f", at the bound {at_bound:.4g}" if isinstance(at_bound, float) else ""
    return text + (f", suggested bound {suggested}" if suggested is not None else "")


def _write(file: TextIO, rows: Iterable[dict[str, Any]]) -> None:
    file.write("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows))


def _paced(steps: int, speed: float, stop: threading.Event) -> Iterator[int]:
    """Step numbers 1..steps, each no earlier than its slot at ``speed`` steps per second."""
    start = time.monotonic()
    for index in range(steps):
        delay = start + index / speed - time.monotonic() if speed > 0 else 0.0
        if stop.wait(max(delay, 0.0)) or stop.is_set():
            return
        yield index + 1


@contextlib.contextmanager
def _ctrl_c_stops(stop: threading.Event) -> Iterator[None]:
    """The first Ctrl-C lets the current step finish, then stops; a second one interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_demo(options: DemoOptions, stream: TextIO | None = None) -> int:
    """Run the demo; returns the exit status (130 when interrupted)."""
    out = stream if stream is not None else sys.stdout
    say = functools.partial(print, file=out, flush=True)
    out_dir = options.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = options.metrics_out or out_dir / "metrics.jsonl"
    files = {
        "events": out_dir / "events.jsonl",
        "metrics": metrics_path,
        "trainer_logprobs": out_dir / "trainer-logprobs.jsonl",
        "mismatch_sums": out_dir / "mismatch-sums.jsonl",
    }
    # the run's JSONL files beside the metrics, written as things happen
    logs = {name: path.open("w", encoding="utf-8") for name, path in files.items() if name != "metrics"}
    live = options.live if options.live is not None else (stream is None and out.isatty())
    # the table needs rich; plain lines do not
    live = live and importlib.util.find_spec("rich") is not None
    exporters: list[Exporter] = [JsonlExporter(metrics_path)]
    monitor: StalenessMonitor | None = None
    wandb_run: Any = None
    shipped_steps = 0
    stop = threading.Event()
    interrupted = False
    try:
        # the engine's compiled loops: seconds on a fresh install, better before the first step
        warm_up()
        # each exporter joins the list as soon as it exists, to be closed whatever happens next
        prometheus = _prometheus(options.prometheus_port, say)
        exporters += [prometheus] if prometheus is not None else []
        wandb_exporter, wandb_run = _wandb(out_dir, options, say)
        exporters += [wandb_exporter] if wandb_exporter is not None else []
        otlp = _otlp(say)
        exporters += [otlp] if otlp is not None else []
        if not live:
            # last, so a printed step line means every other exporter has that step
            exporters.append(ConsoleExporter(out))
        monitor = StalenessMonitor(options.config, exporters, run=RUN_NAME)
        c = options.config
        say(f"staleness-metrics demo: {options.steps} steps, {c.policy} policy, bound {c.max_staleness}")
        url = getattr(prometheus, "url", None)
        if url:
            say(f"metrics URL: {url}")
        say(f"metrics file: {metrics_path}")
        say(f"events file: {files['events']}")
        write_run_file(out_dir, RUN_NAME, options.config, files, seed=options.seed)
        if wandb_run is not None:
            say(f"W&B offline run: {Path(wandb_run.dir).parent} (upload with `wandb sync`)")
        if otlp is not None:
            say("OTLP: exporting to the endpoint in OTEL_EXPORTER_OTLP_*ENDPOINT")
        simulation = Simulation(options.seed)
        trainer = SimulatedTrainer(options.seed)
        table = _LiveTable(options) if live else None
        totals = Tally()
        with _ctrl_c_stops(stop), table.live if table is not None else contextlib.nullcontext():
            for _, step_events in zip(_paced(options.steps, options.speed, stop), simulation.steps(), strict=False):
                _write(logs["events"], step_events.events())
                monitor.add(step_events.rollouts)
                shipment = monitor.ship(step_events.step, step_events.ship_ids)
                simulation.forget(shipment.dropped_rollouts)
                # trainer log-probs -> mismatch sums -> the exporters
                trained = trainer.train(monitor, shipment)
                if trained is not None:
                    logprobs = trained.trainer_logprobs.items()
                    _write(
                        logs["trainer_logprobs"],
                        ({"step": trained.step, "id": i, "trainer_logprobs": v} for i, v in logprobs),
                    )
                    _write(logs["mismatch_sums"], [{"step": trained.step, "sums": trained.sums.to_dict()}])
                totals += shipment.report.tally
                shipped_steps += 1
                if table is not None:
                    table.update(step_events, shipment, totals, monitor.mismatch_metrics(shipment.step))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        interrupted = interrupted or stop.is_set()
        with contextlib.suppress(KeyboardInterrupt):
            for log in logs.values():
                log.close()
            if monitor is not None:
                monitor.close()
            else:
                for exporter in exporters:
                    exporter.close()
            if wandb_run is not None:
                try:
                    wandb_run.finish()
                except Exception as exc:  # W&B is a bonus here, as at start
                    say(f"W&B offline run not finished cleanly ({type(exc).__name__}: {exc})")
    if monitor is not None:  # the steps the files hold, for whoever reads the directory
        write_run_file(out_dir, RUN_NAME, options.config, files, seed=options.seed, steps=shipped_steps)
    if interrupted:
        say(f"interrupted after {shipped_steps} steps; files are complete up to there")
    say(f"done: {shipped_steps} steps. Next: staleness-metrics report {out_dir}")
    return 130 if interrupted else 0
