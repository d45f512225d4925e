"""Logs an operator can read: a client that disconnects mid-upload is one short line,
identical warnings are rate-limited."""

from __future__ import annotations

import logging
import socket
from typing import Any

import httpx
import pytest

from dispatcher.contract.logs import RepeatFilter, TextFormatter
from testkit import ApiServer, wait_for

ABORTS = 50


def _record(message: str, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord("gpulane.api", level, __file__, 1, message, None, None)


def test_identical_warnings_are_rate_limited() -> None:
    repeats = RepeatFilter(window_s=60)
    passed = [repeats.filter(_record("redis is full")) for _ in range(100)]
    assert passed.count(True) == 1
    assert repeats.filter(_record("another warning"))
    assert all(repeats.filter(_record("task started", logging.INFO)) for _ in range(5))

    later = RepeatFilter(window_s=0)
    assert later.filter(_record("x")) and later.filter(record := _record("x"))
    assert not hasattr(record, "repeated")  # nothing was held back


def test_held_back_count_is_reported() -> None:
    repeats = RepeatFilter(window_s=60)
    for _ in range(5):
        repeats.filter(_record("redis is full"))
    repeats._seen[("gpulane.api", logging.WARNING, "redis is full")] = (-1e9, 4)
    record = _record("redis is full")
    assert repeats.filter(record)
    assert record.repeated == 4  # type: ignore[attr-defined]
    assert "repeated=4" in TextFormatter().format(record)


def _abort(port: int, i: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        if i % 2:
            head = (
                "POST /tasks HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; "
                "boundary=b\r\nContent-Length: 100000\r\n\r\n"
                '--b\r\nContent-Disposition: form-data; name="file"; filename="a.pdf"\r\n\r\n'
            )
        else:
            head = (
                "POST /tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                'Content-Length: 100000\r\n\r\n{"type": "echo", "args": {"x": "'
            )
        sock.sendall(head.encode() + b"x" * 2000)


def test_aborted_uploads_log_a_line_each_without_tracebacks(
    api: ApiServer, known_types: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    for i in range(ABORTS):
        _abort(api.port, i)
    # One more request answered: every abort before it has been handled or dropped.
    with socket.create_connection(("127.0.0.1", api.port), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 200")
    wait_for(
        lambda: sum("client disconnected" in r.getMessage() for r in caplog.records) == ABORTS,
        10,
        what="one line per aborted upload",
    )
    formatter = TextFormatter()
    lines = sum(formatter.format(r).count("\n") + 1 for r in caplog.records)
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert lines <= 2 * ABORTS + 5, lines
    assert all(r.levelno < logging.ERROR for r in caplog.records)


def test_unexpected_error_is_one_500_and_one_traceback(
    api: ApiServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*_: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(api.server.config.app.state.services.store, "get", broken)
    caplog.set_level(logging.INFO)
    response = httpx.get(f"{api.url}/tasks/abc", timeout=5)
    assert response.status_code == 500
    assert response.json()["error"] == "internal_error"
    assert "a bug" not in response.text
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1, [r.getMessage() for r in caplog.records]
    assert "GET /tasks/abc" in tracebacks[0].getMessage()


def _claimed(task_id: str) -> Any:
    from worker.claims import Claimed

    return Claimed(task_id, "batch", b"", 1, 30.0, None, 0, None)


def test_a_task_alone_logs_its_own_lines_at_info(caplog: pytest.LogCaptureFixture) -> None:
    from worker import tasklog

    caplog.set_level(logging.INFO, "gpulane.worker")
    tasklog.batch_started("w", [_claimed("t1")], "echo", batched=False)
    tasklog.ended("w", [tasklog.Ended(_claimed("t1"), "echo", "succeeded", 0.25)])
    lines = [(r.levelno, r.getMessage(), getattr(r, "task", None)) for r in caplog.records]
    assert lines == [
        (logging.INFO, "task started", "t1"),
        (logging.INFO, "task succeeded", "t1"),
    ]
    assert caplog.records[1].elapsed_s == 0.25  # type: ignore[attr-defined]


def test_a_batch_of_records_logs_one_line_each_way_naming_every_task(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Per record at DEBUG, but a record that did not succeed stays at INFO."""
    from worker import tasklog

    caplog.set_level(logging.DEBUG, "gpulane.worker")
    claims = [_claimed(f"t{k}") for k in range(3)]
    tasklog.batch_started("w", claims, "embed", batched=True)
    tasklog.ended(
        "w",
        [
            tasklog.Ended(claims[0], "embed", "succeeded", 0.1),
            tasklog.Ended(claims[1], "embed", "failed", 0.1, "invalid_args"),
            tasklog.Ended(claims[2], "embed", "succeeded", 0.2),
        ],
    )
    info = [r for r in caplog.records if r.levelno == logging.INFO]
    assert [r.getMessage() for r in info] == [
        "batch of 3 items (3 records) started",
        "task failed",
        "batch of 3 records ended: 1 failed, 2 succeeded",
    ]
    assert info[0].tasks == info[2].tasks == "t0,t1,t2"  # type: ignore[attr-defined]
    assert info[1].task == "t1" and info[1].error == "invalid_args"  # type: ignore[attr-defined]
    assert info[2].elapsed_s == 0.2  # type: ignore[attr-defined]
    debug = [(r.getMessage(), r.task) for r in caplog.records if r.levelno == logging.DEBUG]  # type: ignore[attr-defined]
    assert debug == [
        ("task started", "t0"),
        ("task started", "t1"),
        ("task started", "t2"),
        ("task succeeded", "t0"),
        ("task succeeded", "t2"),
    ]
