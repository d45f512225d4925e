"""One pydantic model per request shape serves both its validation and its OpenAPI
schema: what the schema names is what the model takes, and the model's own checks
answer with their own sentences."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from dispatcher.api.errors import ApiError
from dispatcher.api.openai_shape import first_error
from dispatcher.api.routes.openai import EmbeddingsRequest
from dispatcher.api.task_request import FIELDS, TaskRequest, task_request
from dispatcher.contract.settings import Settings

SETTINGS = Settings(redis_url="redis://unused", max_timeout_s=600, max_gpu_memory_mb=1000)


def test_the_task_schema_served_is_the_models(known_types: None, http: httpx.Client) -> None:
    spec = http.get("/openapi.json").json()
    content = spec["paths"]["/tasks"]["post"]["requestBody"]["content"]
    model = set(TaskRequest.model_json_schema(by_alias=True)["properties"])
    assert model == set(FIELDS) == {"type", "class", "args", "timeout_s", "gpu_memory_mb"}
    for branch in content["application/json"]["schema"]["oneOf"]:
        assert set(branch["properties"]) == model and branch["additionalProperties"] is False
        assert branch["properties"]["timeout_s"]["anyOf"][0]["maximum"] > 0  # the settings'
    embeddings = spec["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]
    served = embeddings["application/json"]["schema"]["properties"]
    assert set(served) == set(EmbeddingsRequest.model_json_schema()["properties"])


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"type": ""}, "'type' field must be a non-empty string"),
        ({"type": "echo", "class": 5}, "'class' field"),
        ({"type": "echo", "args": [1]}, "'args' must be a JSON object"),
        ({"type": "echo", "args": None}, "'args' must be a JSON object"),
        ({"type": "echo", "timeout_s": True}, "number of seconds"),
        ({"type": "echo", "timeout_s": 601}, "at most 600"),
        ({"type": "echo", "timeout_s": 10**400}, "at most 600"),  # no float overflow
        ({"type": "echo", "gpu_memory_mb": 1001}, "0 to 1000"),
        ({"type": "echo", "gpu_memory_mb": 2.5}, "whole number"),
        ({"type": "echo", "arg": {}, "zz": 1}, "Unknown fields ['arg', 'zz']"),
    ],
)
def test_a_bad_task_is_a_422_naming_what_is_wrong(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(ApiError) as raised:
        task_request(fields, SETTINGS)
    assert raised.value.status == 422 and words in raised.value.message, raised.value.message


def test_a_task_takes_what_json_schema_calls_valid() -> None:
    req = task_request({"type": "echo", "class": None, "gpu_memory_mb": 1000.0}, SETTINGS)
    assert req.gpu_memory_mb == 1000 and req.class_ is None and req.args == {}
    assert task_request({"type": "echo", "timeout_s": 600}, SETTINGS).timeout_s == 600.0


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"model": "m", "input": ["ok", ""]}, "input", "'input[1]' is empty."),
        ({"model": "m", "input": ["x"] * 2049}, "input", "2049 items"),
        ({"model": "m", "input": "x" * 11}, "input", "at most 10"),  # the context's limit
        ({"input": "x"}, "model", "'model' is required."),
        ({"model": "m", "input": "x", "dimensions": True}, "dimensions", "whole number"),
        ({"model": "m", "input": "x", "encoding_format": "int8"}, "encoding_format", "base64"),
    ],
)
def test_a_bad_embeddings_request_is_openais_400(
    body: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(ValidationError) as raised:
        EmbeddingsRequest.model_validate(body, context={"max_chars": 10})
    error = first_error(raised.value)
    assert error.status == 400 and error.extra["param"] == param
    assert words in error.message, error.message


def test_embeddings_take_what_json_schema_calls_valid() -> None:
    req = EmbeddingsRequest.model_validate({"model": "m", "input": "x", "dimensions": 8.0})
    assert req.dimensions == 8 and req.input == ["x"] and req.encoding_format == "float"
