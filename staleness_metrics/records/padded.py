"""Padded ``[B, L]`` batches, the shape every trainer holds, as a :class:`RolloutBatch` (the way
back is :func:`~staleness_metrics.engine.shipment.padded_shipment`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .columnar import RolloutBatch
from .padded_rows import PaddedLayout, padded_columns

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .padded_rows import PaddedColumns

__all__ = ["PaddedLayout", "from_padded"]


def from_padded(ids: Sequence[str], mask: Any, **columns: Unpack[PaddedColumns]) -> RolloutBatch:
    return RolloutBatch(**padded_columns(ids, mask, **columns))


from_padded.__doc__ = padded_columns.__doc__
