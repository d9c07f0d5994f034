"""Padded ``[B, L]`` batches, the shape every trainer holds, as a :class:`RolloutBatch` (the way
back is :func:`~staleness_metrics.engine.shipment.padded_shipment`)."""

from __future__ import annotations

from .columnar import RolloutBatch

from_padded = RolloutBatch.from_padded
