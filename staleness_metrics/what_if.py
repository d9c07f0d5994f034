"""What if the bound were different: the same run replayed at each ``max_staleness`` of a range.

Every figure is a sum of the replay's own per-ship tallies over the whole run, so the row of the bound
a run used equals what ``replay`` reports for it:

- ``tokens_sampled``: sampled positions of the shipped live samples, masked ones included;
- ``tokens_masked``: those of them masked for staleness;
- ``masked_ratio`` = ``tokens_masked / tokens_sampled`` (``staleness/token/masked`` over the run);
- ``tokens_kept`` = ``tokens_sampled - tokens_masked``: the sampled positions that train;
- ``tokens_dropped``: sampled positions of samples dropped for staleness;
- ``kept_share`` = ``tokens_kept / (tokens_sampled + tokens_dropped)``: of the sampled positions
  that were shipped or dropped, the share that trains;
- ``rollouts_dropped``, ``samples_dropped``, ``rollouts_shipped`` (live): counts over the run;
- ``rollouts_held``: held rollouts summed over ships (one held across two ships counts twice).

What the bound costs (SPEC 11; only when the records carry ``trainer_logprobs``), over the **trained
covered tokens**: the sampled positions of shipped live samples that the bound left unmasked and that
carry both log-probabilities (masked positions and dropped samples are what the bound removed, so
they are left out), their sums merged over the run:

- ``trained_covered``: how many such tokens;
- ``trained_k3``: their mean k3 (``r - 1 - log r``);
- ``trained_excess_k3``: the mean k3 of those with lag >= 1 minus the mean k3 of those with lag 0 (the
  numeric floor), over the whole run; ``None`` when no lag-0 token was trained.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .adapters import EventDict, as_replay_events, detect_source, read_run
from .bound import select_floor
from .config import StalenessConfig
from .errors import ConfigError
from .mismatch import MismatchSums, mismatch_sums
from .replay import Step, is_event_file, pack_once, prepare, read_event_path, run_steps
from .report import Tally
from .sink import Shipment, Sink

__all__ = [
    "WhatIfRow",
    "format_table",
    "parse_bounds",
    "run_tally",
    "tally_and_cost",
    "to_json",
    "trained_cost",
    "what_if",
]

_RANGE = re.compile(r"^\s*(\d+)\s*\.\.\s*(\d+)\s*$")
MAX_BOUNDS = 257


def parse_bounds(text: str) -> list[int]:
    """``"0..8"`` (inclusive), ``"4"`` or ``"0,2,4"`` -> sorted distinct bounds."""
    match = _RANGE.match(text)
    if match:
        low, high = int(match.group(1)), int(match.group(2))
        if low > high:
            raise ConfigError(f"max_staleness range {text!r}: the start is above the end")
        bounds = list(range(low, high + 1))
    else:
        try:
            bounds = sorted({int(part) for part in text.split(",")})
        except ValueError:
            raise ConfigError(f"max_staleness: expected A..B, N or N,M,..., got {text!r}") from None
    if any(b < 0 for b in bounds):
        raise ConfigError(f"max_staleness: bounds must be >= 0, got {text!r}")
    if len(bounds) > MAX_BOUNDS:
        raise ConfigError(f"max_staleness: at most {MAX_BOUNDS} bounds at once, got {len(bounds)}")
    return bounds


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
        # The excess of what trained, over SPEC 14's floor of the same pooled tokens (lag 0, else the smallest
        # lag with floor_min_tokens tokens).
        floor = None if cost is None else select_floor(cost, 1, None, min_tokens=floor_min_tokens, max_age=0)
        keys = cost.metrics(floor=None if floor is None else floor.value) if cost is not None else {}
        return cls(
            trained_covered=cost.covered if cost is not None else None,
            trained_k3=_float(keys.get("staleness/mismatch/k3")),
            trained_excess_k3=_float(keys.get("staleness/mismatch/excess_k3")),
            max_staleness=bound,
            tokens_sampled=tally.tokens_sampled,
            tokens_masked=tally.tokens_masked,
            tokens_dropped=tally.tokens_dropped,
            rollouts_shipped=tally.rollouts_shipped,
            rollouts_dropped=tally.rollouts_dropped,
            samples_dropped=tally.samples_dropped,
            rollouts_held=tally.rollouts_held,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "tokens_kept": self.tokens_kept,
            "masked_ratio": self.masked_ratio,
            "kept_share": self.kept_share,
        }


def _float(value: float | None) -> float | None:
    return None if value is None else float(value)


def _shipped_values(shipment: Shipment, name: str) -> npt.NDArray[np.float64]:
    """The shipped samples' ``name`` array (``mask``, ``logprobs``, ``trainer_logprobs``) concatenated in
    ship order, aligned with ``shipment.lags``; NaN where a sample lacks it. One slice per sample."""
    parts: list[npt.NDArray[np.float64]] = []
    for rollout in shipment.rollouts:
        batch = rollout.batch
        first = int(batch.sample_offsets[rollout.index])
        values = getattr(batch, name)
        present = batch.present.get(name)
        for k in rollout.samples:
            lo, hi = int(batch.position_offsets[first + k]), int(batch.position_offsets[first + k + 1])
            if values is None or (present is not None and not present[first + k]):
                parts.append(np.full(hi - lo, np.nan))
            else:
                parts.append(np.asarray(values[lo:hi], dtype=np.float64))
    return np.concatenate(parts) if parts else np.zeros(0)


def trained_cost(shipment: Shipment, band: tuple[float, float]) -> MismatchSums | None:
    """SPEC 11 sums over the covered positions the ship trains (unmasked sampled positions of its live
    samples); ``None`` when no shipped record carries ``trainer_logprobs``."""
    if shipment.report.mismatch is None:  # the sink found no trainer_logprobs: skip building the rollouts
        return None
    trains = _shipped_values(shipment, "mask") > 0
    lags = np.where(trains, shipment.lags, -1)  # masked positions leave the population
    sampler = _shipped_values(shipment, "logprobs")
    return mismatch_sums(lags, sampler, _shipped_values(shipment, "trainer_logprobs"), band=band)


def tally_and_cost(shipments: Iterable[Shipment], band: tuple[float, float]) -> tuple[Tally, MismatchSums | None]:
    """:func:`run_tally` and the merged :func:`trained_cost` of the ships, in one pass."""
    tally, cost = Tally(), None
    for shipment in shipments:
        tally = tally + shipment.report.tally
        ship_cost = trained_cost(shipment, band)
        if ship_cost is not None:
            cost = ship_cost if cost is None else cost + ship_cost
    return tally, cost


def run_tally(shipments: Iterable[Shipment]) -> Tally:
    """The sum of every ship's tally."""
    total = Tally()
    for shipment in shipments:
        total = total + shipment.report.tally
    return total


Source = str | Path | Sequence[EventDict]


def _steps_for(source: Source) -> Callable[[int], Iterable[Step]]:
    """The prepared steps to replay at each bound: parsed once, unless the input depends on the bound.

    A prime-rl run directory does (which unshipped episodes were stale depends on the bound being
    replayed), so it is read again per bound; event streams and xtuner states are parsed once.
    """
    if isinstance(source, (str, Path)):
        if is_event_file(source):  # read as the replay command reads it (compressed or not)
            steps = pack_once(prepare(read_event_path(source, parse=True)))
        elif detect_source(source) == "prime-rl":
            return lambda bound: prepare(read_run(source, max_staleness=bound))
        else:
            steps = pack_once(prepare(read_run(source, parse=True)))
    else:
        steps = pack_once(prepare(as_replay_events(source)))
    return lambda bound: steps


def what_if(source: Source, bounds: Iterable[int], config: StalenessConfig | None = None) -> list[WhatIfRow]:
    """Replay ``source`` (a run input path, or event dicts) at every bound, other settings from ``config``.

    The input is decoded, type-checked and packed into batches once; each bound runs a fresh sink over
    copies of the batches, so every row equals a separate replay at that bound.
    """
    base = config or StalenessConfig()
    steps_for = _steps_for(source)
    rows = []
    for bound in bounds:
        sink = Sink(dataclasses.replace(base, max_staleness=bound))
        tally, cost = tally_and_cost(run_steps(steps_for(bound), sink), base.mismatch_band)
        rows.append(WhatIfRow.from_tally(bound, tally, cost, base.floor_min_tokens))
    return rows


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _cost(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def format_table(rows: Sequence[WhatIfRow]) -> str:
    """The rows as an aligned text table (with the cost columns when the run has trainer log-probs)."""
    costs = any(r.trained_covered is not None for r in rows)
    header: tuple[str, ...] = (
        "max_staleness",
        "masked",
        "tokens masked",
        "tokens kept",
        "kept share",
        "rollouts dropped",
        "samples dropped",
        "rollouts shipped",
        "held",
        *(("trained k3", "trained excess k3") if costs else ()),
    )
    body = [
        (
            str(r.max_staleness),
            _percent(r.masked_ratio),
            str(r.tokens_masked),
            str(r.tokens_kept),
            _percent(r.kept_share),
            str(r.rollouts_dropped),
            str(r.samples_dropped),
            str(r.rollouts_shipped),
            str(r.rollouts_held),
            *((_cost(r.trained_k3), _cost(r.trained_excess_k3)) if costs else ()),
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in (header, *body)) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)) for line in (header, *body)]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def to_json(rows: Sequence[WhatIfRow]) -> str:
    """The rows as a JSON list (one object per bound)."""
    return json.dumps([row.as_dict() for row in rows], indent=2)
