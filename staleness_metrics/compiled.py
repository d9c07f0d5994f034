"""Loops compiled by numba on their first call (each compiled pass is a plain Python function
beside its concept, decorated with :class:`CompiledLoop`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

# views of a float's bits
UNSIGNED_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _njit(loop: Callable[..., Any], options: Mapping[str, Any]) -> Callable[..., Any]:
    from numba import njit

    try:
        return njit(cache=True, nogil=True, **options)(loop)  # type: ignore[no-any-return]
    except RuntimeError:  # no cache folder it may write (read-only install, no home): not cached
        return njit(nogil=True, **options)(loop)  # type: ignore[no-any-return]


class CompiledLoop:
    """``loop`` compiled by numba (imported then) on its first call, cached on disk. ``callees``
    are loops it calls by a module-level name, compiled first with their own numba options
    (``fastmath={"reassoc"}`` only in a callee: the loop's own arithmetic stays exact)."""

    def __init__(
        self,
        loop: Callable[..., Any] | None = None,
        *,
        callees: Mapping[str, tuple[Callable[..., Any], Mapping[str, Any]]] | None = None,
        **options: Any,
    ) -> None:
        self._loop = loop
        self._callees = dict(callees or {})
        self._options = options
        self._compiled: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        if self._loop is None:  # used as @CompiledLoop(options): this call passes the loop
            (loop,) = args
            return CompiledLoop(loop, callees=self._callees, **self._options)
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    for name, (callee, options) in self._callees.items():
                        self._loop.__globals__[name] = _njit(callee, options)
                    self._compiled = _njit(self._loop, self._options)
        assert self._compiled is not None
        return self._compiled(*args)

    def loaded(self) -> Callable[..., Any]:
        """The compiled loop once loaded (a call skips this wrapper), else this wrapper."""
        return self._compiled or self
