"""What if the bound were different: the same run replayed at each ``max_staleness`` of a range,
each row the sum of its per-ship tallies (the columns: docs/run-inputs.md, docs/decisions.md)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import multiprocessing
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

from ..config import MAX_SETTING, StalenessConfig
from ..engine.shipment import Band
from ..engine.sink import Sink
from ..errors import ConfigError
from ..metrics import keys
from ..metrics.bound import Curve, Floor, advise, budget_of, excess_curve, select_floor
from ..metrics.mismatch import MismatchSums
from ..metrics.report import StepReport, Tally
from ..parallel import POOL_THREAD_PREFIX
from .run_dir import find_run
from .sources import EventDict, as_replay_events, detect_source, is_event_file, read_run
from .sources.prime_rl import is_current_layout
from .stream import Added, Event, Step, cut_ahead, prepare, read_event_path, run_steps

UNBOUNDED = 1 << 30  # a bound no lag reaches: the replay drops nothing for staleness
_RANGE = re.compile(r"^\s*(\d+)\s*\.\.\s*(\d+)\s*$")
MAX_BOUNDS = 257


def parse_bounds(text: str) -> list[int]:
    """``"0..8"`` (inclusive), ``"4"`` or ``"0,2,4"`` -> sorted distinct bounds."""
    match = _RANGE.match(text)
    try:  # (a number of more digits than Python reads too)
        numbers = [int(part) for part in (match.groups() if match else text.split(","))]
    except ValueError:
        raise ConfigError(f"max_staleness: expected A..B, N or N,M,..., got {text!r}") from None
    if match and numbers[0] > numbers[1]:
        raise ConfigError(f"max_staleness range {text!r}: the start is above the end")
    if min(numbers) < 0 or max(numbers) > MAX_SETTING:  # (each bound, as a config's own)
        raise ConfigError(f"max_staleness: bounds must be in 0..{MAX_SETTING}, got {text!r}")
    # a range counted before it is built (len() of one beyond 2**63 raises)
    if (count := numbers[1] - numbers[0] + 1 if match else len(set(numbers))) > MAX_BOUNDS:
        raise ConfigError(f"max_staleness: at most {MAX_BOUNDS} bounds at once, got {count}")
    return list(range(numbers[0], numbers[1] + 1)) if match else sorted(set(numbers))


@dataclass(frozen=True)
class WhatIfRow:
    """The run replayed at one bound (see the module docs for each figure)."""

    max_staleness: int
    tokens_sampled: int
    tokens_masked: int
    tokens_dropped: int
    rollouts_shipped: int
    rollouts_dropped: int
    samples_dropped: int
    rollouts_held: int
    trained_covered: int | None = None
    trained_k3: float | None = None
    trained_excess_k3: float | None = None
    excess_at_bound: float | None = None
    within_budget: bool | None = None
    suggested: bool | None = None  # None: the run has no curve
    suggested_bound: int | None = None  # the run's suggestion, in the range tried or not

    @property
    def tokens_kept(self) -> int:
        return self.tokens_sampled - self.tokens_masked

    @property
    def masked_ratio(self) -> float | None:
        return self.tokens_masked / self.tokens_sampled if self.tokens_sampled else None

    @property
    def kept_share(self) -> float | None:
        total = self.tokens_sampled + self.tokens_dropped
        return self.tokens_kept / total if total else None

    @classmethod
    def from_tally(
        cls, bound: int, tally: Tally, cost: MismatchSums | None = None, floor_min_tokens: int = 1000
    ) -> WhatIfRow:
        # the excess of what trained over SPEC 14's floor of its tokens (lag 0, else the least lag)
        floor = None if cost is None else select_floor(cost, 1, None, min_tokens=floor_min_tokens, max_age=0)
        cost_keys = cost.metrics(floor=None if floor is None else floor.value) if cost is not None else {}
        # the tally's counts a row holds (tokens_sampled ... rollouts_held), by the names both use
        counts = {f.name: getattr(tally, f.name) for f in fields(cls) if hasattr(tally, f.name)}
        return cls(
            max_staleness=bound,
            trained_covered=cost.covered if cost is not None else None,
            trained_k3=cost_keys.get(keys.MISMATCH_K3),
            trained_excess_k3=cost_keys.get(keys.MISMATCH_EXCESS_K3),
            **counts,
        )

    def as_dict(self) -> dict[str, Any]:
        derived = ("tokens_kept", "masked_ratio", "kept_share")  # (its properties)
        return dataclasses.asdict(self) | {name: getattr(self, name) for name in derived}


@dataclass(frozen=True)
class RunCurve:
    """SPEC 14 over a whole run: the floor, budget and excess curve of its pooled sums."""

    floor: Floor
    budget: float
    curve: Curve
    sums: MismatchSums

    @property
    def suggested(self) -> int | None:
        """The largest lag of the curve within the budget (0 when the first is above)."""
        advice = advise(self.curve, self.budget, 0)
        return None if advice is None else advice.suggested

    @property
    def crossed(self) -> bool | None:
        """Whether some lag of the curve is above the budget."""
        advice = advise(self.curve, self.budget, 0)
        return None if advice is None else advice.crossed

    def excess_at(self, bound: int) -> float | None:
        """``ê`` of the largest lag of the curve not above ``bound`` (None when there is none)."""
        advice = advise(self.curve, self.budget, bound)
        return None if advice is None else advice.excess_at_bound

    def within_budget(self, bound: int) -> bool | None:
        """Whether ``ê`` at ``bound`` is within the budget; below the curve's first lag, True when
        the first point is (more lag cannot make a token cheaper), else unknown (None)."""
        if not self.curve:
            return None
        if (at_bound := self.excess_at(bound)) is not None:
            return at_bound <= self.budget
        return True if self.curve.fitted[0] <= self.budget else None


def run_curve(sums: MismatchSums | None, config: StalenessConfig) -> RunCurve | None:
    """The curve of ``sums`` pooled over a run (None when they give no floor)."""
    if sums is None or sums.covered == 0:
        return None
    floor = select_floor(sums, 0, None, min_tokens=config.floor_min_tokens, max_age=config.floor_max_age)
    if floor is None:
        return None
    curve = excess_curve(sums, floor.value, min_tokens=config.floor_min_tokens)
    return RunCurve(floor, budget_of(config.mismatch_budget, floor.value), curve, sums)


Replayed = tuple[Tally, MismatchSums | None, MismatchSums | None]
Costs = tuple[MismatchSums | None, MismatchSums | None]


def _plus(total: MismatchSums | None, more: MismatchSums | None) -> MismatchSums | None:
    return total if more is None else more if total is None else total + more


def run_tally(reports: Iterable[StepReport]) -> Tally:
    """The sum of every ship's tally."""
    return sum((report.tally for report in reports), Tally())


Source = str | Path | Sequence[EventDict]
StepsOf = Callable[[Sequence[int]], list[Iterable[Step]]]  # the steps of each of some bounds


def _steps_for(source: Source, strict: bool = True) -> tuple[StepsOf, list[Step] | None]:
    """The prepared steps of some bounds, and those every bound shares (None: a prime-rl run)."""
    events: Iterable[Event]
    if not isinstance(source, (str, Path)):
        events = as_replay_events(source)
    elif (run := find_run(source)) is not None:  # joined to the trainer's log-probabilities
        events = run.events_with_costs()
    elif is_event_file(source):  # read as the replay command reads it (compressed or not)
        events = read_event_path(source, parse=True, read_ahead=True)
    elif detect_source(source) == "prime-rl":
        return (lambda bounds: _prime_rl_steps(source, bounds, strict)), None
    else:
        events = read_run(source, parse=True)
    steps: list[Step] = []
    try:
        steps.extend(cut_ahead(prepare(events)))  # (keeps the steps read before a read error)
    except Exception as error:  # a later line's: raised once the steps before it replay without one
        then_raise = partial(_then_raise, steps, error)
        return (lambda bounds: [then_raise() for _ in bounds]), steps
    return (lambda bounds: [steps] * len(bounds)), steps


def _then_raise(steps: list[Step], error: Exception) -> Iterator[Step]:
    yield from steps
    raise error


def _prime_rl_steps(path: str | Path, bounds: Sequence[int], strict: bool) -> list[Iterable[Step]]:
    """Each bound's steps from one read at the smallest (the older layout: a read per bound)."""
    if not is_current_layout(path):
        return [prepare(read_run(path, max_staleness=bound, strict=strict)) for bound in bounds]
    reads = itertools.tee(read_run(path, max_staleness=min(bounds), strict=strict), len(bounds))
    return [prepare(filter(partial(Event.enters, bound=b), read)) for read, b in zip(reads, bounds)]


def _replay_together(runs: list[tuple[Iterable[Step], Sink]], band: Band) -> list[Replayed]:
    """The runs a ship of each in turn, so that runs fed by one read hold a ship's events between
    them (the totals once they are done)."""
    costs: list[Costs] = [(None, None)] * len(runs)
    for ships in itertools.zip_longest(*(run_steps(steps, sink) for steps, sink in runs)):
        costs = [  # the merged trained sums, and the SPEC 11 sums of every shipped position
            c if s is None else (_plus(c[0], s.trained_sums(band)), _plus(c[1], s.report.mismatch))
            for c, s in zip(costs, ships)
        ]
    return [(sink.totals, *cost) for (_, sink), cost in zip(runs, costs)]


FORK_MIN_POSITIONS = 1 << 17  # fewer: a fork and its hand-back cost about what a second core saves


def _fork_safe() -> bool:
    """A fork copies the calling thread only: safe when every other thread is the engine's pool."""
    if not hasattr(os, "fork"):
        return False
    current = threading.current_thread()
    return all(t is current or t.name.startswith(POOL_THREAD_PREFIX) for t in threading.enumerate())


def _removes_nothing(replayed: Replayed) -> bool:
    """Whether a replay removed nothing: every larger bound then replays alike (SPEC 5)."""
    tally = replayed[0]
    dropped = tally.tokens_dropped or tally.samples_dropped or tally.rollouts_dropped
    return not (dropped or tally.tokens_masked or tally.rollouts_held)


Figures = dict[int, Replayed]  # by bound
ReplayJobs = Callable[[Sequence[int]], Figures]  # the figures of the bounds it replayed


def _replay_until_error(jobs: Sequence[int], replay_at: Callable[[int], Replayed]) -> Figures:
    """``replay_at`` of each job in order (ascending bounds), up to the first that raises (for the
    caller to raise) or the first that removed nothing (its figures every later job's)."""
    done: Figures = {}
    for job in jobs:
        try:
            done[job] = replay_at(job)
        except Exception:
            break
        if _removes_nothing(done[job]):
            break
    return done


# the worker's replays, inherited through the fork (sharing the prepared steps copy-on-write)
_inherited: ReplayJobs | None = None


def _replay_share(jobs: Sequence[int]) -> Figures:
    assert _inherited is not None, "run in a worker started by _replay_split"
    return _inherited(jobs)


def _replay_split(jobs: Sequence[int], replay_jobs: ReplayJobs) -> Figures:
    """``replay_jobs`` of the jobs on two cores, every other one in a forked worker; what a share
    left out (or a failed worker's share) the caller replays in order, raising what that raises."""
    global _inherited
    _inherited = replay_jobs  # the worker forks at submit, inheriting it
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        share = pool.submit(_replay_share, list(jobs[::2]))
        mine = replay_jobs(jobs[1::2])
        try:
            theirs = share.result()
        except Exception:  # the worker died (BrokenProcessPool) or its answer could not be read
            theirs = {}
    return {**theirs, **mine}


@dataclass(frozen=True)
class WhatIf:
    """The rows of every bound and the run's curve (None without trainer log-probabilities)."""

    rows: list[WhatIfRow]
    curve: RunCurve | None


def what_if(source: Source, bounds: Iterable[int], config: StalenessConfig | None = None) -> list[WhatIfRow]:
    """Replay ``source`` (a run input path, a run directory or event dicts) at every bound."""
    return what_if_with_curve(source, bounds, config).rows


def what_if_with_curve(
    source: Source, bounds: Iterable[int], config: StalenessConfig | None = None, *, processes: int | None = None
) -> WhatIf:
    """The rows of :func:`what_if` and the run's curve, each row judged by it. The input is read and
    packed once (a prime-rl run: read once a process, its bounds run together), each row equals a
    separate replay; ``processes=2`` replays half the bounds in a
    forked process (``None``: with two cores and :data:`FORK_MIN_POSITIONS` positions or more)."""
    base = config or StalenessConfig()
    bounds = list(bounds)
    steps_for, shared_steps = _steps_for(source, base.strict)
    rows = []
    unbounded: MismatchSums | None = None  # the sums of a replay that removed nothing, once one did
    band = base.mismatch_band

    def sink_at(bound: int) -> Sink:
        # no adaptation (it would judge another bound); only the totals are read
        at = dataclasses.replace(base, max_staleness=bound, adapt_every=None)
        return Sink(at, env_reports=False)

    def replay_at(bound: int) -> Replayed:
        return _replay_together([(steps_for([bound])[0], sink_at(bound))], band)[0]

    def replay_jobs(jobs: Sequence[int]) -> Figures:
        if shared_steps is not None:
            return _replay_until_error(jobs, replay_at)
        # a prime-rl run: the bounds together over one read; if one raises, the caller replays each
        # alone, raising its error (a run sharing a read cannot tell its failure from its end)
        runs = list(zip(steps_for(jobs), map(sink_at, jobs)))
        try:
            return dict(zip(jobs, _replay_together(runs, band)))
        except Exception:
            return {}

    windows = {id(s.packed): s.packed for s in shared_steps or () if isinstance(s, Added) and s.packed is not None}
    packed = None if shared_steps is None else list(windows.values())
    # without trainer log-probabilities the run has no curve, at any bound
    costs = packed is None or any(p.trainer_logprobs is not None for p in packed)
    if processes is None:
        positions = None if packed is None else sum(int(p.position_offsets[-1]) for p in packed)
        processes = 2 if positions is None or positions >= FORK_MIN_POSITIONS else 1
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        processes = min(processes, cores or 1)
    # the same steps at every bound: those above the first that removed nothing share its figures
    ascending = shared_steps is not None
    jobs = sorted(set(bounds)) if ascending else list(bounds)
    # beside them (same read), the replay removing nothing: used where every bound removed some
    beside = [*jobs, UNBOUNDED] if costs else jobs
    if processes >= 2 and len(bounds) >= 2 and _fork_safe():
        replayed = _replay_split(beside, replay_jobs)
    else:
        replayed = replay_jobs(jobs if ascending else beside)
    for bound in bounds:
        # a smaller bound's replay that removed nothing is this one's too
        below = [b for b, f in replayed.items() if ascending and b < bound and _removes_nothing(f)]
        figures = replayed.get(bound) or (replayed[max(below)] if below else None)
        if figures is None:
            figures = replayed[bound] = replay_at(bound)
        tally, cost, pooled = figures
        rows.append(WhatIfRow.from_tally(bound, tally, cost, base.floor_min_tokens))
        if tally.tokens_dropped == 0 and tally.rollouts_held == 0:
            unbounded = pooled
    if unbounded is None and rows and costs:
        # every bound dropped something: the curve needs every token the records hold
        unbounded = (replayed[UNBOUNDED] if UNBOUNDED in replayed else replay_at(UNBOUNDED))[2]
    curve = run_curve(unbounded, base)
    if curve is not None:
        suggested = curve.suggested
        rows = [
            dataclasses.replace(
                row,
                excess_at_bound=curve.excess_at(row.max_staleness),
                within_budget=curve.within_budget(row.max_staleness),
                suggested=suggested == row.max_staleness if suggested is not None else None,
                suggested_bound=suggested,
            )
            for row in rows
        ]
    return WhatIf(rows, curve)


def _shown(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _verdict(row: WhatIfRow) -> str:
    mark = "yes" if row.within_budget else "no" if row.within_budget is not None else "-"
    return mark + (" <- suggested" if row.suggested else "")


Column = tuple[str, Callable[[WhatIfRow], str]]
_COLUMNS: tuple[Column, ...] = (
    ("max_staleness", lambda r: str(r.max_staleness)),
    ("masked", lambda r: _shown(r.masked_ratio, ".2%")),
    ("tokens masked", lambda r: str(r.tokens_masked)),
    ("tokens kept", lambda r: str(r.tokens_kept)),
    ("kept share", lambda r: _shown(r.kept_share, ".2%")),
    ("rollouts dropped", lambda r: str(r.rollouts_dropped)),
    ("samples dropped", lambda r: str(r.samples_dropped)),
    ("rollouts shipped", lambda r: str(r.rollouts_shipped)),
    ("held", lambda r: str(r.rollouts_held)),
)
_COST_COLUMNS: tuple[Column, ...] = (
    ("trained k3", lambda r: _shown(r.trained_k3, ".4g")),
    ("trained excess k3", lambda r: _shown(r.trained_excess_k3, ".4g")),
)
_CURVE_COLUMNS: tuple[Column, ...] = (
    ("excess at bound", lambda r: _shown(r.excess_at_bound, ".4g")),
    ("within budget", _verdict),
)


def format_table(rows: Sequence[WhatIfRow], curve: RunCurve | None = None) -> str:
    """The rows as an aligned text table, with the cost columns when the run has trainer
    log-probabilities and ``curve``'s verdict on each bound."""
    costs = any(r.trained_covered is not None for r in rows)
    judged = curve is not None and bool(curve.curve)
    columns = [*_COLUMNS, *(_COST_COLUMNS if costs else ()), *(_CURVE_COLUMNS if judged else ())]
    header = tuple(name for name, _ in columns)
    body = [tuple(cell(r) for _, cell in columns) for r in rows]
    widths = [max(len(line[i]) for line in (header, *body)) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)) for line in (header, *body)]
    table = [lines[0], "  ".join("-" * w for w in widths), *lines[1:]]
    if curve is not None:
        table += ["", describe_curve(curve)]
    return "\n".join(table)


def describe_curve(curve: RunCurve) -> str:
    """One paragraph: the run's floor, budget, curve and suggestion (SPEC 14 over the whole run)."""
    text = f"The run's curve (SPEC 14, sums pooled over the run): floor {curve.floor.value:.4g} nats"
    text += f" ({curve.floor.source}), budget {curve.budget:.4g} nats"
    if not curve.curve:
        return text + "; no lag 1..16 has enough tokens for a curve, so no suggestion."
    pairs = zip(curve.curve.lags, curve.curve.fitted, strict=True)
    points = ", ".join(f"lag {lag}: {fitted:.4g}" for lag, fitted in pairs)
    looser = ": every lag of the curve is within the budget, so a looser bound may be as good"
    verdict = " (the largest lag within the budget)" if curve.crossed else looser
    return f"{text}; excess curve {points}; suggested bound {curve.suggested}{verdict}."


def to_json(rows: Sequence[WhatIfRow]) -> str:
    """The rows as a JSON list (one object per bound)."""
    return json.dumps([row.as_dict() for row in rows], indent=2)
