"""Records: SPEC 3 rollouts as they arrive (dicts, JSON lines, padded ``[B, L]`` tensors),
checked and turned into the columnar
:class:`~staleness_metrics.records.columnar.RolloutBatch` the engine reads.

- :mod:`.model`: the record model, its type checks and packing; :mod:`.validation`:
  every invalid-input rule;
- :mod:`.columnar`: the columnar batch; :mod:`.padded`: the padded ``[B, L]`` layout, both ways;
- :mod:`.jsonio`, :mod:`.simd_records`: JSON lines in and out (orjson, and
  simdjson for rollout lines).

Nothing is imported here, so a module of the package costs only what it imports itself.
"""

from __future__ import annotations

__all__: list[str] = []
