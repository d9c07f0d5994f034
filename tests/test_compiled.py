"""compiled.CompiledLoop: without a cache folder numba can write (a read-only install, a user without a
home), a loop is compiled for this process instead of stopping with 'cannot cache function ...: no locator
available'."""

from __future__ import annotations

import numpy as np
import pytest

from staleness_metrics.compiled import CompiledLoop


def _doubled(values: np.ndarray) -> np.ndarray:
    out = np.empty_like(values)
    for i in range(values.size):
        out[i] = _plus(values[i], values[i])
    return out


def _plus(a: float, b: float) -> float:
    return a + b


def test_a_loop_compiles_when_no_cache_folder_can_be_written(monkeypatch: pytest.MonkeyPatch) -> None:
    numba = pytest.importorskip("numba")
    # the locator numba finds for an IPython cell only: for this file, numba finds none, as it finds no
    # writable folder beside a read-only install or in a missing home
    monkeypatch.setattr(numba.config, "CACHE_LOCATOR_CLASSES", "IPythonCacheLocator")
    loop = CompiledLoop(_doubled, callees={"_plus": (_plus, {})})
    assert loop(np.arange(3.0)).tolist() == [0.0, 2.0, 4.0]
    assert loop.loaded() is not loop  # compiled, not run as Python
