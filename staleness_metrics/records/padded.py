"""Padded ``[B, L]`` batches, the shape every trainer holds, as a :class:`RolloutBatch` and back.

:func:`from_padded` (also :meth:`RolloutBatch.from_padded`) reads the rows (:mod:`.padded_rows` does the
work); :func:`padded_shipment` gives the caller's ``[B, L]`` arrays as a ship left them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec

import numpy as np
import numpy.typing as npt

from .columnar import WEIGHT_FIELDS, RolloutBatch
from .padded_rows import PaddedLayout, padded_columns

if TYPE_CHECKING:
    from ..engine.shipment import Shipment

__all__ = ["PaddedLayout", "PaddedShipment", "from_padded", "padded_shipment"]

BoolArray = npt.NDArray[np.bool_]
P = ParamSpec("P")


@dataclass(frozen=True)
class PaddedShipment:
    """A ship seen as the caller's ``[B, L]`` arrays.

    ``shipped[i]`` says whether row ``i`` was shipped by this ship (its sample kept). ``mask`` and each
    present weight array are the masked values of shipped rows and 0 on every other row (dropped,
    held, still queued or shipped earlier), so the loss reads them as they are.
    """

    shipped: BoolArray
    mask: npt.NDArray[Any]
    rl_weights: npt.NDArray[Any] | None
    ce_weights: npt.NDArray[Any] | None
    ref_kl_weights: npt.NDArray[Any] | None


def _batch_of(columns: Callable[P, dict[str, Any]]) -> Callable[P, RolloutBatch]:
    """The function building a :class:`RolloutBatch` from what ``columns`` returns, with its parameters."""

    def build(*args: P.args, **kwargs: P.kwargs) -> RolloutBatch:
        return RolloutBatch(**columns(*args, **kwargs))

    build.__doc__ = columns.__doc__
    return build


from_padded = _batch_of(padded_columns)
from_padded.__name__ = from_padded.__qualname__ = "from_padded"


def padded_shipment(shipment: Shipment, batch: RolloutBatch) -> PaddedShipment:
    """The ``[B, L]`` arrays the loss reads after ``shipment``, for rows of ``batch`` (from :func:`from_padded`).

    Rows of other batches in the same ship are ignored.
    """
    layout = batch.padded
    if layout is None:
        raise ValueError("padded_shipment: the batch was not built by from_padded")
    picked = [r.index for r in shipment.rollouts if r.batch is batch and r.samples]
    shipped = np.zeros(layout.rows, dtype=bool)
    shipped[np.asarray(picked, dtype=np.int64)] = True
    keep = shipped[:, None]
    shape = (layout.rows, layout.width)

    def read_back(values: npt.NDArray[Any] | None) -> npt.NDArray[Any] | None:
        if values is None:
            return None
        return np.where(keep, values.reshape(shape), np.zeros((), dtype=values.dtype))

    mask = read_back(batch.mask)
    assert mask is not None
    weights = {name: read_back(getattr(batch, name)) for name in WEIGHT_FIELDS}
    return PaddedShipment(shipped=shipped, mask=mask, **weights)
