"""The service's request and response bodies as pydantic models (they make the OpenAPI document;
the library validates rollouts and configurations), and its errors, one per status code."""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .. import __version__
from ..config import StalenessConfig
from ..errors import StalenessError, TraceError, shortened
from ..metrics.buckets import LAG_BUCKETS
from ..metrics.mismatch import COUNT_FIELDS, SUM_FIELDS
from ..metrics.report import Tally
from ..records.validation import INT64_MAX, INT64_MIN, lone_surrogate

# Run names appear in URLs and as the ``run`` label of every series.
RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
MAX_STEP = 2**53  # exact in every JSON client (2**53), far inside the sink's int64 tables
MAX_ERROR_ITEMS = 20  # a 422 lists so many errors and counts the rest (each costs memory)

Step = Annotated[int, Field(ge=1, le=MAX_STEP, strict=True, description="1-based train step (SPEC 2)")]
_REPLAYED = "True when this is the stored answer to a repeated Idempotency-Key."
Replayed = Annotated[bool, Field(description=_REPLAYED)]


def run_config_schema() -> dict[str, Any]:
    """The JSON schema of a run configuration, from :class:`StalenessConfig` itself."""
    schema = TypeAdapter(StalenessConfig).json_schema()
    schema["title"] = "RunConfig"
    schema["description"] = (
        "A StalenessConfig as JSON; every key is optional. Validated by the library: unknown keys "
        "and renamed ones (max_off_policy_steps -> max_staleness) are rejected with 422; "
        "max_staleness >= 0, max_token_staleness >= 0 or null, sync_interval >= 1 (each at most "
        "2**53), and the last three xtuner options only with policy 'xtuner'."
    )
    schema["additionalProperties"] = False
    schema["example"] = {"policy": "token", "max_staleness": 4}
    return schema


# SPEC 3's record as a JSON Schema (data/rollout.schema.json, for anyone to validate against), and its example
_ROLLOUT_SCHEMA: dict[str, Any] = json.loads(
    resources.files("staleness_metrics").joinpath("data/rollout.schema.json").read_text(encoding="utf-8")
)
_ROLLOUT_EXAMPLES = _ROLLOUT_SCHEMA.pop("examples")  # (beside the list in the OpenAPI document)
del _ROLLOUT_SCHEMA["$schema"], _ROLLOUT_SCHEMA["title"]


class ErrorItem(BaseModel):
    """What was wrong: the field and the reason, and for a rollout its id and place in the batch."""

    field: str = Field(description="The field at fault, e.g. 'samples[0].mask' or 'max_staleness'.")
    reason: str
    rollout_id: str | None = Field(default=None, description="The rollout's id, when the error is a record's.")
    index: int | None = Field(default=None, description="The record's position in the request's batch.")


class _Body(BaseModel):
    """A request body: strict, no unknown key (past MAX_ERROR_ITEMS of them one error, not each)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _few_unknown_keys(cls, body: Any) -> Any:
        if isinstance(body, dict) and len(body) - len(cls.model_fields) > MAX_ERROR_ITEMS:
            count = len(body.keys() - cls.model_fields.keys())
            raise PydanticCustomError("extra_forbidden", "{count} unknown keys", {"count": count})
        return body


class ValidationErrorBody(BaseModel):
    """422: the request is well-formed JSON but invalid; nothing of it was applied."""

    detail: list[ErrorItem]


class ErrorMessage(BaseModel):
    """Any other error (401, 404, 409, 413)."""

    detail: str


class Counts(BaseModel):
    """Additive accounting (the Tally of the library): per ship window, or summed over a run."""

    tokens_sampled: int
    tokens_masked: int
    tokens_unlabelled: int
    tokens_dropped: int
    samples_dropped: int
    rollouts_dropped: int
    rollouts_shipped: int
    rollouts_frozen: int
    rollouts_held: int
    rollouts_invalid: int


def counts_of(tally: Tally) -> Counts:
    return Counts(**{name: int(getattr(tally, name)) for name in Counts.model_fields})


class RunInfo(BaseModel):
    """A run: its configuration and where its sink stands."""

    run: str
    config: dict[str, Any] = Field(description="The effective configuration (every key, defaults included).")
    step: int = Field(description="Latest step a sweep or ship used (0 before any).")
    ships: int = Field(description="How many ships the run has done.")
    queued: int = Field(description="Rollouts waiting in the sink's queue.")
    rollouts_received: int = Field(description="Distinct rollout ids accepted or set aside (lenient mode).")
    duplicates_ignored: int = Field(description="Re-sent rollouts recognised and not counted again.")
    totals: Counts = Field(description="Sums over every ship of the run (what the Prometheus counters show).")


class RunList(BaseModel):
    runs: list[RunInfo]


class RolloutBatchIn(_Body):
    """A batch of finished rollouts for one run."""

    rollouts: list[dict[str, Any]] = Field(
        fail_fast=True,  # the first bad item is named, not one error (and its memory) per item
        description="SPEC 3 rollout records. A record whose id was accepted before counts as a duplicate.",
        json_schema_extra={"items": _ROLLOUT_SCHEMA, "examples": [_ROLLOUT_EXAMPLES]},
    )


class AddResult(BaseModel):
    run: str
    accepted: int = Field(description="Rollouts queued by this request.")
    duplicates: int = Field(description="Records whose id (with the same content) was received before.")
    invalid: list[ErrorItem] = Field(
        default_factory=list,
        description="Records set aside as invalid (lenient runs only; strict runs 422).",
    )
    queued: int = Field(description="Rollouts waiting in the run's queue after this request.")


class SweepRequest(_Body):
    step: Step


class ShipRequest(_Body):
    """Ship the batch for ``step``: all queued rollouts, or the named ones."""

    step: Step
    ids: list[str] | None = Field(
        default=None,
        fail_fast=True,
        description="Rollouts to ship (ids naming nothing queued are ignored); all when absent.",
    )
    include_rollouts: bool = Field(
        default=False,
        description="Return the shipped rollouts, masked, with their dropped samples removed.",
    )

    @field_validator("ids")
    @classmethod
    def _storable_ids(cls, ids: list[str] | None) -> list[str] | None:
        # the ship is journalled with its ids: a string the journal cannot write would break the run
        for index, rid in enumerate(ids or ()):
            if (at := lone_surrogate(rid)) is not None:
                raise PydanticCustomError(
                    "unstorable_id",
                    "ids[{index}]: not valid Unicode: lone surrogate at character {at}",
                    {"index": index, "at": at},
                )
        return ids


class ShipResult(BaseModel):
    """One ship: what was shipped, dropped and held in its window, with the SPEC 6 metrics."""

    run: str
    ship: int = Field(description="1-based number of this ship in the run.")
    step: int
    shipped: list[str]
    dropped_rollouts: list[str]
    dropped_samples: list[tuple[str, int]] = Field(description="[rollout id, sample index as added] pairs.")
    held: list[str]
    invalid: list[ErrorItem] = Field(description="Rollouts set aside as invalid in this window (lenient).")
    metrics: dict[str, float | int | str] = Field(description="The SPEC 6 metrics dict of the step.")
    counts: Counts
    rollouts: list[dict[str, Any]] | None = Field(
        None, description="With include_rollouts: the shipped rollouts as SPEC 3 records, masked."
    )
    lags: list[list[list[int]]] | None = Field(
        default=None,
        description="With include_rollouts: the lag of every position of each returned sample "
        "(SPEC 11; -1 outside the population), [rollout][sample][position], for a trainer "
        "posting its mismatch sums.",
    )
    replayed: Replayed = False


class StepRow(BaseModel):
    """One ship in the metrics history."""

    ship: int
    step: int
    metrics: dict[str, float | int | str] = Field(
        description="The SPEC 6 metrics of the ship; on the last ship of a step with posted "
        "mismatch sums, the SPEC 11 keys of their merged total (staleness/mismatch/...)."
    )
    counts: Counts
    token_histogram: list[int] = Field(description="Shipped sampled positions per token staleness (index).")
    rollout_histogram: list[int] = Field(description="Shipped live rollouts per rollout staleness (index).")
    mismatch: dict[str, Any] | None = Field(
        default=None,
        description="The merged mismatch sums posted for this step (MismatchSums.to_dict() form), "
        "on the step's last ship; null when none were posted.",
    )


_BUCKET_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [*COUNT_FIELDS, *SUM_FIELDS],
    "properties": {
        **{name: {"type": "integer", "minimum": 0} for name in COUNT_FIELDS},
        "sum_log_ratio": {"type": "number"},
        **{name: {"type": "number", "minimum": 0} for name in SUM_FIELDS if name != "sum_log_ratio"},
    },
    "description": "SPEC 11 sums of one lag bucket: counts of covered, masked and out-of-band "
    "positions, and the sums of d, |d|, k3, r and r^2.",
}

MISMATCH_SUMS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["uncovered", "lags"],
    "properties": {
        "format": {"type": "integer", "enum": [1], "default": 1},
        "uncovered": {
            "type": "integer",
            "minimum": 0,
            "description": "Sampled positions lacking a value.",
        },
        "lags": {
            "type": "object",
            "required": list(LAG_BUCKETS),
            "properties": {name: _BUCKET_SCHEMA for name in LAG_BUCKETS},
            "additionalProperties": False,
        },
    },
    "description": "MismatchSums.to_dict(): per lag bucket (0..16, 32, 64, inf) the additive sums of SPEC 11.",
}


class MismatchRequest(_Body):
    """Trainer-side mismatch sums (SPEC 11) of part of a shipped step: one
    rank's or micro-batch's."""

    step: Step
    sums: dict[str, Any] = Field(
        description="The sums as MismatchSums.to_dict() gives them; validated by the library.",
        json_schema_extra=MISMATCH_SUMS_SCHEMA,
    )
    env: str | None = Field(
        default=None,
        min_length=1,
        description="The env these sums are of (one post per env and rank). They count in the "
        "step's total as any others and, with the env breakdown, in the env's: "
        "staleness/env/<env>/mismatch/... and the env label of the mismatch counters. A non-empty "
        "string, as a rollout's env.",
    )


class MismatchResult(BaseModel):
    """The step's mismatch after this post: its merged total's SPEC 11 keys."""

    run: str
    step: int
    posts: int = Field(description="Posts merged into the step's total so far (replays not counted).")
    tokens: int = Field(description="Covered positions of the step's merged total.")
    metrics: dict[str, float | int | str] = Field(
        description="SPEC 11 and SPEC 14 keys of the merged total (staleness/mismatch/..., staleness/bound/...)."
    )
    replayed: Replayed = False


class StepsPage(BaseModel):
    run: str
    steps: list[StepRow]


class Health(BaseModel):
    status: Literal["ok", "unavailable"] = "ok"
    version: str = __version__
    runs: int
    unavailable: dict[str, str] = Field(
        default_factory=dict,
        description="Runs that answer 503, or still load after a restart, and why (the service "
        "answers 503 while any is).",
    )


class RunError(Exception):
    """A request the run cannot honour, answered with ``status``."""

    status = 409


class RunNotFound(RunError):
    status = 404


class RunConflict(RunError):
    """Conflicts with the run's state (another configuration, a step below the latest, ...)."""


class RunBroken(RunError):
    """A write could not be persisted: memory ahead of the store, or a run not created or deleted."""

    status = 503


class ServiceStopping(RunError):
    """The service stopped (past its grace) before the request's answer: it may be sent again."""

    status = 503


class RestoreFailed(Exception):
    """A stored run could not be loaded again (the message names the run and the row)."""


def reason_of(exc: BaseException) -> str:
    """How a restore failure names its cause: a deliberate error's message, else the type too."""
    return str(exc) if isinstance(exc, RunError | TraceError | ValueError) else f"{type(exc).__name__}: {exc}"


class RecordsInvalid(RunError):
    """Invalid records or ship-time versions; nothing of the request was applied."""

    status = 422

    def __init__(self, errors: list[ErrorItem]) -> None:
        super().__init__("; ".join(f"{e.rollout_id!r}: {e.field}: {e.reason}" for e in errors))
        self.errors = errors


class SpanRowsTooMany(RecordsInvalid):
    """More span rows than the body's size allows: 413, in the shape of an invalid request."""

    status = 413


def trace_item(error: TraceError, index: int | None = None) -> ErrorItem:
    rid = error.rollout_id
    return ErrorItem(field=error.field, reason=error.reason, rollout_id=rid, index=index)


def out_of_range(value: Any, path: str) -> str | None:
    """Path of the first integer in ``value`` outside int64 (the sink's width), else None (a stack
    of its own, not recursion: as deep as the JSON reader reads)."""
    stack = [(path, value)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, Mapping):
            stack += reversed([(f"{path}.{k}" if path else str(k), v) for k, v in value.items()])
        elif isinstance(value, list):
            stack += reversed([(f"{path}[{i}]", v) for i, v in enumerate(value)])
        elif type(value) is int and not INT64_MIN <= value <= INT64_MAX:  # (JSON's: no bool)
            return path
    return None


def field_item(error: ValueError, default_field: str) -> ErrorItem:
    """The library's error as an item (``default_field`` and the message when it names no field)."""
    if isinstance(error, StalenessError) and error.field:  # its reason may quote a huge value: cut
        return ErrorItem(field=error.field, reason=shortened(error.reason))
    return ErrorItem(field=default_field, reason=shortened(str(error)))
