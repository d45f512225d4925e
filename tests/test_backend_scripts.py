"""The scripts and pieces behind backend workers, against the real Redis fixture: routing
by type in claim.lua and the typed doorbell, the fenced stream, the tpm bucket, and the
backend client's reading of what a server streams."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from dispatcher.api.generation import error_of
from dispatcher.api.store import Record, Submission, submit_options
from dispatcher.contract import keys
from dispatcher.contract.generation import Kind, estimate_tokens, type_of_model
from dispatcher.contract.jobs import encode_call
from dispatcher.contract.scripts import SyncScripts, options
from dispatcher.contract.settings import Settings
from worker.backend.client import BackendError, _event
from worker.backend.relay import _has_text
from worker.backend.stream import StreamAppends
from worker.broker import Broker
from worker.state import WorkerState

MODEL_TYPE = type_of_model("some/model:7b")


def _submit(s: SyncScripts, settings: Settings, task_type: str, routed: bool, tpm: int = 0) -> str:
    sub = Submission(task_type, "batch", {}, 60, "t", routed=routed)
    record = Record(task_type, encode_call(task_type, {}), 60, routed=routed, tpm=tpm)
    opts = submit_options(sub, settings.classes["batch"], 1, 1.0, settings, records=[record])
    reply = s.run("submit", opts, record.data, "")
    assert reply[0] == b"accepted", reply
    return record.task_id


def _worker(r: redis.Redis, settings: Settings, name: str, types: list[str] | None) -> Broker:
    broker = Broker(r, settings, name, ["batch"], types=types)
    state = WorkerState(name, None, ["batch"], types or [])
    state.parks = types or []
    assert broker.register(state.info(), {}) is not None
    return broker


def test_routed_tasks_go_only_to_the_workers_that_serve_their_type(
    r: redis.Redis, settings: Settings
) -> None:
    s = SyncScripts(r)
    in_process = _worker(r, settings, "w-plain", None)
    backend = _worker(r, settings, "w-backend", [MODEL_TYPE])
    other_model = _worker(r, settings, "w-other", [type_of_model("another")])
    generation = _submit(s, settings, MODEL_TYPE, routed=True)
    echo = _submit(s, settings, "echo", routed=False)
    assert other_model.claim(True, "{}") == []  # neither is its type: it parks
    assert [c.task_id for c in in_process.claim(True, "{}")] == [echo]  # past the routed head
    claimed = backend.claim(True, "{}")
    assert [c.task_id for c in claimed] == [generation]
    assert claimed[0].tenant == "t"
    # Parked in its type's idle set, a routed submit rings it (and nobody else).
    assert backend.claim(False, "{}") == []
    assert r.zscore(keys.parked_type("batch", MODEL_TYPE), "w-backend") is not None
    assert r.zscore(keys.parked("batch"), "w-backend") is None
    _submit(s, settings, MODEL_TYPE, routed=True)
    assert r.llen(keys.wake("w-backend")) == 1
    assert r.llen(keys.wake("w-other")) == 0
    backend.unpark()
    assert r.zscore(keys.parked_type("batch", MODEL_TYPE), "w-backend") is None


def test_the_reaper_takes_a_dead_backend_worker_out_of_its_types_idle_sets(
    r: redis.Redis, settings: Settings
) -> None:
    backend = _worker(r, settings, "w-gone", [MODEL_TYPE])
    assert backend.claim(True, "{}") == []
    assert r.zscore(keys.parked_type("batch", MODEL_TYPE), "w-gone") is not None
    backend.unregister()
    assert r.zscore(keys.parked_type("batch", MODEL_TYPE), "w-gone") is None


def test_stream_appends_only_from_the_current_attempt(r: redis.Redis, settings: Settings) -> None:
    s = SyncScripts(r)
    backend = _worker(r, settings, "w-stream", [MODEL_TYPE])
    _submit(s, settings, MODEL_TYPE, routed=True)
    (claimed,) = backend.claim(True, "{}")

    async def append(entries: list[tuple[str, bytes]]) -> bool:
        # As the backend worker writes: stream.lua on its asyncio client.
        client = aioredis.Redis.from_url(settings.redis_url_or_default)
        try:
            return await StreamAppends(client, backend).append(claimed, entries)
        finally:
            await client.aclose()

    assert asyncio.run(append([("chunk", b'{"a":1}'), ("chunk", b'{"a":2}')]))
    assert [e[1][b"d"] for e in r.xrange(keys.stream(claimed.task_id))] == [b'{"a":1}', b'{"a":2}']
    assert r.pttl(keys.stream(claimed.task_id)) > 0
    r.hset(keys.job(claimed.task_id), "attempts", claimed.attempt + 1)  # a later attempt
    assert not asyncio.run(append([("chunk", b'{"a":3}')]))
    assert r.xlen(keys.stream(claimed.task_id)) == 2


def test_tpm_bucket_takes_gives_and_settles(r: redis.Redis, settings: Settings) -> None:
    s = SyncScripts(r)

    def take(n: int) -> list[int]:
        return [int(x) for x in s.run("tokens", options(op="take", tenant="t", tpm=1000, n=n))]

    assert take(700) == [1, 300]
    allowed, wait_ms = take(500)
    assert allowed == 0 and 0 < wait_ms <= 60_000  # until 200 more refilled (at 1000/min)
    s.run("tokens", options(op="give", tenant="t", n=100))
    assert float(r.hget(keys.tpm("t"), "tokens") or 0) >= 400
    # A task charged 300 that used 50 gives 250 back, once.
    task = _submit(s, settings, MODEL_TYPE, routed=True, tpm=300)
    before = float(r.hget(keys.tpm("t"), "tokens") or 0)
    assert int(s.run("tokens", options(op="settle", id=task, used=50))) == 250
    assert float(r.hget(keys.tpm("t"), "tokens") or 0) >= before + 250 - 1
    assert int(s.run("tokens", options(op="settle", id=task, used=50))) == 0
    # More than the whole budget still runs, alone, once the bucket is full.
    r.delete(keys.tpm("t"))
    assert take(5000)[0] == 1
    assert take(1)[0] == 0


def test_what_a_server_streams_is_read_strictly() -> None:
    chunk, raw = _event('data: {"choices": [{"delta": {"content": "hi"}}]}') or ({}, b"")
    assert raw == b'{"choices": [{"delta": {"content": "hi"}}]}' and _has_text(chunk)
    assert _event(": ping") is None and _event("") is None and _event("event: x") is None
    with pytest.raises(BackendError, match="not JSON"):
        _event("data: <html>")
    with pytest.raises(BackendError, match="not an object"):
        _event("data: [1, 2]")
    with pytest.raises(BackendError, match="mid-stream"):
        _event('data: {"error": {"message": "out of memory"}}')
    assert not _has_text({"choices": [{"delta": {"role": "assistant"}}]})
    assert not _has_text({"choices": [{"delta": {}, "finish_reason": "length"}]})
    assert _has_text({"choices": [{"delta": {"content": ""}}]})  # a partial character


def test_model_types_errors_and_estimates() -> None:
    assert MODEL_TYPE.startswith("backend.some_model_7b_") and len(MODEL_TYPE) == 30
    assert type_of_model("Some/Model:7B") != MODEL_TYPE  # same slug, another id
    assert estimate_tokens(Kind.CHAT, {"messages": [{"content": "x" * 40}]}) == 10
    assert estimate_tokens(Kind.COMPLETIONS, {"prompt": ["abcd", "efgh"]}) == 2
    refused = {"error": {"code": "backend_error", "message": "too long", "status": 400}}
    assert error_of(refused).status == 400
    assert error_of({"error": {"code": "backend_error", "status": 500}}).status == 502
    assert error_of({"error": {"code": "backend_error", "status": 429}}).status == 502
    assert error_of({"error": {"code": "timeout"}}).status == 504
    assert error_of(None).status == 503


def test_a_stream_cut_by_a_lost_worker_is_not_generated_again() -> None:
    """The task's next attempt finds the earlier attempt's chunks in its stream: it ends
    the stream with an error entry and fails, rather than append a second answer (the
    server is never called: its URL here answers nothing)."""
    import asyncio

    from dispatcher.contract.metrics import Recorder
    from worker.backend.client import Backend
    from worker.backend.relay import Relay
    from worker.backend.stream import StreamWriter
    from worker.claims import Claimed

    args = {"kind": "chat", "body": {"model": "m", "messages": []}, "stream": True}
    claimed = Claimed("t1", "batch", encode_call(MODEL_TYPE, args), 2, 30.0, None, 0, None)
    written: list[tuple[str, bytes]] = []

    async def append(entries: list[tuple[str, bytes]]) -> bool:
        written.extend(entries)
        return True

    async def run() -> Any:
        writer = StreamWriter(append, "t1", lambda: 3)
        relay = Relay(claimed, Backend("http://127.0.0.1:9", None), writer, Recorder(), "x")
        try:
            return await relay.run()
        finally:
            await writer.close()

    outcome = asyncio.run(run())
    assert outcome.status == "failed" and outcome.error["code"] == "worker_lost"
    assert [kind for kind, _ in written] == ["error"]
