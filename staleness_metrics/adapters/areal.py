"""AReaL rollout batches (padded tensors with per-token ``versions``) as a :class:`RolloutBatch`.

Built from AReaL's own source, with no import of it:

- ``inclusionAI/AReaL`` @ ``072480e26a1dc2ac1692164e504315d7e508478b``, ``areal/workflow/rlvr.py``
  (``RLVRWorkflow.arun_episode``): each sequence is ``input_ids`` = prompt + output,
  ``loss_mask`` = ``[0] * prompt + [1] * output``, ``logprobs`` = ``[0.0] * prompt + output_logprobs``,
  ``versions`` = ``[-1] * prompt + output_versions`` (the engine version that sampled each output token),
  ``attention_mask`` all ones, ``rewards`` one per sequence; one dict per sample, each ``[1, n]``.
- ``inclusionAI/AReaL`` @ ``7da889ab7532e1a42dff35ee9362385ddde1c38f``, ``areal/utils/data.py``
  (``concat_padded_tensors``): the samples are right-padded to the longest ``attention_mask``, with 0 in
  ``attention_mask`` and ``pad_value`` (0) in every other key, ``versions`` included.

So a padded AReaL batch is ``[B, L]`` rows; the attention mask says which positions hold tokens (a
padded ``versions`` 0 is not a label), prompt positions are unlabelled (``-1``) and never sampled
(``loss_mask`` 0). Each row is one rollout. Its dispatch version is the oldest version among its
labels (a partial rollout keeps its first tokens' versions), unless given.

Where to call it: on the batch returned by ``rollout_batch`` / ``prepare_batch`` in the training loop,
before the loss; :func:`areal_loss_mask` is the ``loss_mask`` the loss reads after the ship.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..columnar import RolloutBatch
from ..padded import from_padded, padded_shipment

__all__ = ["areal_loss_mask", "from_areal"]


def from_areal(
    batch: Mapping[str, Any],
    ids: Sequence[str],
    *,
    group_ids: Sequence[str | None] | None = None,
    envs: Sequence[str | None] | None = None,
    dispatch_version: Any = None,
) -> RolloutBatch:
    """One rollout per row of an AReaL batch (``loss_mask``, ``versions``, ``attention_mask``, ``logprobs``).

    Tensors may be numpy arrays or CPU torch tensors (read through ``numpy.asarray``, so a contiguous
    ``loss_mask`` is masked in place). ``ids`` name the rows (AReaL's batches carry no id).
    """
    for key in ("loss_mask", "versions"):
        if key not in batch:
            raise KeyError(f"AReaL batch: missing {key!r} (present: {sorted(batch)})")
    return from_padded(
        ids,
        batch["loss_mask"],
        token_versions=batch["versions"],
        attention_mask=batch.get("attention_mask"),
        logprobs=batch.get("logprobs"),
        dispatch_version=dispatch_version,
        group_ids=group_ids,
        envs=envs,
    )


def areal_loss_mask(shipment: Any, batch: RolloutBatch) -> npt.NDArray[np.generic]:
    """The ``[B, L]`` ``loss_mask`` after ``shipment``: masked positions and rows not shipped are 0."""
    return padded_shipment(shipment, batch).mask
