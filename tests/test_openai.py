"""The OpenAI-compatible entry with the official ``openai`` package as the client: a real
API, a real worker running the real model (``embed``), tenant keys as API keys, and
OpenAI's error shapes and statuses."""

from __future__ import annotations

import base64
import json
import math
import socket
import struct
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
from conftest import WorkerFactory, make_settings
from gl_vector_tasks import MODEL as VECTORS
from gl_vector_tasks import NO_VECTOR, PAST_FLOAT32, vector
from support.catalog import tenant
from support.models import EMBED_TASKS, MODEL, requires_models, wait_model_loaded

from dispatcher.contract import keys
from dispatcher.contract.jobs import decode_call
from dispatcher.contract.settings import ClassConfig
from testkit import ApiServer, wait_for

pytestmark = requires_models

KEY = "sk-acme-0123456789"


@pytest.fixture
def api(redis_url: str, known_embed: None, api_factory: Callable[..., ApiServer]) -> ApiServer:
    """An API with one tenant key, and the embed type known (as a fresh deployment)."""
    settings = make_settings(redis_url, tenants=[tenant("acme", KEY, admin=True)])
    return api_factory(settings)


@pytest.fixture
def sdk(api: ApiServer) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{api.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    yield client
    client.close()


def _norm(vector: list[float]) -> float:
    return math.sqrt(math.fsum(x * x for x in vector))


def test_embeddings_through_the_sdk(
    api: ApiServer, sdk: openai.OpenAI, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    worker = start_worker("openai-w", wait=False, extra=EMBED_TASKS)
    wait_model_loaded(r, worker)

    assert [m.id for m in sdk.models.list().data] == [MODEL]
    texts = ["hello world", "gpulane dispatches GPU work", "hello world"]
    answer = sdk.embeddings.create(model=MODEL, input=texts)  # the SDK asks for base64
    assert [item.index for item in answer.data] == [0, 1, 2]
    vectors = [item.embedding for item in answer.data]
    assert all(len(v) == 384 and math.isclose(_norm(v), 1.0, abs_tol=1e-4) for v in vectors)
    assert vectors[0] == pytest.approx(vectors[2], abs=1e-5)  # same text, same vector
    assert vectors[0] != pytest.approx(vectors[1], abs=1e-3)
    assert answer.model == MODEL
    assert answer.usage.prompt_tokens == answer.usage.total_tokens
    assert answer.usage.prompt_tokens == 4 + 4 + _tokens(api, "gpulane dispatches GPU work")

    floats = sdk.embeddings.create(model=MODEL, input="hello world", encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(vectors[0], abs=1e-5)
    raw = httpx.post(
        f"{api.url}/v1/embeddings",
        json={"model": MODEL, "input": "hello world", "encoding_format": "base64"},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    # One text, one batch each: the same float32 values, bit for bit, either way.
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == floats.data[0].embedding
    # The route asked the task for packed vectors: its chunks' results hold base64, a
    # quarter of the bytes of JSON numbers, passed through to a base64 client as is.
    chunks = [k for k in r.scan_iter("rq:job:*") if r.hget(k, "items")]
    assert chunks
    for key in chunks:
        record = httpx.get(
            f"{api.url}/tasks/{key.decode().removeprefix('rq:job:')}",
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=10,
        ).json()
        assert all(isinstance(x["embedding"], str) for x in record["result"]["results"])


def _tokens(api: ApiServer, text: str) -> int:
    """The token count the model reported for one text, through the task API."""
    headers = {"Authorization": f"Bearer {KEY}", "Prefer": "wait=60"}
    body = {"type": "embed", "class": "interactive", "args": {"text": text}}
    record = httpx.post(f"{api.url}/tasks", json=body, headers=headers, timeout=70).json()
    return int(record["result"]["tokens"])


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"model": "no-such-model", "input": "x"}, 404, "model_not_found"),
        ({"model": MODEL, "input": ""}, 400, "invalid_request"),
        ({"model": MODEL, "input": []}, 400, "invalid_request"),
        ({"model": MODEL, "input": ["x"] * 2049}, 400, "invalid_request"),
        ({"model": MODEL, "input": "x" * 8193}, 400, "invalid_request"),
        ({"model": MODEL, "input": [[1, 2, 3]]}, 400, "invalid_request"),
        ({"model": MODEL, "input": "x", "encoding_format": "int8"}, 400, "invalid_request"),
    ],
)
def test_bad_requests_get_openai_errors(
    sdk: openai.OpenAI, body: dict[str, Any], status: int, code: str
) -> None:
    with pytest.raises(openai.APIStatusError) as raised:
        sdk.embeddings.create(**body)
    assert raised.value.status_code == status
    error = raised.value.body
    assert isinstance(error, dict) and error["code"] == code  # the SDK unwraps "error"
    assert error["type"] == "invalid_request_error" and error["message"]
    assert len(error["message"]) < 300  # never echoes a large input back


@pytest.mark.parametrize(
    "body",
    [
        '{"input": "x"}',  # no model: a bad request, not an unknown model (404)
        '{"model": "' + MODEL + '", "input": "\\ud800x"}',  # a lone surrogate
        '{"model": "' + MODEL + '", "input": "x", "user": 1e999}',  # past float's range
    ],
)
def test_bodies_the_sdk_cannot_send_are_400(api: ApiServer, body: str) -> None:
    response = httpx.post(
        f"{api.url}/v1/embeddings",
        content=body,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        timeout=10,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_request"


def test_a_wrong_key_is_an_authentication_error(api: ApiServer) -> None:
    bad = openai.OpenAI(base_url=f"{api.url}/v1", api_key="sk-wrong", max_retries=0)
    with bad, pytest.raises(openai.AuthenticationError) as raised:
        bad.models.list()
    assert raised.value.status_code == 401


def test_no_worker_is_a_503_with_retry_after(api: ApiServer) -> None:
    # The type is known (published at deploy) but no worker serves interactive work.
    response = httpx.post(
        f"{api.url}/v1/embeddings",
        json={"model": MODEL, "input": ["a", "b"]},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=10,
    )
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["code"] == "no_workers"


def test_a_refusal_leaves_no_task_behind(
    redis_url: str, known_embed: None, r: redis.Redis, api_factory: Callable[..., ApiServer]
) -> None:
    # Room for 2 of 3 inputs (one task already queued): the whole request is refused
    # and the 2 accepted tasks are canceled, so nothing runs that nobody will read.
    classes = {"interactive": ClassConfig(max_queued=3, reject_without_workers=False)}
    api = api_factory(make_settings(redis_url, classes=classes, default_class="interactive"))
    queued = httpx.post(f"{api.url}/tasks", json={"type": "echo"}, timeout=10)
    assert queued.status_code == 202, queued.text
    url, body = f"{api.url}/v1/embeddings", {"model": MODEL, "input": ["a", "b", "c"]}
    response = httpx.post(url, json=body, timeout=10)
    assert response.status_code == 503 and response.json()["error"]["code"] == "queue_full"
    assert r.lrange("rq:queue:interactive", 0, -1) == [queued.json()["id"].encode()]
    # More inputs than the class ever queues: no retry could fit them, so no 503; the
    # OpenAPI document says so, for client generators and schemathesis.
    never = httpx.post(url, json={**body, "input": ["a"] * 4}, timeout=10)
    assert never.status_code == 400, never.text
    assert never.json()["error"]["code"] == "invalid_request" and "retry-after" not in never.headers
    spec = httpx.get(f"{api.url}/openapi.json", timeout=10).json()
    schema = spec["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]
    [array] = [b for b in schema["application/json"]["schema"]["properties"]["input"]["oneOf"]
               if b.get("type") == "array"]  # fmt: skip
    assert array["maxItems"] == 3


def test_a_client_that_leaves_cancels_its_tasks(
    redis_url: str, known_embed: None, r: redis.Redis, api_factory: Callable[..., ApiServer]
) -> None:
    """No worker serves the class: the tasks stay queued until the client hangs up,
    and then nobody would read them."""
    api = api_factory(make_settings(redis_url, openai_class="batch"))
    body = json.dumps({"model": MODEL, "input": ["a", "b", "c"]}).encode()
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: gpulane\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", api.port), timeout=10) as sock:
        sock.sendall(head + body)
        # The three inputs travel together: one chunk of three items.
        wait_for(lambda: r.get("gpulane:extra:batch") == b"2", 10, what="the 3 items queued")
        # Read while the client is still there: once it leaves, the cancel may empty
        # the queue before any read after the block.
        ids = [i.decode() for i in r.lrange("rq:queue:batch", 0, -1)]
        assert len(ids) == 1 and r.hget(f"rq:job:{ids[0]}", "items") == b"3"
    wait_for(
        lambda: all(r.hget(f"rq:job:{i}", "status") == b"canceled" for i in ids),
        10,
        what="the tasks of a client that left to be canceled",
    )
    assert r.llen("rq:queue:batch") == 0
    assert int(r.get("gpulane:extra:batch") or 0) == 0


def test_a_key_without_the_class_is_refused(
    redis_url: str, known_embed: None, r: redis.Redis, api_factory: Callable[..., ApiServer]
) -> None:
    batch_only = tenant("bulk", KEY, classes=["batch"])
    api = api_factory(make_settings(redis_url, tenants=[batch_only]))
    client = openai.OpenAI(base_url=f"{api.url}/v1", api_key=KEY, max_retries=0)
    with client, pytest.raises(openai.PermissionDeniedError) as raised:
        client.embeddings.create(model=MODEL, input="x")
    assert raised.value.status_code == 403
    assert r.llen("rq:queue:interactive") == 0


def test_a_model_type_of_ones_own_gets_texts_and_gives_numbers(
    api: ApiServer, sdk: openai.OpenAI, start_worker: WorkerFactory
) -> None:
    """A type that ignores the request's ``encoding_format`` (``ctx``) gives JSON
    numbers: they reach a float client as they are and a base64 client packed. A
    result without a vector is a 502 naming the input, not a 500."""
    start_worker("vectors-w", extra=["--tasks", "gl_vector_tasks"])
    texts = ["a", "bbb"]
    packed = sdk.embeddings.create(model=VECTORS, input=texts)  # the SDK asks for base64
    floats = sdk.embeddings.create(model=VECTORS, input=texts, encoding_format="float")
    assert [d.embedding for d in floats.data] == [vector(t) for t in texts]
    assert [d.embedding for d in packed.data] == [vector(t) for t in texts]
    assert floats.usage.prompt_tokens == 2
    raw = httpx.post(  # the SDK decodes a list it got back too: read the wire
        f"{api.url}/v1/embeddings",
        json={"model": VECTORS, "input": "bbb", "encoding_format": "base64"},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ).json()
    assert raw["data"][0]["embedding"] == base64.b64encode(struct.pack("<3f", 3, 0, 0.5)).decode()
    with pytest.raises(openai.APIStatusError) as raised:
        sdk.embeddings.create(model=VECTORS, input=["a", NO_VECTOR], encoding_format="float")
    assert raised.value.status_code == 502
    error = raised.value.response.json()["error"]
    assert error["code"] == "invalid_result" and error["message"].startswith("input[1]:")
    for fmt in ("float", "base64"):  # either client is refused what float32 cannot hold
        with pytest.raises(openai.APIStatusError) as raised:
            sdk.embeddings.create(model=VECTORS, input=["a", PAST_FLOAT32], encoding_format=fmt)  # type: ignore[arg-type]
        assert raised.value.status_code == 502


def test_a_request_is_packed_longest_first_and_answered_in_input_order(
    api: ApiServer, sdk: openai.OpenAI, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    """A model pads a batch to its longest input: the inputs of a request that fills
    several chunks are packed longest first, so each chunk holds like lengths, and the
    answer still gives each input its own vector at its own index."""
    start_worker("vectors-w", extra=["--tasks", "gl_vector_tasks"])
    lengths = [3, 17, 1, 9, 20, 5, 12, 2, 14, 8, 19, 6, 11, 4, 16, 7, 10, 15, 18, 13]
    texts = ["x" * n for n in lengths]  # 20 inputs: chunks of 8, 8 and 4
    answer = sdk.embeddings.create(model=VECTORS, input=texts, encoding_format="float")
    assert [d.index for d in answer.data] == list(range(len(texts)))
    assert [d.embedding for d in answer.data] == [vector(t) for t in texts]
    chunks = []
    for key in r.scan_iter(keys.job("*")):
        if r.hget(key, "items"):
            call = decode_call(r.hget(key, "data") or b"")
            chunks.append([len(item["text"]) for item in call.items or []])
    assert sorted(map(len, chunks)) == [4, 8, 8]
    packed = [n for chunk in sorted(chunks, key=max, reverse=True) for n in chunk]
    assert packed == sorted(lengths, reverse=True)


def test_records_an_answer_was_read_from_are_let_go_sooner(
    redis_url: str,
    known_embed: None,
    api_factory: Callable[..., ApiServer],
    r: redis.Redis,
    start_worker: WorkerFactory,
) -> None:
    """Nobody reads a chunk's record again once its call answered 200: after the answer
    went, it is kept ``openai_result_ttl_s``, not ``result_ttl_s``. A call that failed
    keeps its records the whole ``result_ttl_s``, for whoever looks into it."""
    settings = make_settings(
        redis_url, tenants=[tenant("acme", KEY, admin=True)], openai_result_ttl_s=120
    )
    api = api_factory(settings)
    start_worker("vectors-w", extra=["--tasks", "gl_vector_tasks"])
    client = openai.OpenAI(base_url=f"{api.url}/v1", api_key=KEY, max_retries=0, timeout=60)

    def records() -> set[bytes]:
        return set(r.scan_iter(keys.job("*")))

    with client:
        with pytest.raises(openai.APIStatusError) as raised:  # first: nothing after it
            client.embeddings.create(model=VECTORS, input=["a", NO_VECTOR])
        assert raised.value.status_code == 502
        failed = records()
        answered = client.embeddings.create(model=VECTORS, input=["x" * n for n in range(1, 21)])
        assert len(answered.data) == 20
    kept = records() - failed
    assert len(failed) == 1 and len(kept) == 3  # one chunk; then chunks of 8, 8 and 4
    # Shortened once the answer has gone (a background task of the response).
    wait_for(lambda: all(0 < r.ttl(k) <= 120 for k in kept), 10, "the records let go")
    assert all(r.ttl(k) > settings.result_ttl_s - 60 for k in failed)
