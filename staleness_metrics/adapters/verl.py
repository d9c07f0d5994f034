"""verl's fully async batches (``DataProto``) as a :class:`RolloutBatch` and back, one rollout per
row, read with no import of verl (the fields and their sources: ``docs/trainers/verl.md``)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Container, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt

from ..engine.shipment import Shipment, padded_shipment
from ..errors import FieldError, MissingFieldError, TraceError
from ..records.columnar import RolloutBatch, as_int64
from ._ship import Batches, SetAside, TrainerArray, TrainerNames, new_tensor_like, read_rows, ship_rows, take_rows

_VERSION_FIELDS = (
    ("param_version_start", "param_version_end"),
    ("min_global_steps", "max_global_steps"),
)


def _versions(extras: Mapping[str, Any], name: str, ids: Sequence[str]) -> npt.NDArray[np.int64]:
    values = extras.get(name, ())  # (none: every row was set aside, for want of it)
    if len(values) != len(ids):
        raise FieldError(f"non_tensor_batch[{name!r}]", f"verl batch: {len(values)} rows for {len(ids)} ids")
    if (row := next((row for row, value in enumerate(values) if value is None), None)) is not None:
        reason = "is None: the trajectory has no policy version (the rollout server never got set_global_steps)"
        raise TraceError(ids[row], f"non_tensor_batch[{name!r}][{row}]", reason)
    return as_int64(values, f"non_tensor_batch[{name!r}]", ids)


def verl_row_ids(uids: Sequence[Any], taken: Container[str] = frozenset()) -> list[str]:
    """Row ids ``"<uid>/<k>"``: the k-th trajectory of prompt group ``uid`` in this batch, k past the
    ids ``taken`` (by an earlier call: a group split over batches, an xtuner re-rollout)."""
    seen: Counter[str] = Counter()
    out: list[str] = []
    for key in map(str, uids):
        while (rid := f"{key}/{seen[key]}") in taken:
            seen[key] += 1
        out.append(rid)
        seen[key] += 1
    return out


def from_verl(
    data: Any,
    *,
    ids: Sequence[str] | None = None,
    token_versions: Any = None,
    env_key: str = "data_source",
) -> RolloutBatch:
    """One rollout per trajectory of a ``DataProto`` (or a ``(tensors, non_tensors)`` pair), its
    versions from ``param_version_start`` / ``_end`` (else ``min_`` / ``max_global_steps``), the
    group from ``uid``; ``ids`` default to :func:`verl_row_ids`, ``env_key`` names the env field."""
    tensors, extras = data if isinstance(data, tuple) else (data.batch, data.non_tensor_batch)
    if "response_mask" in tensors:
        mask = np.asarray(tensors["response_mask"])
    elif "responses" in tensors and "attention_mask" in tensors:
        mask = np.array(_tail(tensors["attention_mask"], np.asarray(tensors["responses"]).shape[1]))
    else:
        raise MissingFieldError("response_mask", "verl batch: needs response_mask, or responses and attention_mask")
    attention = tensors.get("attention_mask")
    attention = None if attention is None else _tail(np.asarray(attention), mask.shape[1])
    uids = extras.get("uid")
    if ids is None:
        if uids is None:
            raise MissingFieldError("uid", "verl batch: no uid in non_tensor_batch; pass ids")
        ids = verl_row_ids(list(uids))
    start_end = next(((a, b) for a, b in _VERSION_FIELDS if a in extras), None)
    if start_end is None and ids:
        reason = "missing (nor param_version_start): the batch carries no policy version of its trajectories"
        raise TraceError(ids[0], "non_tensor_batch['min_global_steps']", reason)
    start_end = start_end or _VERSION_FIELDS[1]
    envs = extras.get(env_key)
    return RolloutBatch.from_padded(
        ids,
        mask,
        dispatch_version=_versions(extras, start_end[0], ids),
        completion_version=_versions(extras, start_end[1], ids) if start_end[1] in extras else None,
        token_versions=token_versions,
        attention_mask=attention,
        logprobs=tensors.get("rollout_log_probs"),
        # old_log_probs: the actor's log-probabilities under the weights this step trains (SPEC 11)
        trainer_logprobs=tensors.get("old_log_probs"),
        group_ids=None if uids is None else [str(u) for u in uids],
        envs=None if envs is None else [None if e is None else str(e) for e in envs],
    )


def _tail(matrix: Any, width: int) -> Any:
    """The last ``width`` columns (none for 0: ``[:, -0:]`` is every column)."""
    return matrix[:, matrix.shape[1] - width :]


def verl_response_mask(shipment: Shipment, batch: RolloutBatch) -> npt.NDArray[np.generic]:
    """The ``[B, Lr]`` ``response_mask`` after ``shipment`` (0 on masked and unshipped rows)."""
    return padded_shipment(shipment, batch).mask


_READ = ("response_mask", "attention_mask", "responses", "rollout_log_probs", "old_log_probs")


def _names(extras: Mapping[str, Any], env_key: str) -> TrainerNames:
    start, end = next(((a, b) for a, b in _VERSION_FIELDS if a in extras), _VERSION_FIELDS[1])
    return TrainerNames(
        "verl",
        "current_param_version (fully async trainer; not global_steps, which counts local updates)",
        {"dispatch_version": f"non_tensor_batch[{start!r}][{{row}}]",
         "completion_version": f"non_tensor_batch[{end!r}][{{row}}]",
         "mask": "batch['response_mask'][{row}]", "env": f"non_tensor_batch[{env_key!r}][{{row}}]",
         # (from_padded reads token_versions as weight_versions' spans)
         **dict.fromkeys(("token_versions", "weight_versions"), "token_versions[{row}]"),
         "logprobs": "batch['rollout_log_probs'][{row}]",
         "trainer_logprobs": "batch['old_log_probs'][{row}]"},
    )  # fmt: skip


def _apart(data: Any, held: Any) -> str | None:
    """Why rows ``held`` from an earlier call cannot come back with ``data``'s: ``DataProto.concat``
    joins the same keys, of tensors the same shape past the rows."""
    for part in ("batch", "non_tensor_batch"):
        before, now = getattr(held, part), getattr(data, part)
        diff = [f"+{k}" for k in sorted(set(now.keys()) - set(before.keys()))]
        diff += [f"-{k}" for k in sorted(set(before.keys()) - set(now.keys()))]
        if part == "batch" and not diff:
            diff = [f"{k} {tuple(now[k].shape)}" for k in sorted(now.keys()) if before[k].shape[1:] != now[k].shape[1:]]
        if diff:
            why = f"this call's {part} differs from that of rows held from an earlier call ({', '.join(diff)})"
            return f"{why}: they cannot be given back together; call ship where every batch has the same keys"
    return None


def ship(monitor: Any, data: Any, *, version: int, ids: Sequence[str] | None = None,
         token_versions: Any = None, env_key: str = "data_source") -> Any:  # fmt: skip
    """SPEC 15's one call for verl: ship ``data`` at ``version`` (``current_param_version``); give
    back the ``DataProto`` to train on: the shipped rows, oldest call first (``data`` itself when
    all shipped), masked in its ``response_mask``, with ``batch["staleness_lag"]`` ``[B, Lr]``."""
    tensors, extras = data.batch, data.non_tensor_batch
    present = tensors.keys()  # a TensorDict refuses `in` on itself
    if "response_mask" not in present and "responses" in present and "attention_mask" in present:
        # as verl's compute_response_mask makes it: the sink masks this, never attention_mask
        width = tensors["responses"].shape[1]
        tensors["response_mask"] = _tail(tensors["attention_mask"], width).clone()
    names, uids, envs = _names(extras, env_key), extras.get("uid"), extras.get(env_key)

    def read(ids: Sequence[str] | None, rows: list[int] | None) -> tuple[Any, RolloutBatch, dict[str, TrainerArray]]:
        kept = data if rows is None else data.select_idxs(rows)  # (lenient: the rows not set aside)
        views = {k: TrainerArray(kept.batch[k], f"batch[{k!r}]") for k in _READ if k in present}
        arrays = ({key: view.array for key, view in views.items()}, kept.non_tensor_batch)
        row_ids = ids if rows is None or ids is None else [ids[k] for k in rows]
        versions = take_rows(token_versions, rows, len(data))
        try:
            batch = from_verl(arrays, ids=row_ids, token_versions=versions, env_key=env_key)
        except TraceError as error:  # a row named by its index in `kept`: name it as in `data`
            if rows is None:
                raise
            field = re.sub(r"\[(\d+)\]$", lambda match: f"[{rows[int(match[1])]}]", error.field)
            raise TraceError(error.rollout_id, field, error.reason) from error
        return kept, batch, views

    def read_call(set_aside: SetAside) -> Batches[Any]:  # (ids past the queue's: under its lock)
        row_ids = verl_row_ids(list(uids), monitor.sink.queue.seen_ids) if ids is None and uids is not None else ids
        source, rollouts, views = read_rows(monitor, row_ids or (), partial(read, row_ids), names, envs=envs,
                                            set_aside=set_aside)  # fmt: skip
        mask_view = views.get("response_mask")
        return [(rollouts, source, None if mask_view is None else lambda: mask_view.write_back(rollouts.mask))]

    result = ship_rows(monitor, read_call, version=version, names=names, given=data, apart=partial(_apart, data))
    parts = []
    for part in result.parts or result.empty:
        source = part.source
        picked = source if part.every_row else source.select_idxs(part.rows)
        picked.batch["staleness_lag"] = new_tensor_like(source.batch["response_mask"], part.lag_matrix())
        parts.append(picked)
    if len(parts) == 1 and parts[0] is data:
        result.handed_back(monitor)  # (its last act: a Ctrl-C before it, a repeat gets this result)
        return data
    # concat asserts equal meta_info across parts; the batch is this call's, so is its meta_info
    bare = [type(p)(batch=p.batch, non_tensor_batch=p.non_tensor_batch, meta_info={}) for p in parts]
    out = bare[0] if len(bare) == 1 else type(data).concat(bare)
    out.meta_info = dict(data.meta_info)
    if "attention_mask" in out.batch.keys() and "global_token_num" in out.meta_info:  # noqa: SIM118
        out.meta_info["global_token_num"] = out.batch["attention_mask"].sum(dim=-1).tolist()
    if "trajectory_param_versions" in out.meta_info and "max_global_steps" in out.non_tensor_batch:
        out.meta_info["trajectory_param_versions"] = out.non_tensor_batch["max_global_steps"]
    result.handed_back(monitor)
    return out
