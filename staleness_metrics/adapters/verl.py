"""verl async-trainer batches (``DataProto``) as a :class:`RolloutBatch`.

Built from verl's own source, with no import of it:

- ``volcengine/verl`` @ ``0794432856e48e1c769b38899f6300ae9caa69ba``,
  ``verl/experimental/fully_async_policy/detach_utils.py`` (``assemble_batch``): every trajectory of a
  fully-async batch carries ``non_tensor_batch["param_version_start"]`` and ``["param_version_end"]``,
  the parameter version when its generation started and when it ended (a partial rollout resumed
  under newer weights has ``end > start``); ``uid`` is its prompt group.
- ``volcengine/verl`` @ ``3d9df73353a546a98235b38653c2c163efb51420``, ``verl/trainer/ppo/ray_trainer.py``
  (``compute_response_mask``): ``responses`` and ``response_mask`` are ``[B, Lr]``, ``attention_mask``
  is ``[B, Lp + Lr]`` (prompt left-padded, response right-padded), and the response's valid positions
  are ``attention_mask[:, -Lr:]``; ``rollout_log_probs`` (sampler) and ``old_log_probs`` (the actor's,
  recomputed under the weights being trained: SPEC 11's trainer log-probabilities) are ``[B, Lr]``.
- verl's agent loops also stamp ``min_global_steps`` / ``max_global_steps`` per trajectory (same
  meaning, other names); they are read when the ``param_version_*`` fields are absent.

Mapping: one row = one rollout; ``dispatch_version`` = start, ``completion_version`` = end; the
response mask is the SPEC 3 mask. verl records no per-token version, so every position is unlabelled
and takes the start (SPEC 3's conservative rule) unless ``token_versions`` are passed; then
``staleness/rollout/mean`` is verl's ``trajectory_staleness_worst`` (``T - start``) and verl's newest-token
``trajectory_staleness`` (``T - end``) is ``staleness/rollout/in_queue`` (``Q = R - clamp(end - start, 0, R)``).
With per-token versions it is ``staleness/rollout/newest``.

Where to call it: in the trainer's step, on the batch taken from the message queue, before the actor
update; :func:`verl_response_mask` is the ``response_mask`` the loss reads after the ship.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..columnar import RolloutBatch
from ..padded import from_padded, padded_shipment

__all__ = ["from_verl", "verl_response_mask", "verl_row_ids"]

_VERSION_FIELDS = (("param_version_start", "param_version_end"), ("min_global_steps", "max_global_steps"))


def _parts(data: Any) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    if isinstance(data, tuple):
        tensors, extras = data
        return tensors, extras
    return data.batch, data.non_tensor_batch


def verl_row_ids(uids: Sequence[Any]) -> list[str]:
    """Row ids ``"<uid>/<k>"``: the k-th trajectory of prompt group ``uid`` in this batch."""
    seen: dict[str, int] = {}
    out: list[str] = []
    for uid in uids:
        key = str(uid)
        out.append(f"{key}/{seen.get(key, 0)}")
        seen[key] = seen.get(key, 0) + 1
    return out


def from_verl(
    data: Any,
    *,
    ids: Sequence[str] | None = None,
    token_versions: Any = None,
    env_key: str = "data_source",
) -> RolloutBatch:
    """One rollout per trajectory of a verl batch: ``data`` is a ``DataProto`` (anything with ``batch``
    and ``non_tensor_batch``) or a ``(tensors, non_tensors)`` pair of mappings.

    Reads ``response_mask`` (else ``attention_mask[:, -Lr:]``), ``responses`` / ``attention_mask`` for the
    valid region, ``rollout_log_probs``, the version fields, ``uid`` (group) and ``env_key`` (env).
    ``ids`` default to :func:`verl_row_ids` of ``uid``.
    """
    tensors, extras = _parts(data)
    if "response_mask" in tensors:
        mask = np.asarray(tensors["response_mask"])
    elif "responses" in tensors and "attention_mask" in tensors:
        mask = np.asarray(tensors["attention_mask"])[:, -np.asarray(tensors["responses"]).shape[1] :]
    else:
        raise KeyError("verl batch: needs response_mask, or responses and attention_mask")
    width = mask.shape[1]
    attention = None
    if "attention_mask" in tensors:
        attention = np.asarray(tensors["attention_mask"])[:, -width:]
    start_end = next(((a, b) for a, b in _VERSION_FIELDS if a in extras), None)
    if start_end is None:
        raise KeyError("verl batch: needs param_version_start/_end (or min/max_global_steps) in non_tensor_batch")
    start = np.asarray(extras[start_end[0]], dtype=np.int64)
    end = np.asarray(extras[start_end[1]], dtype=np.int64) if start_end[1] in extras else None
    uids = extras.get("uid")
    if ids is None:
        if uids is None:
            raise KeyError("verl batch: no uid in non_tensor_batch; pass ids")
        ids = verl_row_ids(list(uids))
    envs = extras.get(env_key)
    return from_padded(
        ids,
        mask,
        dispatch_version=start,
        completion_version=end,
        token_versions=token_versions,
        attention_mask=attention,
        logprobs=tensors.get("rollout_log_probs"),
        # old_log_probs: the actor's log-probabilities under the weights this step trains (SPEC 11)
        trainer_logprobs=tensors.get("old_log_probs"),
        group_ids=None if uids is None else [str(u) for u in uids],
        envs=None if envs is None else [None if e is None else str(e) for e in envs],
    )


def verl_response_mask(shipment: Any, batch: RolloutBatch) -> npt.NDArray[np.generic]:
    """The ``[B, Lr]`` ``response_mask`` after ``shipment``: masked positions and rows not shipped are 0."""
    return padded_shipment(shipment, batch).mask
