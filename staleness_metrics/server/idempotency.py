"""Exactly-once for the service's writes: digests of records (a rollout counts once by id and
content), and the answers kept by ``Idempotency-Key``."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

import numpy as np
import orjson
from pydantic import BaseModel

from ..records.validation import unstorable
from ..state_checks import PIECE_ITEMS, json_pieces
from .errors import RecordsInvalid
from .models import ErrorItem

IDEMPOTENCY_KEYS_KEPT = 1024
_DIGEST_OPTIONS = orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY


def holds_large_array(record: Mapping[str, Any]) -> bool:
    """True when a sample holds an array to hash and journal a piece at a time."""
    samples = record.get("samples")
    return isinstance(samples, list) and any(
        isinstance(value, np.ndarray) and value.size > PIECE_ITEMS
        for sample in samples
        if isinstance(sample, dict)
        for value in sample.values()
    )


def _canonical_digest(record: Mapping[str, Any], option: int) -> bytes:
    if not holds_large_array(record):
        return hashlib.blake2b(orjson.dumps(record, option=option), digest_size=16).digest()
    digest = hashlib.blake2b(digest_size=16)
    for piece in json_pieces(dict(record), option):
        digest.update(piece)
    return digest.digest()


def record_digest(record: Mapping[str, Any]) -> bytes:
    """The digest of a record's canonical JSON: the same content, the same digest."""
    # orjson writes bytes; json.dumps would first build a string per list item (per position).
    try:
        return _canonical_digest(record, _DIGEST_OPTIONS)
    except orjson.JSONEncodeError:  # an integer beyond 64 bits: rejected later, with its path
        canonical = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(canonical, digest_size=16).digest()


def stored_digest(record: Mapping[str, Any]) -> bytes | None:
    """:func:`record_digest` of a record the journal can store, None for one it cannot."""
    try:
        return _canonical_digest(record, _DIGEST_OPTIONS | orjson.OPT_STRICT_INTEGER)
    except orjson.JSONEncodeError:
        if unstorable(record) is not None:
            return None
        # integers past 2**53 but within 64 bits: stored exactly all the same
        return record_digest(record)


A = TypeVar("A", bound=BaseModel)


class Answers(Generic[A]):
    """The newest answers of one endpoint of a run by idempotency key, each with its request's
    fingerprint; ``different`` names another request in the 422 (``"a different ship"``)."""

    def __init__(self, different: str, answer: type[A]) -> None:
        self.different = different
        self._answer = answer
        self._answers: OrderedDict[str, tuple[list[Any], A]] = OrderedDict()

    def replay(self, key: str | None, fingerprint: list[Any]) -> A | None:
        """The first answer to ``key`` (``replayed``), None for a new key; 422 for another."""
        if key is None or key not in self._answers:
            return None
        first, answer = self._answers[key]
        if first != fingerprint:
            reason = f"Idempotency-Key {key!r} was used for {self.different} of this run"
            raise RecordsInvalid([ErrorItem(field="Idempotency-Key", reason=reason)])
        return answer.model_copy(update={"replayed": True})

    def remember(self, key: str | None, fingerprint: list[Any], answer: A) -> None:
        if key is None:
            return
        self._answers[key] = (fingerprint, answer)
        while len(self._answers) > IDEMPOTENCY_KEYS_KEPT:
            self._answers.popitem(last=False)

    def to_json(self) -> list[list[Any]]:
        """``[[key, fingerprint, answer], ...]``, oldest first."""
        return [[key, fp, ans.model_dump(mode="json")] for key, (fp, ans) in self._answers.items()]

    def load_json(self, items: Any) -> None:
        answers = ((key, (list(fp), self._answer.model_validate(ans))) for key, fp, ans in items)
        self._answers = OrderedDict(answers)
