"""What a damaged run gets (SPEC 9): strict mode stops naming the file, line and reason; lenient
mode sets the damaged part aside and counts it."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ....errors import EventError

_log = logging.getLogger("staleness_metrics.replay.sources.prime_rl")

# What can be set aside, as counted (the keys of :attr:`Damage.counts`).
DAMAGE_KINDS = {
    "bad_line": "lines that are not JSON",
    "not_episode": "stream lines that are not an episode record",
    "not_update": "annotation lines that are not an update",
    "bad_chunk": "chunks with corrupt or cut zstd data (the rest of the chunk)",
    "index_nowhere": "index rows pointing at no episode",
    "unknown_trace": "updates for a trace the stream does not hold",
    "bad_update": "updates that do not fit their trace (a branch it lacks, a stream longer than its branch)",
    "late_ship": "traces shipped at a step the replay had passed (their arrival came after the ship)",
}
_EXAMPLES = 5


@dataclass
class Damage:
    """Counts of what was set aside, per kind of :data:`DAMAGE_KINDS`, and the first few reasons."""

    strict: bool = True
    counts: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def report(self, kind: str, path: Path | str, line: int, reason: str) -> None:
        """Raise :class:`EventError` (strict) or count it (lenient)."""
        if self.strict:
            raise EventError(line, f"{path}: {reason}")
        self.counts[kind] += 1
        if len(self.examples) < _EXAMPLES:
            self.examples.append(f"{path}: line {line}: {reason}")
        _log.warning("set aside: %s: line %d: %s", path, line, reason)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """One line: how many of each kind were set aside (empty when nothing was)."""
        return ", ".join(f"{count} {DAMAGE_KINDS[kind]}" for kind, count in sorted(self.counts.items()))
