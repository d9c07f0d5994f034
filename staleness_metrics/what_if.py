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
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .adapters import EventDict, as_replay_events, detect_source, read_run
from .config import StalenessConfig
from .errors import ConfigError
from .replay import Step, pack_once, prepare, run_steps
from .report import Tally
from .sink import Shipment, Sink

__all__ = ["WhatIfRow", "format_table", "parse_bounds", "run_tally", "to_json", "what_if"]

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
    def from_tally(cls, bound: int, tally: Tally) -> WhatIfRow:
        return cls(
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
        if detect_source(source) == "prime-rl":
            return lambda bound: prepare(read_run(source, max_staleness=bound))
        steps = pack_once(prepare(read_run(source)))
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
        rows.append(WhatIfRow.from_tally(bound, run_tally(run_steps(steps_for(bound), sink))))
    return rows


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def format_table(rows: Sequence[WhatIfRow]) -> str:
    """The rows as an aligned text table."""
    header = (
        "max_staleness",
        "masked",
        "tokens masked",
        "tokens kept",
        "kept share",
        "rollouts dropped",
        "samples dropped",
        "rollouts shipped",
        "held",
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
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in (header, *body)) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)) for line in (header, *body)]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def to_json(rows: Sequence[WhatIfRow]) -> str:
    """The rows as a JSON list (one object per bound)."""
    return json.dumps([row.as_dict() for row in rows], indent=2)
