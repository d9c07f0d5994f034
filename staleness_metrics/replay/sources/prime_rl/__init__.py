"""prime-rl runs as SPEC 9 event streams: the current layout (:mod:`.run`), the older
``rollouts/step_N`` one (:mod:`.legacy`), prime-rl's logged values beside ours (:mod:`.compare`)."""

from __future__ import annotations

from pathlib import Path

from . import legacy
from .chunks import is_current_layout
from .compare import ComparisonRow, compare_prime_rl, comparison_summary, read_prime_rl_metrics
from .episodes import fold_streams
from .legacy import read_prime_rl
from .run import PrimeRlRead, read_run_events

__all__ = ["ComparisonRow", "PrimeRlRead", "compare_prime_rl", "comparison_summary", "fold_streams",
           "has_rollouts", "is_current_layout", "is_prime_rl_run", "read_prime_rl",
           "read_prime_rl_metrics", "read_run_events"]  # fmt: skip


def is_prime_rl_run(path: str | Path) -> bool:
    """A prime-rl run directory of either layout (or a folder with only its ``metrics.jsonl``)."""
    return has_rollouts(path) or (Path(path) / "metrics.jsonl").is_file()


def has_rollouts(path: str | Path) -> bool:
    """Whether a prime-rl run directory holds episode records (not only ``metrics.jsonl``)."""
    return is_current_layout(path) or bool(legacy.step_dirs(Path(path)))
