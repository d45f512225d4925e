"""What is accepted can be read back; what cannot is refused at admission with a clear
422 that never echoes a huge value; Idempotency-Key replays only the same request;
405 says what is allowed; HEAD works on GET routes; uploads are bounded per class."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
import redis
from conftest import make_settings, wait_status

from dispatcher.contract import keys
from testkit import ApiServer


def _refused(response: httpx.Response, code: str = "invalid_request") -> dict:
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error"] == code
    return body


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "body",
    [
        '{"type": "echo", "args": {"x": NaN}}',
        '{"type": "echo", "args": {"x": [1, -Infinity]}}',
        '{"type": "echo", "args": {"x": 1e999}}',  # past float's range: an infinity
        '{"type": "echo", "args": {"x": -1.5e400}}',
        '{"type": "sleep", "args": {"seconds": NaN}}',
        '{"type": "echo", "args": {"x": "\\ud800"}}',
        '{"type": "echo", "args": {"\\udfff": 1}}',
        '{"type": "ech\\ud800o"}',
        '{"type": "echo", "timeout_s": 1' + "0" * 4000 + "}",
        '{"type": "echo", "timeout_s": -1' + "0" * 4000 + "}",
    ],
)
def test_values_that_cannot_round_trip_are_422(
    http: httpx.Client, known_types: None, body: str
) -> None:
    response = http.post("/tasks", content=body, headers={"Content-Type": "application/json"})
    _refused(response)
    assert len(response.content) < 2000


def test_nesting_limit_and_readable_back(http: httpx.Client, known_types: None) -> None:
    _refused(http.post("/tasks", json={"type": "echo", "args": {"x": _nested(255)}}))
    ok = http.post("/tasks", json={"type": "echo", "args": {"x": _nested(20), "n": 10**40}})
    assert ok.status_code == 202, ok.text
    record = http.get(f"/tasks/{ok.json()['id']}")
    assert record.status_code == 200


def test_empty_file_refused(http: httpx.Client, known_types: None) -> None:
    response = http.post("/tasks", files={"file": ("a.pdf", b"", "application/pdf")})
    assert "empty" in _refused(response)["message"]


def test_422_never_echoes_a_huge_value(http: httpx.Client, known_types: None) -> None:
    huge = "x" * 500_000
    for body in (
        {"type": "sleep", "args": {"seconds": huge}},
        {"type": "echo", huge: 1},
    ):
        response = http.post("/tasks", json=body)
        assert response.status_code == 422, response.text[:200]
        assert len(response.content) < 5000


def test_idempotency_key_replays_only_the_same_request(
    http: httpx.Client, known_types: None
) -> None:
    headers = {"Idempotency-Key": "k-1"}
    first = http.post("/tasks", json={"type": "echo", "args": {"a": 1}}, headers=headers)
    assert first.status_code == 202
    again = http.post("/tasks", json={"type": "echo", "args": {"a": 1}}, headers=headers)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    other = http.post("/tasks", json={"type": "echo", "args": {"a": 2}}, headers=headers)
    assert first.json()["id"] in _refused(other, "idempotency_key_reused")["message"]
    longer = http.post(
        "/tasks", json={"type": "echo", "args": {"a": 1}, "timeout_s": 5}, headers=headers
    )
    _refused(longer, "idempotency_key_reused")


def test_405_carries_allow_and_head_works(http: httpx.Client) -> None:
    response = http.put("/health")
    assert response.status_code == 405
    assert response.json()["error"] == "method_not_allowed"
    assert set(response.headers["Allow"].split(", ")) == {"GET", "HEAD"}
    assert http.patch("/tasks").headers["Allow"] == "POST"
    head = http.head("/health")
    assert head.status_code == 200
    assert head.content == b""
    assert int(head.headers["content-length"]) > 0
    assert http.head("/queues").status_code == 200


def test_max_queued_bytes_refuses_then_frees(
    redis_url: str, r: redis.Redis, api_factory: Callable[..., ApiServer], known_types: None
) -> None:
    classes = {"batch": {"max_queued_bytes": 6000}}
    api = api_factory(make_settings(redis_url, classes=classes, default_class="batch"))
    upload = {"file": ("a.pdf", b"%PDF" + b"x" * 3000, "application/pdf")}
    with httpx.Client(base_url=api.url, timeout=10) as http:
        first = http.post("/tasks", files=upload)
        assert first.status_code == 202, first.text
        held = int(r.get(keys.queued_bytes("batch")) or 0)
        assert held == 3004
        full = http.post("/tasks", files=upload)
        assert full.status_code == 503
        assert full.json()["error"] == "queue_full"
        assert "max_queued_bytes" in full.json()["message"]
        assert "Retry-After" in full.headers
        assert int(r.get(keys.queued_bytes("batch")) or 0) == held  # nothing counted
        assert http.delete(f"/tasks/{first.json()['id']}").status_code == 200
        assert r.get(keys.queued_bytes("batch")) == b"0"
        assert http.post("/tasks", files=upload).status_code == 202


@pytest.mark.parametrize("data", [b"\x89PNG\r\n\x1a\n\xff", "héllo".encode()])
def test_file_part_without_a_name_keeps_its_bytes(
    http: httpx.Client, r: redis.Redis, known_types: None, data: bytes
) -> None:
    boundary = "b0undary"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"\r\n\r\n'.encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    response = http.post(
        "/tasks",
        content=body,
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    assert response.status_code == 202, response.text
    assert r.get(keys.file(response.json()["id"])) == data


def test_upload_bytes_released_when_a_worker_ends_the_task(
    http: httpx.Client, r: redis.Redis, known_types: None, start_worker: Callable[..., object]
) -> None:
    start_worker()
    upload = {"file": ("a.pdf", b"not a pdf", "application/pdf")}
    task = http.post("/tasks", files=upload)
    assert task.status_code == 202
    record = wait_status(http, task.json()["id"], {"succeeded", "failed"})
    assert record["error"]["code"] == "invalid_document"
    assert r.get(keys.queued_bytes("batch")) == b"0"
    assert r.hget(keys.job(task.json()["id"]), "bytes") == b"0"


def test_deep_result_reads_back(http: httpx.Client, r: redis.Redis, known_types: None) -> None:
    """A handler may return deeper JSON than a client may send: still readable."""
    task_id = http.post("/tasks", json={"type": "echo"}).json()["id"]
    deep = "[" * 900 + "]" * 900
    r.hset(keys.job(task_id), mapping={"status": "finished", "result": deep})
    response = http.get(f"/tasks/{task_id}")
    assert response.status_code == 200, response.text[:300]
    assert response.json()["result"] is not None


def test_a_script_error_is_a_logged_503_not_a_500(
    http: httpx.Client, r: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    r.set(keys.job("wrongtype"), "not a hash")  # get.lua's HMGET fails: WRONGTYPE
    response = http.get("/tasks/wrongtype")
    assert response.status_code == 503
    assert response.json()["error"] == "store_unavailable"
    assert "Retry-After" in response.headers
    assert [rec for rec in caplog.records if rec.exc_info and "a bug" in rec.getMessage()]
