"""prime-rl runs as SPEC 9 event streams, in either of prime-rl's on-disk layouts.

The current layout (PR #3444 on: ``monitors/file/traces/``): :func:`read_run_events` (:mod:`.run`),
over :mod:`.layout`, :mod:`.chunks`, :mod:`.index`, :mod:`.annotations`, :mod:`.episodes` and
:mod:`.damage`. The older ``rollouts/step_N`` layout: :mod:`.legacy`. prime-rl's own logged values
beside ours, for either: :mod:`.compare`. The readings: ``docs/trainers/prime-rl.md``.
"""

from __future__ import annotations

from pathlib import Path

from .compare import ComparisonRow, compare_prime_rl, comparison_summary, read_prime_rl_metrics
from .episodes import EpisodeHead, TraceHead, episode_head, fold_streams, trace_rollout
from .layout import TracesLayout, find_layout, is_current_layout
from .legacy import EpisodeInfo, episode_rollout, read_prime_rl
from .legacy import has_rollouts as _has_step_rollouts
from .legacy import is_prime_rl_run as _is_older_run
from .run import PrimeRlRead, ReadNotes, read_run_events

__all__ = [
    "ComparisonRow",
    "EpisodeHead",
    "EpisodeInfo",
    "PrimeRlRead",
    "ReadNotes",
    "TraceHead",
    "TracesLayout",
    "compare_prime_rl",
    "comparison_summary",
    "episode_head",
    "episode_rollout",
    "find_layout",
    "fold_streams",
    "has_rollouts",
    "is_current_layout",
    "is_prime_rl_run",
    "read_prime_rl",
    "read_prime_rl_metrics",
    "read_run_events",
    "trace_rollout",
]


def is_prime_rl_run(path: str | Path) -> bool:
    """A prime-rl run directory of either layout (or a folder with only its ``metrics.jsonl``)."""
    return is_current_layout(path) or _is_older_run(path)


def has_rollouts(path: str | Path) -> bool:
    """Whether a prime-rl run directory holds episode records (not only ``metrics.jsonl``)."""
    return is_current_layout(path) or _has_step_rollouts(path)
