"""Padded ``[B, L]`` batches, the shape every trainer holds, as a :class:`RolloutBatch`.

:func:`from_padded` (also :meth:`RolloutBatch.from_padded`) reads the rows (:mod:`.padded_rows` does
the work); the way back, the caller's ``[B, L]`` arrays as a ship left them, is
:func:`~staleness_metrics.engine.shipment.padded_shipment`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ParamSpec

from .columnar import RolloutBatch
from .padded_rows import PaddedLayout, padded_columns

__all__ = ["PaddedLayout", "from_padded"]

P = ParamSpec("P")


def _batch_of(columns: Callable[P, dict[str, Any]]) -> Callable[P, RolloutBatch]:
    """The function building a :class:`RolloutBatch` from what ``columns``
    returns, with its parameters."""

    def build(*args: P.args, **kwargs: P.kwargs) -> RolloutBatch:
        return RolloutBatch(**columns(*args, **kwargs))

    build.__doc__ = columns.__doc__
    return build


from_padded = _batch_of(padded_columns)
from_padded.__name__ = from_padded.__qualname__ = "from_padded"
