"""Run independent passes over large arrays on a small shared thread pool (numpy and the compiled
loops release the GIL); small inputs stay on the calling thread."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# below about a million positions, threads cost more than they save
PARALLEL_MIN_POSITIONS = 1 << 20
SHARES = 4  # parallel shares of a large input for a compiled loop: even work for 2-4 threads
_WORKERS = max(1, min(4, os.cpu_count() or 1))
# the pool's thread names (a fork may copy a process holding them)
POOL_THREAD_PREFIX = "staleness-metrics"
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    """In a forked child, whose parent's pool threads are not there: a first use starts one."""
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def run_all(tasks: Sequence[Callable[[], T]], positions: int) -> list[T]:
    """Results of ``tasks`` in order, run concurrently when they read enough ``positions``."""
    global _pool
    if len(tasks) < 2 or _WORKERS < 2 or positions < PARALLEL_MIN_POSITIONS:
        return [task() for task in tasks]
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix=POOL_THREAD_PREFIX)
        pool = _pool
    futures = [pool.submit(task) for task in tasks]
    return [future.result() for future in futures]
