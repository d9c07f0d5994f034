"""Every bucket the metrics are split by: the catalogue names them, the computations fill them
(plain tuples, so the catalogue stays cheap to import)."""

from __future__ import annotations

from typing import Literal

# SPEC 8: integer staleness histogram buckets: exact per-level counts, then a coarse tail
BUCKETS: tuple[float, ...] = (*[float(b) for b in range(17)], 32.0, 64.0)

# histograms hold one bucket per staleness up to this one, which counts everything at or above it
HISTOGRAM_TOP = 4096

# SPEC 11: token lag buckets 0..16 one lag each, then 17..32, 33..64, > 64 (named by upper bound)
LAG_UPPER_BOUNDS: tuple[int, ...] = (*range(17), 32, 64)
LAG_BUCKETS: tuple[str, ...] = (*(str(b) for b in LAG_UPPER_BOUNDS), "inf")
N_BUCKETS = len(LAG_BUCKETS)

# SPEC 12: samples by their count of sampled positions, 1..256, 257..1024, ..., above 16384.
LENGTH_UPPER_BOUNDS: tuple[int, ...] = (256, 1024, 4096, 16384)
LENGTH_BUCKETS: tuple[str, ...] = ("256", "1k", "4k", "16k", "inf")

# SPEC 14: where a ship's floor came from; the excess curve's buckets, lags 1..16 (index == lag)
FloorSource = Literal["lag0", "carried", "min_lag"]
FLOOR_SOURCES: tuple[FloorSource, ...] = ("lag0", "carried", "min_lag")
CURVE_BUCKETS: tuple[int, ...] = tuple(range(1, 17))
