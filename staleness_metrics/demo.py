"""``staleness-metrics demo``: a simulated asynchronous RL pipeline (the SPEC 9 events of a run,
the same for one seed every time) and trainer (SPEC 11's live path) driving the real monitor and
exporters into a run directory (:mod:`staleness_metrics.replay.run_dir`) for ``report``."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import io
import itertools
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

from .config import StalenessConfig
from .engine.shipment import Shipment
from .engine.warm_up import warm_up
from .errors import ConfigError
from .exporters import ConsoleExporter, Exporter, JsonlExporter
from .exporters.base import MissingExtra
from .exporters.console import format_line
from .exporters.jsonl import write_all
from .metrics import keys
from .metrics.mismatch import MismatchSums, mismatch_sums
from .metrics.report import Tally
from .monitor import StalenessMonitor
from .replay.run_dir import RUN_FILE, write_run_file


@dataclass(frozen=True)
class EnvProfile:
    """One environment: its share of prompts and its response-length distribution."""

    name: str
    share: float
    median_tokens: int
    spread: float  # sigma of log(length)
    turns: int = 1  # samples per rollout (multi-turn agent rollouts)


@dataclass(frozen=True)
class DemoSettings:
    """The embedded defaults of the demo pipeline."""

    workers: int = 64  # concurrent sequences over the inference fleet
    group_size: int = 4
    batch_rollouts: int = 64
    tokens_per_tick: int = 16
    train_ticks: int = 30
    load_delay_ticks: int = 3
    frozen_share: float = 0.1
    max_buffered: int = 224
    sampler_scale: float = 0.7  # mean of -logprob of a sampled token
    max_tokens: int = 8192
    envs: tuple[EnvProfile, ...] = (
        EnvProfile("math", 0.45, 220, 0.6),
        EnvProfile("code", 0.3, 420, 0.9),
        EnvProfile("agent", 0.25, 300, 0.7, turns=3),
    )


@dataclass
class _Rollout:
    id: str
    group_id: str
    env: str
    frozen: bool
    dispatch_version: int
    lengths: list[int]  # per sample (turn)
    spans: list[tuple[int, int]] = field(default_factory=list)  # (version, absolute position)
    done: int = 0  # positions sampled so far over all samples

    @property
    def total(self) -> int:
        return sum(self.lengths)


@dataclass
class _Worker:
    version: int = 0
    pending_version: int | None = None
    load_at: int = 0
    current: _Rollout | None = None


@dataclass(frozen=True)
class StepEvents:
    """What happened up to one ship: the rollouts that finished, then the ship itself."""

    step: int
    rollouts: list[dict[str, Any]]
    ship_ids: list[str]
    queued: int
    in_flight: int
    policy_version: int  # the version inference is sampling with when the batch ships

    def events(self) -> list[dict[str, Any]]:
        """As SPEC 9 event dicts."""
        rollout_events: list[dict[str, Any]] = [{"type": "rollout", "rollout": r} for r in self.rollouts]
        return [*rollout_events, {"type": "ship", "step": self.step, "ids": self.ship_ids}]


class Simulation:
    """The pipeline, in ticks of simulated time; :meth:`steps` yields one ship after another."""

    def __init__(self, seed: int = 0, settings: DemoSettings | None = None) -> None:
        self.settings = settings or DemoSettings()
        self._rng = np.random.default_rng(seed)
        self._logprob_rng = np.random.default_rng([seed, 7])  # apart: the events stay the same
        self._workers = [_Worker() for _ in range(self.settings.workers)]
        self._waiting: deque[_Rollout] = deque()  # dispatched, not yet on a worker
        self._queue: deque[str] = deque()  # finished, not yet shipped (ids)
        self._finished: list[dict[str, Any]] = []
        self._tick = self._groups = 0
        self._version = 0  # newest published version
        self._step = 1  # the next batch to ship
        self._train_until: int | None = None
        self._shares = np.array([env.share for env in self.settings.envs], dtype=float)
        self._shares /= self._shares.sum()

    def forget(self, ids: Iterable[str]) -> None:
        """Remove the rollouts the sink dropped from the simulated queue."""
        gone = set(ids)
        self._queue = deque(i for i in self._queue if i not in gone)

    @property
    def in_flight(self) -> int:
        return len(self._waiting) + sum(w.current is not None for w in self._workers)

    def steps(self) -> Iterator[StepEvents]:
        while True:  # one tick at a time
            self._tick += 1
            if self._train_until is not None and self._tick >= self._train_until:  # a new version
                self._train_until = None
                self._version = self._step - 1  # training batch S produces version S
                for worker in self._workers:
                    worker.pending_version = self._version
                    worker.load_at = self._tick + int(self._rng.integers(0, self.settings.load_delay_ticks + 1))
            self._dispatch()
            self._sample()
            if self._train_until is None and len(self._queue) >= self.settings.batch_rollouts:
                yield self._ship()

    def _dispatch(self) -> None:
        s = self.settings
        loaded = min(w.version for w in self._workers)  # what a dispatch can count on
        while self.in_flight + len(self._queue) + s.group_size <= s.max_buffered:
            self._groups += 1
            env = s.envs[int(self._rng.choice(len(s.envs), p=self._shares))]
            frozen = bool(self._rng.random() < s.frozen_share)
            group = f"g{self._groups}"
            log_median = np.log(env.median_tokens / env.turns)  # of a turn's length
            for member in range(s.group_size):
                drawn = self._rng.lognormal(log_median, env.spread, env.turns)
                lengths = np.clip(drawn, 4, s.max_tokens).astype(int).tolist()
                name = "frozen-teacher" if frozen else env.name
                # The orchestrator stamps the version it knows of; the engine may start it later.
                self._waiting.append(_Rollout(f"{group}-r{member}", group, name, frozen, loaded, lengths))

    def _sample(self) -> None:
        for worker in self._workers:
            if worker.pending_version is not None and self._tick >= worker.load_at:
                worker.version, worker.pending_version = worker.pending_version, None
                if worker.current is not None and not worker.current.frozen:
                    # New weights in the middle of a response: the rest is sampled by them.
                    worker.current.spans.append((worker.version, worker.current.done))
            if worker.current is None and self._waiting:
                worker.current = self._waiting.popleft()
                worker.current.spans.append((worker.version, 0))
            rollout = worker.current
            if rollout is None:
                continue
            rollout.done = min(rollout.total, rollout.done + self.settings.tokens_per_tick)
            if rollout.done == rollout.total:
                self._finished.append(self._record(rollout, worker.version))
                self._queue.append(rollout.id)
                worker.current = None

    def _ship(self) -> StepEvents:
        ids = [self._queue.popleft() for _ in range(self.settings.batch_rollouts)]
        step = StepEvents(self._step, self._finished, ids, len(self._queue), self.in_flight, self._version)
        self._finished = []
        self._train_until = self._tick + self.settings.train_ticks
        self._step += 1
        return step

    def _record(self, rollout: _Rollout, completion_version: int) -> dict[str, Any]:
        samples = []
        offset = 0
        for turn, length in enumerate(rollout.lengths):
            mask = [1] * length
            if turn > 0:
                # a multi-turn sample starts with the tool's output, which the policy did not sample
                tool = min(length - 1, int(self._rng.integers(2, 12)))
                mask[:tool] = [0] * tool
            logprobs = np.round(-self._logprob_rng.exponential(self.settings.sampler_scale, length), 6)
            sample: dict[str, Any] = {"mask": mask, "logprobs": logprobs.tolist()}
            if not rollout.frozen:
                sample["weight_versions"] = _spans_of(rollout.spans, offset, length)
            samples.append(sample)
            offset += length
        record: dict[str, Any] = dict(id=rollout.id, group_id=rollout.group_id, env=rollout.env)
        record["samples"] = samples
        if rollout.frozen:
            record["source"] = "frozen"
        else:
            record["dispatch_version"] = rollout.dispatch_version
            record["completion_version"] = completion_version
            record["agentic"] = len(rollout.lengths) > 1
        return record


def _spans_of(spans: list[tuple[int, int]], offset: int, length: int) -> list[list[int]]:
    """The ``[version, start]`` spans of positions ``offset .. offset+length-1`` of a sample."""
    out: list[list[int]] = []
    for i, (version, start) in enumerate(spans):
        end = spans[i + 1][1] if i + 1 < len(spans) else offset + length
        lo, hi = max(start, offset), min(end, offset + length)
        if lo < hi and not (out and out[-1][0] == version):
            out.append([version, lo - offset])
    return out


@dataclass(frozen=True)
class DriftModel:
    """The trainer's log-probability is the sampler's plus ``Normal(-σ²/2, σ²)``, where
    ``σ(ℓ)² = floor² + (speed·ℓ)²`` at lag ``ℓ``; ``speed`` may ramp up (warm-up)."""

    floor: float = 0.05
    drift_per_version: float = 0.009
    warmup_steps: int = 0

    def sigma(self, lags: npt.NDArray[np.int64], step: int) -> npt.NDArray[np.float64]:
        warm = 1.0 if self.warmup_steps <= 0 else min(1.0, step / self.warmup_steps)
        return np.sqrt(self.floor**2 + (self.drift_per_version * warm * np.maximum(lags, 0)) ** 2)


def shipped_values(shipment: Shipment, name: str) -> npt.NDArray[np.float64]:
    """The shipped samples' ``name`` array (``mask``, ``logprobs``, ``trainer_logprobs``) in ship
    order, as a trainer reads it, aligned with ``shipment.lags``; NaN where a sample lacks it."""
    samples = [s for rollout in shipment.rollouts for s in rollout.record(arrays=True)["samples"]]
    parts = [np.asarray(s.get(name, np.full(len(s["mask"]), np.nan)), np.float64) for s in samples]
    return np.concatenate(parts) if parts else np.zeros(0)


def shipped_mask(shipment: Shipment) -> npt.NDArray[np.bool_]:
    """The shipped samples' masks (as trained), aligned with ``shipment.lags``."""
    return shipped_values(shipment, "mask") > 0


@dataclass(frozen=True)
class TrainedBatch:
    """One ship's recorded sums and trainer log-probabilities: per rollout, one list per sample
    as added (``None`` for a sample not shipped)."""

    step: int
    sums: MismatchSums
    trainer_logprobs: dict[str, list[list[float] | None]]


class SimulatedTrainer:
    """Computes trainer log-probabilities of each shipped batch and records their mismatch sums."""

    def __init__(self, seed: int = 0, model: DriftModel | None = None, ranks: int = 2) -> None:
        self.model = model or DriftModel()
        self.ranks = ranks
        self._rng = np.random.default_rng([seed, 11])  # apart: the pipeline's events stay the same

    def train(self, monitor: StalenessMonitor, shipment: Shipment) -> TrainedBatch | None:
        """Sums per rank, merged and recorded with the monitor (None when the ship took nothing)."""
        lags = shipment.lags
        if len(lags) == 0:
            return None
        sampler = shipped_values(shipment, "logprobs")
        sigma = self.model.sigma(lags, shipment.step)
        trainer = np.round(sampler + self._rng.normal(-(sigma**2) / 2, sigma), 6)
        masked = ~shipped_mask(shipment)
        # Ranks take contiguous runs of whole samples, as a data-parallel split of the batch would.
        offsets = shipment.lag_offsets
        cuts = [int(offsets[round(i * (len(offsets) - 1) / self.ranks)]) for i in range(self.ranks + 1)]
        ranks = [
            mismatch_sums(lags[lo:hi], sampler[lo:hi], trainer[lo:hi], masked=masked[lo:hi])
            for lo, hi in itertools.pairwise(cuts)
        ]
        total = monitor.record_mismatch(shipment.step, sum(ranks, MismatchSums.zero()))
        return TrainedBatch(shipment.step, total, _per_rollout(shipment, trainer))


def _per_rollout(shipment: Shipment, values: npt.NDArray[np.float64]) -> dict[str, list[list[float] | None]]:
    """``values`` (aligned with ``shipment.lags``) cut back into each rollout's samples."""
    out: dict[str, list[list[float] | None]] = {}
    shipped = iter(np.split(values, shipment.lag_offsets[1:-1]))  # one part per shipped sample
    for rollout in shipment.rollouts:
        first, end = rollout.batch.sample_offsets[rollout.index : rollout.index + 2].tolist()
        samples: list[list[float] | None] = [None] * (end - first)
        for k in rollout.samples:
            samples[k] = next(shipped).tolist()
        out[rollout.id] = samples
    return out


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
        from .exporters import PrometheusExporter
    except ImportError as exc:  # the base install has numpy only: the demo runs without an endpoint
        say(f"no Prometheus endpoint: {exc}")
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
    except ImportError as exc:
        say(f"no W&B run: {MissingExtra('WandbExporter', exc.name, 'wandb')}")
        return None, None
    from .exporters import WandbExporter

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
    if not (os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        return None
    try:
        from .exporters import OtlpExporter

        return OtlpExporter(service_name=os.environ.get("OTEL_SERVICE_NAME", RUN_NAME))
    except Exception as exc:
        say(f"OTLP export not started ({type(exc).__name__}: {exc})")
        return None


# the live table's columns, and the report keys (with their format) of those between the counts
_COLS = ["env", "rollouts", "token mean", "p99", "masked", "max", "in flight", "in queue", "dropped"]
_CELLS = ((keys.TOKEN_MEAN, ".2f"), (keys.TOKEN_P99, "d"), (keys.TOKEN_MASKED, ".1%"),
          (keys.ROLLOUT_MAX, "d"), (keys.ROLLOUT_IN_FLIGHT_MEAN, ".2f"),
          (keys.ROLLOUT_IN_QUEUE_MEAN, ".2f"))  # fmt: skip


class _LiveTable:
    """The rich table under the step lines: per env, the last ship and the run's totals so far."""

    def __init__(self, options: DemoOptions) -> None:
        from rich.console import Console
        from rich.live import Live

        self._options = options
        self._totals = Tally()
        self.live = Live(console=Console(), refresh_per_second=4, transient=False)

    def update(self, events: StepEvents, shipment: Shipment, cost: Mapping[str, object] | None) -> None:
        from rich.table import Table
        from rich.text import Text

        report = shipment.report
        self._totals += report.tally
        # the step line goes above the table, through the live display's own console
        line = Text(format_line(report))
        line.highlight_words(["Max Staleness"], style="bold")
        self.live.console.print(line)
        c, t = self._options.config, self._totals
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


def _lines(rows: Iterable[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows).encode()


def _paced(steps: int, speed: float, stop: threading.Event) -> Iterator[int]:
    """Step numbers 1..steps, each no earlier than its slot at ``speed`` steps per second."""
    start = time.monotonic()
    for index in range(steps):
        delay = start + index / speed - time.monotonic() if speed > 0 else 0.0
        if stop.wait(min(max(delay, 0.0), threading.TIMEOUT_MAX)):  # a tiny speed: a long wait
            return
        yield index + 1


@contextlib.contextmanager
def _guarded(out_dir: Path, stop: threading.Event, caught: list[int]) -> Iterator[None]:
    """Holds ``out_dir``'s lock (OSError if another demo does) and takes Ctrl-C and SIGTERM, each
    added to ``caught``: while ``stop`` is clear one sets it (the step finishes), else it raises."""

    def handler(signum: int, frame: object) -> None:
        caught.append(signum)
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    with (out_dir / ".demo.lock").open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:  # any other: a file system without locks (Lustre): unguarded
            if isinstance(error, BlockingIOError):
                raise OSError(f"{out_dir} is in use by another demo") from None
        main = threading.current_thread() is threading.main_thread()  # where handlers can be set
        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM) if main}
        try:
            yield
        finally:
            for signum, action in previous.items():
                signal.signal(signum, action)


def run_demo(options: DemoOptions, stream: TextIO | None = None) -> int:
    """Run the demo; returns the exit status: 0, or 128 + the signal that stopped it (130 Ctrl-C,
    143 SIGTERM). OSError when another demo uses ``options.out_dir`` (:func:`_guarded`)."""
    out = stream if stream is not None else sys.stdout
    say = functools.partial(print, file=out, flush=True)
    warn = functools.partial(print, file=sys.stderr, flush=True)  # (stdout holds the run's lines)
    out_dir = options.out_dir
    names = ("events", "metrics", "trainer_logprobs", "mismatch_sums")  # as run.json lists them
    files = {name: out_dir / f"{name.replace('_', '-')}.jsonl" for name in names}
    files["metrics"] = metrics_path = options.metrics_out or files["metrics"]
    own = {name: path for name, path in files.items() if name != "metrics"}  # beside the metrics
    if metrics_path.resolve() in {path.resolve() for path in [*own.values(), out_dir / RUN_FILE]}:
        raise ConfigError(f"metrics-out: {metrics_path} is one of the demo's files in {out_dir}")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"out-dir: {out_dir} is not a folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    stop, caught = threading.Event(), list[int]()
    guard = contextlib.ExitStack()
    guard.enter_context(_guarded(out_dir, stop, caught))  # to the end; for now a signal sets stop
    has_rich = importlib.util.find_spec("rich") is not None
    if options.live and not has_rich:  # asked for (not a terminal's default): say why there is none
        warn(f"no live table: {MissingExtra('--live', 'rich', 'cli')}")
    live = has_rich and (stream is None and out.isatty() if options.live is None else options.live)
    logs: dict[str, io.FileIO] = {}  # unbuffered: each step written by the time it is finished
    kept: dict[str, int] = {}  # where each log's last finished step ends, to cut it back there
    exporters: list[Exporter] = []
    monitor: StalenessMonitor | None = None
    wandb_run: Any = None
    shipped_steps, listed = 0, dict[str, Path]()  # listed: what run.json names, once it is this run's
    try:
        # every output opened before the last run's files are touched: one that fails leaves them
        logs.update((name, path.open("ab", buffering=0)) for name, path in own.items())
        exporters.append(JsonlExporter(metrics_path))
        listed = {name: path for name, path in files.items() if path.is_file()}  # (not a pipe)
        # this run's run.json, then its files emptied: never the last run's run.json over them
        write_run_file(out_dir, RUN_NAME, options.config, listed, seed=options.seed)
        kept = {name: file.truncate(0) for name, file in logs.items()}
        stop.set()  # until the first step, a signal interrupts at once: there is no step to finish
        warm_up()  # the compiled loops: seconds on a fresh install, better before the first step
        # each exporter joins the list as soon as it exists, to be closed whatever happens next
        prometheus = _prometheus(options.prometheus_port, warn)
        exporters += [prometheus] if prometheus is not None else []
        wandb_exporter, wandb_run = _wandb(out_dir, options, warn)
        exporters += [wandb_exporter] if wandb_exporter is not None else []
        otlp = _otlp(warn)
        exporters += [otlp] if otlp is not None else []
        if not live:  # last, so a printed step line means every other exporter has that step
            exporters.append(ConsoleExporter(out))
        monitor = StalenessMonitor(options.config, exporters, run=RUN_NAME)
        c = options.config
        say(f"staleness-metrics demo: {options.steps} steps, {c.policy} policy, bound {c.max_staleness}")
        if url := getattr(prometheus, "url", None):
            say(f"metrics URL: {url}")
        say(f"metrics file: {metrics_path}")
        say(f"events file: {files['events']}")
        if wandb_run is not None:
            say(f"W&B offline run: {Path(wandb_run.dir).parent} (upload with `wandb sync`)")
        if otlp is not None:
            say("OTLP: exporting to the endpoint in OTEL_EXPORTER_OTLP_*ENDPOINT")
        simulation, trainer = Simulation(options.seed), SimulatedTrainer(options.seed)
        table = _LiveTable(options) if live else None
        if not caught:  # from here, the first signal lets the current step finish
            stop.clear()
        with table.live if table is not None else contextlib.nullcontext():
            for _, step_events in zip(_paced(options.steps, options.speed, stop), simulation.steps(), strict=False):
                write_all(logs["events"], _lines(step_events.events()))
                monitor.add(step_events.rollouts)
                shipment = monitor.ship(step_events.step, step_events.ship_ids)
                simulation.forget(shipment.dropped_rollouts)
                trained = trainer.train(monitor, shipment)
                if trained is not None:
                    s, logprobs = trained.step, trained.trainer_logprobs.items()
                    rows = ({"step": s, "id": i, "trainer_logprobs": v} for i, v in logprobs)
                    write_all(logs["trainer_logprobs"], _lines(rows))
                    sums = {"step": s, "sums": trained.sums.to_dict()}
                    write_all(logs["mismatch_sums"], _lines([sums]))
                kept = {name: file.seek(0, os.SEEK_END) for name, file in logs.items()}
                shipped_steps += 1
                if table is not None:
                    table.update(step_events, shipment, monitor.mismatch_metrics(shipment.step))
    except KeyboardInterrupt:
        caught.append(signal.SIGINT)  # (after the signal that raised it, if one did)
    finally:
        with guard, contextlib.suppress(KeyboardInterrupt):  # a second signal: at once
            for name, file in logs.items():  # to the last finished step (a write failed, Ctrl-C)
                with file, contextlib.suppress(OSError):
                    file.truncate(kept.get(name))  # (None: where it is, the end of the last run's)
            for each in [monitor] if monitor is not None else exporters:
                each.close()  # the monitor closes its exporters
            if wandb_run is not None:
                try:
                    wandb_run.finish()
                except Exception as exc:  # W&B is a bonus here, as at start
                    warn(f"W&B offline run not finished cleanly ({type(exc).__name__}: {exc})")
            if listed:  # the steps the files hold, for whoever reads the directory
                write_run_file(out_dir, RUN_NAME, options.config, listed, seed=options.seed, steps=shipped_steps)
    if caught:
        say(f"interrupted after {shipped_steps} steps; files are complete up to there")
    say(f"done: {shipped_steps} steps. Next: staleness-metrics report {shlex.quote(str(out_dir))}")
    return 128 + caught[0] if caught else 0
