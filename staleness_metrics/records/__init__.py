"""Records: SPEC 3 rollouts as they arrive (dicts, JSON lines, padded ``[B, L]`` tensors), checked
and turned into the columnar :class:`~staleness_metrics.records.columnar.RolloutBatch` the engine
reads. Nothing is imported here: a module costs only what it imports itself.
"""

from __future__ import annotations

__all__: list[str] = []
