"""Bad input gets a clear JSON answer, never a traceback or a bare 500."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable

import httpx
import pytest
import redis
from conftest import make_settings
from support.catalog import publish_builtin_catalog
from support.pdf import make_pdf

from testkit import ApiServer, RedisServer, wait_for

BACKPRESSURE = ("gpulane-queue-depth", "gpulane-estimated-wait", "gpulane-pressure")


def _error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"] == code
    assert isinstance(body["message"], str) and body["message"]
    if response.request.method == "POST" and response.request.url.path == "/tasks":
        for header in BACKPRESSURE:
            assert header in response.headers, header
    return body


def test_unknown_task_type_lists_known(http: httpx.Client, known_types: None) -> None:
    body = _error(http.post("/tasks", json={"type": "resize"}), 422, "unknown_task_type")
    assert {"echo", "sleep", "document.extract"} <= set(body["known"])
    assert "resize" in body["message"]


def test_unknown_class_lists_known(http: httpx.Client, known_types: None) -> None:
    body = _error(
        http.post("/tasks", json={"type": "echo", "class": "urgent"}), 422, "unknown_class"
    )
    assert body["known"] == ["interactive", "batch"]


def test_args_that_fail_the_model(http: httpx.Client, known_types: None) -> None:
    body = _error(
        http.post("/tasks", json={"type": "sleep", "args": {"seconds": -1}}), 422, "invalid_request"
    )
    assert "seconds" in body["message"]
    body = _error(
        http.post("/tasks", json={"type": "sleep", "args": {"minutes": 1}}), 422, "invalid_request"
    )
    assert "minutes" in body["message"]
    _error(http.post("/tasks", json={"type": "sleep", "args": [1]}), 422, "invalid_request")


def test_malformed_json(http: httpx.Client, known_types: None) -> None:
    headers = {"content-type": "application/json"}
    body = _error(
        http.post("/tasks", content=b'{"type": "echo"', headers=headers), 400, "invalid_request"
    )
    assert "JSON" in body["message"]
    # An array is a bulk submit: a task in it that is no object is a 422 naming it.
    bulk = _error(http.post("/tasks", content=b'["echo"]', headers=headers), 422, "invalid_request")
    assert bulk["index"] == 0 and bulk["message"].startswith("tasks[0]:")
    # Nesting deep enough to exhaust the parser's recursion: a 400, not a 500.
    nested = b'{"type": "echo", "args": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    _error(http.post("/tasks", content=nested, headers=headers), 400, "invalid_request")


def test_unknown_field_and_missing_type(http: httpx.Client, known_types: None) -> None:
    body = _error(http.post("/tasks", json={"type": "echo", "arg": {}}), 422, "invalid_request")
    assert "arg" in body["message"]
    _error(http.post("/tasks", json={"args": {}}), 422, "invalid_request")


def test_unsupported_content_type(http: httpx.Client, known_types: None) -> None:
    response = http.post("/tasks", content=b"type=echo", headers={"content-type": "text/plain"})
    _error(response, 400, "invalid_request")


def test_non_json_args_form_field(http: httpx.Client, known_types: None) -> None:
    response = http.post(
        "/tasks",
        files={"file": ("a.pdf", make_pdf(["x"]), "application/pdf")},
        data={"args": "{oops"},
    )
    body = _error(response, 422, "invalid_request")
    assert "args" in body["message"]


def test_multipart_parts_given_twice_or_not_finite_are_422(
    http: httpx.Client, known_types: None
) -> None:
    pdf = ("a.pdf", make_pdf(["x"]), "application/pdf")
    twice = http.post(
        "/tasks",
        files=[("file", pdf), ("args", (None, '{"a": 1}')), ("args", (None, '{"a": 2}'))],
    )
    assert twice.status_code == 422 and "given twice" in twice.json()["message"]
    files = http.post("/tasks", files=[("file", pdf), ("file", pdf)])
    assert files.status_code in (400, 422)  # more than one file: never a silent pick
    for text in ("nan", "inf", "1e999"):
        odd = http.post("/tasks", files={"file": pdf}, data={"timeout_s": text})
        assert odd.status_code == 422, (text, odd.text)


def test_file_rules_per_task_type(http: httpx.Client, known_types: None) -> None:
    _error(http.post("/tasks", json={"type": "document.extract"}), 422, "invalid_request")
    response = http.post(
        "/tasks", files={"file": ("a.pdf", b"%PDF", "application/pdf")}, data={"type": "echo"}
    )
    _error(response, 422, "invalid_request")


@pytest.mark.parametrize("timeout_s", [0, -5, 10**9, "soon"])
def test_timeout_out_of_range(http: httpx.Client, known_types: None, timeout_s: object) -> None:
    _error(
        http.post("/tasks", json={"type": "echo", "timeout_s": timeout_s}), 422, "invalid_request"
    )


def test_idempotency_key_too_long(http: httpx.Client, known_types: None) -> None:
    response = http.post("/tasks", json={"type": "echo"}, headers={"Idempotency-Key": "k" * 300})
    _error(response, 422, "invalid_request")


def test_json_body_over_limit(
    redis_url: str, r: redis.Redis, api_factory: Callable[..., ApiServer]
) -> None:
    publish_builtin_catalog(r)
    api = api_factory(make_settings(redis_url, max_body_bytes=4096))
    with httpx.Client(base_url=api.url) as http:
        response = http.post("/tasks", json={"type": "echo", "args": {"blob": "x" * 10_000}})
        body = _error(response, 413, "payload_too_large")
        assert body["limit_bytes"] == 4096


def test_declared_body_over_limit_is_refused_before_it_is_sent(
    redis_url: str, r: redis.Redis, api_factory: Callable[..., ApiServer]
) -> None:
    """A client announcing 1 GB gets 413 at once: the server never waits for the body."""
    publish_builtin_catalog(r)
    api = api_factory(make_settings(redis_url, max_body_bytes=4096))
    with socket.create_connection(("127.0.0.1", api.port), timeout=5) as sock:
        sock.sendall(
            b"POST /tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n"
        )
        reply = sock.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 413"), reply
    assert "payload_too_large" in reply


def test_streamed_body_over_limit_is_cut_off(
    redis_url: str, r: redis.Redis, api_factory: Callable[..., ApiServer]
) -> None:
    """Chunked upload with no Content-Length: refused once it passes the limit."""
    publish_builtin_catalog(r)
    api = api_factory(make_settings(redis_url, max_body_bytes=4096, max_file_bytes=4096))
    sent = 0

    def chunks():
        nonlocal sent
        for _ in range(2000):  # 2000 x 8 KiB = 16 MiB if nobody stops us
            sent += 8192
            yield b"x" * 8192

    with httpx.Client(base_url=api.url) as http:
        try:
            response = http.post(
                "/tasks", content=chunks(), headers={"content-type": "application/json"}
            )
        except httpx.TransportError:
            return  # the server closed the connection mid-upload: also a refusal
    _error(response, 413, "payload_too_large")


def test_file_over_limit(
    redis_url: str, r: redis.Redis, api_factory: Callable[..., ApiServer]
) -> None:
    publish_builtin_catalog(r)
    api = api_factory(make_settings(redis_url, max_file_bytes=2048))
    with httpx.Client(base_url=api.url) as http:
        response = http.post(
            "/tasks", files={"file": ("big.pdf", b"%PDF" + b"0" * 5000, "application/pdf")}
        )
    _error(response, 413, "payload_too_large")


def test_redis_down_is_503_store_unavailable(
    private_redis: RedisServer, api_factory: Callable[..., ApiServer]
) -> None:
    server = private_redis
    publish_builtin_catalog(server.client())
    api = api_factory(make_settings(server.url))
    with httpx.Client(base_url=api.url, timeout=10) as http:
        server.kill()
        for method, path, kwargs in (
            ("POST", "/tasks", {"json": {"type": "echo"}}),
            ("GET", "/tasks/some-id", {}),
            ("GET", "/queues", {}),
            ("GET", "/health", {}),
        ):
            response = http.request(method, path, **kwargs)
            assert response.status_code == 503, (path, response.text)
            assert response.json()["error"] == "store_unavailable"
            assert int(response.headers["retry-after"]) >= 1
        server.start()  # same port, same AOF: the API recovers by itself
        wait_for(lambda: http.get("/health").status_code == 200, 10, what="API recovery")
        accepted = http.post("/tasks", json={"type": "echo"})
        assert accepted.status_code == 202, accepted.text  # batch queues with no worker


@pytest.mark.parametrize(
    "head",
    [
        b"Content-Length: abc\r\n",
        b"Content-Length: -5\r\n",
        b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n",
    ],
)
def test_a_request_that_is_not_valid_http_gets_a_json_400(api: ApiServer, head: bytes) -> None:
    with socket.create_connection(("127.0.0.1", api.port), timeout=5) as sock:
        sock.sendall(b"POST /tasks HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n{}")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 400 Bad Request", answer
    assert b"content-type: application/json" in rest.lower()
    assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"] == "invalid_request"


def test_unknown_route_and_method(http: httpx.Client) -> None:
    _error(http.get("/nope"), 404, "not_found")
    _error(http.get("/tasks/"), 404, "not_found")  # no redirect to /tasks
    _error(http.post("/tasks/", json={"type": "echo"}), 404, "not_found")
    _error(http.put("/tasks/x"), 405, "method_not_allowed")
