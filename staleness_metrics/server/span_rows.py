"""How many span rows (60 to 130 bytes each: a run of positions with one mask value and one
version) a body may cut, bounded before the queue builds any table (see docs/service.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .limits import SPAN_ROW_FLOOR
from .models import ErrorItem

PIECE_POSITIONS = 1 << 20  # positions compared at once: a 1 MiB bool and at most 8 MiB of indices


def allowed_span_rows(body_bytes: int, body_bytes_per_row: int) -> int:
    """The span rows a body of ``body_bytes`` may cut (``body_bytes_per_row`` 0: no cap)."""
    if body_bytes_per_row <= 0:
        return -1
    return max(SPAN_ROW_FLOOR, body_bytes // body_bytes_per_row)


def _length(values: Any) -> int:
    return len(values) if isinstance(values, Sequence | np.ndarray) and not isinstance(values, str) else 0


def _numbers(values: Any) -> npt.NDArray[Any] | None:
    """``values`` as a 1-d numeric array, or None (the library refuses them, naming why)."""
    if isinstance(values, np.ndarray):
        array = values
    elif isinstance(values, list):
        try:
            array = np.asarray(values)
        except (ValueError, TypeError, OverflowError):
            return None
    else:
        return None
    return array if array.ndim == 1 and array.dtype.kind in "biuf" else None


def _value_changes(values: npt.NDArray[Any]) -> int:
    changes = 0
    for start in range(1, len(values), PIECE_POSITIONS):
        end = min(start + PIECE_POSITIONS, len(values))
        changes += int(np.count_nonzero(values[start:end] != values[start - 1 : end - 1]))
    return changes


def _label_changes(labels: npt.NDArray[Any]) -> int:
    """Labelled positions (not -1) whose label differs from the previous label."""
    changes = 0
    last: Any = None
    for start in range(0, len(labels), PIECE_POSITIONS):
        labelled = labels[start : start + PIECE_POSITIONS]
        labelled = labelled[labelled != -1]
        if len(labelled) == 0:
            continue
        changes += int(np.count_nonzero(labelled[1:] != labelled[:-1]))
        if last is not None and labelled[0] != last:
            changes += 1
        last = labelled[-1]
    return changes


def _sample_rows(sample: Mapping[str, Any]) -> tuple[int, str]:
    """An upper bound of the rows ``sample`` cuts (one, plus every mask change and label change,
    plus its spans, at most its positions), and the field that cuts the most of them."""
    spans = _length(sample.get("weight_versions"))
    positions = max(_length(sample.get("mask")), _length(sample.get("token_versions")))
    mask = _numbers(sample.get("mask"))
    labels = _numbers(sample.get("token_versions"))
    by_field = {
        "mask": 0 if mask is None else _value_changes(mask),
        "token_versions": 0 if labels is None else _label_changes(labels),
        "weight_versions": spans,
    }
    rows = min(1 + by_field["mask"] + by_field["token_versions"] + spans, max(1, positions))
    return rows, max(by_field, key=lambda name: by_field[name])


def check_span_rows(records: Any, body_bytes: int, body_bytes_per_row: int) -> ErrorItem | None:
    """Where the rollouts of a body pass the span rows it may cut, else None (a bound from the
    samples' lengths first: most bodies stop there)."""
    allowed = allowed_span_rows(body_bytes, body_bytes_per_row)
    if allowed < 0 or not isinstance(records, list):
        return None
    samples_of = [
        (position, record, list(enumerate(record["samples"])))
        for position, record in enumerate(records)
        if isinstance(record, Mapping) and isinstance(record.get("samples"), list)
    ]
    by_length = sum(
        max(1, _length(s.get("mask")), _length(s.get("token_versions")))
        for _, _, samples in samples_of
        for _, s in samples
        if isinstance(s, Mapping)
    )
    if by_length <= allowed:
        return None
    total = 0
    for position, record, samples in samples_of:
        for index, sample in samples:
            if not isinstance(sample, Mapping):
                continue
            rows, field = _sample_rows(sample)
            total += rows
            if total > allowed:
                rid = record.get("id")
                return ErrorItem(
                    rollout_id=None if rid is None else str(rid),
                    index=position,
                    field=f"samples[{index}].{field}",
                    reason=(
                        f"the body cuts more than {allowed:,} span rows (runs of one mask value "
                        f"and one version; this rollout brings them to {total:,}): a body of "
                        f"{body_bytes:,} bytes may cut one per {body_bytes_per_row} bytes, at "
                        f"least {SPAN_ROW_FLOOR:,} (serve --body-bytes-per-span-row)"
                    ),
                )
    return None
