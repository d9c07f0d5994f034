"""``data/rollout.schema.json``: SPEC 3's record as a JSON Schema, the one the OpenAPI document shows for
``POST /v1/runs/{run}/rollouts`` and that anyone may validate records against before sending them."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import jsonschema
import pytest

from staleness_metrics.server.app import ServerSettings, create_app
from tests.reference.streams import random_stream

SCHEMA: dict[str, Any] = json.loads(
    resources.files("staleness_metrics").joinpath("data/rollout.schema.json").read_text(encoding="utf-8")
)


def test_the_file_is_a_json_schema_and_its_example_a_record() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    for example in SCHEMA["examples"]:
        jsonschema.validate(example, SCHEMA)


@pytest.mark.parametrize("policy", ["token", "episode", "group", "xtuner"])
def test_every_record_of_random_valid_streams_validates(policy: str) -> None:
    for seed in range(20):
        _, events = random_stream(seed, policy)
        for event in events:
            if event["type"] == "rollout":
                jsonschema.validate(event["rollout"], SCHEMA)


@pytest.mark.parametrize(
    "change",
    [{"max_off_policy_steps": 1}, {"samples": []}, {"id": ""}, {"source": "stale"}, {"dispatch_version": -1}],
)
def test_records_spec_3_refuses_are_refused(change: dict[str, Any]) -> None:
    record = {**SCHEMA["examples"][0], **change}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(record, SCHEMA)


def test_the_openapi_document_shows_it_for_the_rollouts_body() -> None:
    document = create_app(ServerSettings()).openapi()
    post = document["paths"]["/v1/runs/{run}/rollouts"]["post"]
    body = post["requestBody"]["content"]["application/json"]["schema"]["properties"]["rollouts"]
    shown = {key: value for key, value in SCHEMA.items() if key not in ("$schema", "title", "examples")}
    assert body["items"] == shown and body["examples"] == [SCHEMA["examples"]]
