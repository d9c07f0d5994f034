"""The orchestrator plugin: a sink plus exporters, called when rollouts arrive and when a batch
ships; an exporter's failure is counted and logged, never raised into the training loop."""

from __future__ import annotations

import dataclasses
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from . import state_checks
from .config import StalenessConfig
from .engine.checkpoint import check_mismatch
from .engine.shipment import Shipment
from .engine.sink import Sink, StepNumber, checked_step
from .errors import ConfigError, FieldError, FieldTypeError, StalenessError
from .exporters import ExportContext, Exporter, ExportErrors, MismatchAware, MismatchReport, MonitorAware
from .exporters.base import AFTER_FORK, DEFAULT_CLOSE_TIMEOUT, DEFAULT_RUN, seconds, time_left
from .exporters.state import CumulativeExporter
from .metrics.bound import mismatch_metrics
from .metrics.keys import MAX_STALENESS
from .metrics.mismatch import MismatchSums
from .metrics.report import MetricValue, StepReport
from .records.columnar import RolloutBatch
from .records.model import Rollout
from .records.validation import lone_surrogate, surrogate_reason
from .state_checks import digests_of, fail, integer, join, keys, mapping, sequence, string

K = TypeVar("K")
V = TypeVar("V")
Report = StepReport | MismatchReport  # what the exporters are sent

MISMATCH_STEPS_KEPT = 1024  # per-step totals kept for late calls; counters are cumulative anyway
CLOSE_GRACE = 0.25  # seconds past the exporters' close timeouts: returning at one is on time


def _keep(kept: dict[K, V], key: K, value: V) -> None:
    """Set ``kept[key]``, forgetting the earliest keys beyond :data:`MISMATCH_STEPS_KEPT`."""
    kept[key] = value
    while len(kept) > MISMATCH_STEPS_KEPT:
        del kept[min(kept)]  # type: ignore[type-var]


def _run_on(runs: list[list[int]], first: int, last: int) -> None:
    """Add the steps ``first..last`` (none below those in ``runs``) to the runs."""
    if runs and runs[-1][1] >= first - 1:
        runs[-1][1] = last
    else:
        runs.append([first, last])


def _in(runs: list[list[int]], step: int) -> bool:
    """Whether ``step`` is in one of the ``[first, last]`` runs (in order)."""
    i = bisect_right(runs, step, key=lambda run: run[0])
    return i > 0 and runs[i - 1][1] >= step


class StalenessMonitor:
    """Owns a :class:`~staleness_metrics.engine.sink.Sink` and a list of exporters; safe to call
    from several threads. ``run`` labels every Prometheus series and OTLP point; ``sink`` is one you
    built (e.g. with a custom policy), whose config is then the monitor's."""

    def __init__(
        self,
        config: StalenessConfig | None = None,
        exporters: Iterable[Exporter] = (),
        *,
        run: str = DEFAULT_RUN,
        sink: Sink | None = None,
        error_log_interval: float = 30.0,
    ) -> None:
        given = {"config": (config, StalenessConfig), "sink": (sink, Sink), "run": (run, str)}
        for name, (value, kind) in given.items():
            if value is not None and not isinstance(value, kind):
                raise FieldTypeError(name, f"expected a {kind.__name__}, got {value!r}")
        if sink is not None and config is not None and sink.config != config:
            raise ConfigError("config: pass either a config or a sink built with it, not two different ones")
        self.export_errors = ExportErrors(log_interval=error_log_interval)
        if isinstance(exporters, Exporter) or not isinstance(exporters, Iterable):
            raise FieldTypeError("exporters", f"expected a list of exporters, got {exporters!r}")
        self.exporters: tuple[Exporter, ...] = tuple(exporters)
        for i, exporter in enumerate(self.exporters):
            where = f"exporters[{i}]"
            if not isinstance(exporter, Exporter):
                raise FieldTypeError(where, f"no name, export, close: {exporter!r}")
            for attribute in ("name", "export", "close"):  # (names label series, key checkpoints)
                value, is_name = getattr(exporter, attribute), attribute == "name"
                if not (isinstance(value, str) if is_name else callable(value)):
                    wanted = "a string" if is_name else "a method"
                    raise FieldTypeError(f"{where}.{attribute}", f"expected {wanted}, got {value!r}")
        self.sink = sink if sink is not None else Sink(config or StalenessConfig())
        self.run = run
        context = ExportContext(run=run, errors=self.export_errors, env_breakdown=self.config.env_breakdown)
        # by a name unique here (``name#2`` for a second of a name): errors' label, checkpoint key
        self._named: dict[str, Exporter] = {}
        for exporter in self.exporters:
            key, n = exporter.name, 1
            while key in self._named:
                n += 1
                key = f"{exporter.name}#{n}"
            self._named[key] = exporter
            self.export_errors.register(key)
            if isinstance(exporter, MonitorAware):
                exporter.attach(dataclasses.replace(context, exporter=key))
        self._stateful = {k: e for k, e in self._named.items() if isinstance(e, CumulativeExporter)}
        self._lock = _CallLock()
        self.adapter_lock = _CallLock()  # one adapter call at a time, read to rows handed back
        AFTER_FORK.add(self)
        self._closed = self._absorbing = False
        self._closing: dict[str, threading.Event] = {}  # set once its exporter closed
        self._shipped_steps: list[list[int]] = []  # [first, last] runs: steps never decrease
        self._ship_bounds: dict[int, int] = {}  # the bound each step's (latest) ship was judged with
        self._mismatch: dict[int, MismatchSums] = {}  # per step (the latest), merged over calls
        self._mismatch_metrics: dict[int, dict[str, MetricValue]] = {}  # their keys, as published
        self._env_mismatch: dict[int, dict[str, MismatchSums]] = {}  # per step, by env

    def _after_fork(self) -> None:  # in a forked child: the parent exports (and may hold the lock)
        self._lock, self.adapter_lock, self._closed, self._closing = _CallLock(), _CallLock(), True, {}

    @property
    def config(self) -> StalenessConfig:
        return self.sink.config

    def add(self, rollouts: RolloutBatch | Rollout | Mapping[str, Any] | Iterable[Any]) -> int:
        """Queue finished rollouts (SPEC 3 records, an iterable of them, or a columnar batch)."""
        with self._lock:
            return self.sink.add(rollouts)

    def sweep(self, step: StepNumber) -> None:
        """Apply the policy at ``step`` to the queue; drops are reported with the next ship."""
        with self._lock:
            self.sink.sweep(step)

    def ship(self, step: StepNumber, ids: Iterable[str] | None = None) -> Shipment:
        """Mask and take the batch for ``step``, export its report (SPEC 6), return the shipment."""
        with self._lock:
            shipment = self.sink.ship(step, ids)
            _run_on(self._shipped_steps, shipment.step, shipment.step)
            _keep(self._ship_bounds, shipment.step, int(shipment.metrics[MAX_STALENESS]))
            self._publish(shipment.report, "ship", "export")
        return shipment

    def _publish(self, report: Report, call: str, method: str, kind: type = object) -> None:
        """``method(report)`` of each exporter of ``kind`` (under the lock: in call order); once the
        monitor is closed, the sink still works: each exporter's loss is counted and logged."""
        if self._absorbing:  # published before a restart: the counters catch up, send nothing
            for stateful in self._stateful.values():
                stateful.absorb(report)
            return
        lost = f"{call} after the monitor was closed; report not exported"
        to = [(name, e) for name, e in self._named.items() if isinstance(e, kind)]
        for name, exporter in to:
            if self._closed:
                self.export_errors.record(name, lost)
                continue
            try:
                getattr(exporter, method)(report)
            except Exception as exc:
                self.export_errors.record(name, f"{method} raised", exc)

    def state_dict(self) -> dict[str, Any]:
        """Everything later ships depend on (the sink's, the cumulative exporters' and the export
        error counts), as plain JSON-serialisable data (SPEC 13)."""
        with self._lock:
            state: dict[str, Any] = {
                "format": state_checks.FORMAT,
                "run": self.run,
                "sink": self.sink.state_dict(),
                "exporters": {name: e.state_dict() for name, e in self._stateful.items()},
                "export_errors": self.export_errors.snapshot(),
                "shipped_steps": [list(run) for run in self._shipped_steps],
                "ship_bounds": [list(pair) for pair in sorted(self._ship_bounds.items())],
                "mismatch": [[step, s.to_dict()] for step, s in sorted(self._mismatch.items())],
                "env_mismatch": [
                    [step, env, sums.to_dict()]
                    for step, envs in sorted(self._env_mismatch.items())
                    for env, sums in sorted(envs.items())
                ],
            }
        state["digests"] = digests_of(state, skip=("sink",))  # the sink's state carries its own
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`, exporters' series included (one absent from it starts
        afresh). All or nothing: a bad state (or another policy's) raises ``ConfigError`` naming the
        key path and the reason, and the monitor stays as it was."""
        state_checks.check_format(state, "monitor")
        state = keys(state, "", ("format", "run", "sink", "exporters", "export_errors", "shipped_steps", "mismatch"),
                     ("digests", "env_mismatch", "ship_bounds"))  # fmt: skip
        if state["format"] != 1 and "digests" not in state:
            fail("digests", "missing")
        string(state["run"], "run")
        with self._lock:
            sink_state = self.sink.check_state_dict(state["sink"], "sink")
            saved = mapping(state["exporters"], "exporters")
            loads = {name: saved[name] for name in self._stateful if name in saved}
            for name, exporter_state in loads.items():
                self._stateful[name].check_state_dict(exporter_state, join("exporters", name))
            errors = mapping(state["export_errors"], "export_errors")
            error_counts = {string(name, "export_errors"): integer(n, join("export_errors", str(name)), 0)
                            for name, n in errors.items()}  # fmt: skip
            shipped: list[list[int]] = []
            for i, run in enumerate(sequence(state["shipped_steps"], "shipped_steps")):
                where = join("shipped_steps", i)  # [first, last], or (before runs) a step
                first, last = (run, run) if isinstance(run, int) else sequence(run, where, 2)
                first = integer(first, where, shipped[-1][1] + 1 if shipped else 1, sink_state.step)
                _run_on(shipped, first, integer(last, where, first, sink_state.step))

            def by_shipped_step(name: str, check: Callable[[Any, str], V]) -> dict[int, V]:
                out: dict[int, V] = {}
                for i, item in enumerate(sequence(state.get(name, []), name)):
                    where = join(name, i)
                    step, value = sequence(item, where, 2)
                    step = integer(step, join(where, 0), 1)
                    if not _in(shipped, step) or step in out:
                        fail(join(where, 0), f"step {step} was not shipped, or appears twice")
                    out[step] = check(value, join(where, 1))
                return out

            mismatch = by_shipped_step("mismatch", check_mismatch)
            env_mismatch: dict[int, dict[str, MismatchSums]] = {}
            for i, item in enumerate(sequence(state.get("env_mismatch", []), "env_mismatch")):
                where = join("env_mismatch", i)
                step, env, sums = sequence(item, where, 3)
                step, env = integer(step, join(where, 0), 1), string(env, join(where, 1))
                if not _in(shipped, step) or not env or env in env_mismatch.setdefault(step, {}):
                    reason = "was not shipped, has no env name, or appears twice"
                    fail(where, f"step {step} of env {env!r} {reason}")
                env_mismatch[step][env] = check_mismatch(sums, join(where, 2))
            # (ship_bounds absent before: sums then judge at the bound in force)
            ship_bounds = by_shipped_step("ship_bounds", lambda n, at: integer(n, at, 0))
            state_checks.check_digests(state, "", skip=("sink",))
            for name, exporter_state in loads.items():  # all checked: replace
                self._stateful[name].load_state_dict(exporter_state)
            self.sink.load_checked(sink_state)
            self.export_errors.restore(error_counts)
            self._shipped_steps, self._ship_bounds = shipped, ship_bounds
            self._mismatch, self._env_mismatch = mismatch, env_mismatch
            self._mismatch_metrics = {}

    @contextmanager
    def absorbing(self) -> Iterator[None]:
        """Within this block ships and trainer-side sums are folded into the exporters' state but
        not published (re-applying what was published before a restart)."""
        with self._lock:
            self._absorbing = True
        try:
            yield
        finally:
            with self._lock:
                self._absorbing = False

    def record_mismatch(
        self, step: StepNumber, sums: MismatchSums | Mapping[str, Any], env: str | None = None
    ) -> MismatchSums:
        """Record and publish trainer-side SPEC 11 sums (or their ``to_dict()``) of a shipped
        ``step``; returns the step's total. Calls for one step merge; an ``env``'s sums count in
        its env breakdown series too. A bad step, env or dict: ``ValueError``, nothing recorded."""
        step = checked_step(step)  # (numpy's too, as ship's)
        if env is not None and (not isinstance(env, str) or not env):
            raise FieldError("env", f"expected a non-empty env name, got {env!r}")
        if env is not None and (at := lone_surrogate(env)) is not None:  # UTF-8 cannot carry it
            raise FieldError("env", surrogate_reason(env, at))
        delta = sums if isinstance(sums, MismatchSums) else MismatchSums.from_dict(sums)
        with self._lock:
            if not _in(self._shipped_steps, step):
                shipped = "mismatch sums belong to a shipped step"
                raise FieldError("step", f"no batch was shipped for step {step}; {shipped}")
            total = self._mismatch.get(step, MismatchSums.zero()).merged(delta)
            envs = self._env_mismatch.get(step, {})  # kept by step, as the batch's total
            env = env if self.config.env_breakdown else None
            if env is not None:  # (merged before anything changes: all or nothing)
                envs = {**envs, env: envs.get(env, MismatchSums.zero()).merged(delta)}
            judged = self._ship_bounds.get(step)  # SPEC 14's excess at the bound the ship used
            # The sums are kept after all that can fail (Ctrl-C too): an interrupted call kept
            # nothing, its retry counts once (the trackers take a step's total: the same again)
            bound = self.sink.observe_mismatch(step, total, merge=True, bound=judged)
            env_metrics: dict[str, dict[str, MetricValue]] = {}
            if env is not None:
                env_bound = self.sink.observe_env_mismatch(step, env, envs[env], merge=True, bound=judged)
                env_metrics[env] = mismatch_metrics(envs[env], env_bound)
            report = MismatchReport(step, total, delta, bound, env_metrics, env)
            _keep(self._mismatch, step, total)
            if env is not None:
                _keep(self._env_mismatch, step, envs)
            _keep(self._mismatch_metrics, step, report.metrics)
            self._publish(report, "record_mismatch", "export_mismatch", MismatchAware)
        return total

    def mismatch(self, step: StepNumber) -> MismatchSums | None:
        """The trainer-side sums recorded for ``step`` so far (None when none were)."""
        with self._lock:
            return self._mismatch.get(int(step))

    def mismatch_metrics(self, step: StepNumber) -> dict[str, MetricValue] | None:
        """The SPEC 11 / 14 keys of the last :meth:`record_mismatch` of ``step`` (the batch's and
        that call's env's: exporters had each env's as it came), or None."""
        with self._lock:
            return None if (found := self._mismatch_metrics.get(int(step))) is None else dict(found)

    def close(self, timeout: float | None = None) -> None:
        """Flush and close every exporter at once, each on a daemon thread; safe to call twice.
        Returns within ``timeout`` (default: the longest exporter ``close_timeout`` plus a grace;
        inf: no bound; NaN or negative: ``FieldError``, nothing closed);
        an exporter still closing then is counted, logged and left to finish in the background.
        A signal handler may call it: a call it interrupted finishes after it, exporting nothing; a
        call after one interrupted (Ctrl-C) waits again for the exporters not yet closed."""
        if timeout is None:  # the longest close_timeout an exporter declares (a number, not a flag)
            found = [getattr(e, "close_timeout", DEFAULT_CLOSE_TIMEOUT) for e in self.exporters]
            numbers = [t for t in found if isinstance(t, int | float) and not isinstance(t, bool)]
            timeout = max([DEFAULT_CLOSE_TIMEOUT, *numbers]) + CLOSE_GRACE
        deadline = time.monotonic() + seconds(timeout, "timeout")  # (inf: no bound)
        with self._lock.reentrant:
            for name in () if self._closed else self._named:
                if name not in self._closing:  # (not closed again after a call interrupted here)
                    closed = self._closing[name] = threading.Event()
                    closing = threading.Thread(target=self._close_one, args=(name, closed), daemon=True)
                    closing.name = f"staleness-close-{name}"
                    closing.start()
            self._closed = True
        late = f"close did not return within {timeout:g} s; left to finish in the background"
        # (an event, not Thread.join: a join interrupted by Ctrl-C marks a running thread stopped)
        for name, closed in list(self._closing.items()):
            closed.wait(time_left(deadline))
            if self._closing.pop(name, None) is not None and not closed.is_set():  # (counted once)
                self.export_errors.record(name, late)

    def _close_one(self, name: str, closed: threading.Event) -> None:
        try:
            self._named[name].close()
        except Exception as exc:
            self.export_errors.record(name, "close raised", exc)
        finally:
            closed.set()

    def __enter__(self) -> StalenessMonitor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _CallLock:
    """The monitor's lock, refusing a call nested in another of this thread (a signal handler's:
    it would see half a ship); close nests, through ``reentrant``. Taken and given back by the
    RLock's own (C) methods, which a Ctrl-C cannot split: a ``with`` looks both up first."""

    def __init__(self) -> None:
        self.reentrant = threading.RLock()

    @property
    def __enter__(self) -> Callable[[], bool]:
        if self.reentrant._is_owned():  # type: ignore[attr-defined]  # (this thread is in a call)
            raise StalenessError("called in a signal handler interrupting a call: only close() may")
        return self.reentrant.__enter__

    @property
    def __exit__(self) -> Callable[..., None]:
        return self.reentrant.__exit__
