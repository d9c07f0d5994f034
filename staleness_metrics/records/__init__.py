"""Records: SPEC 3 rollouts as they arrive (dicts, JSON lines, padded ``[B, L]`` tensors), checked
and turned into the columnar :class:`~staleness_metrics.records.columnar.RolloutBatch`."""

from __future__ import annotations

__all__: list[str] = []
