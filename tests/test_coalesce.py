"""Coalesced script calls: batched under concurrency, reloaded after NOSCRIPT, failures
delivered to every caller."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
from conftest import make_settings
from redis.asyncio.connection import Connection as AsyncConnection
from redis.exceptions import ConnectionError as RedisConnectionError

from dispatcher.api.coalesce import Coalescer
from dispatcher.contract.connect import async_client

ECHO = "return ARGV[1]"


def test_concurrent_calls_share_pipelines(redis_url: str) -> None:
    async def run() -> tuple[list[bytes], int]:
        client = aioredis.Redis.from_url(redis_url)
        coalescer = Coalescer(client, ECHO)
        sent: list[int] = []
        execute = coalescer._execute

        async def counting(calls: list, load: bool = False) -> list:  # type: ignore[type-arg]
            sent.append(len(calls))
            return await execute(calls, load)

        coalescer._execute = counting  # type: ignore[method-assign]
        replies = await asyncio.gather(*(coalescer.call(str(i)) for i in range(100)))
        await client.aclose()
        return replies, len(sent)

    replies, pipelines = asyncio.run(run())
    assert replies == [str(i).encode() for i in range(100)]  # each caller gets its own reply
    assert pipelines < 10  # 100 overlapping calls, a handful of round trips


def test_reloads_after_the_script_cache_is_flushed(redis_url: str) -> None:
    async def run() -> list[bytes]:
        client = aioredis.Redis.from_url(redis_url)
        coalescer = Coalescer(client, ECHO)
        first = await coalescer.call("a")
        await client.script_flush()  # what a Redis restart does to loaded scripts
        second = await coalescer.call("b")
        await client.aclose()
        return [first, second]

    assert asyncio.run(run()) == [b"a", b"b"]


def test_connection_failure_reaches_every_caller() -> None:
    async def run() -> list[BaseException | bytes]:
        client = aioredis.Redis(port=1, socket_connect_timeout=0.5)  # nothing listens
        coalescer = Coalescer(client, ECHO)
        out = await asyncio.gather(*(coalescer.call("x") for _ in range(5)), return_exceptions=True)
        await client.aclose()
        return out

    results = asyncio.run(run())
    assert all(isinstance(r, RedisConnectionError) for r in results), results


def test_script_errors_stay_with_their_call(redis_url: str) -> None:
    async def run() -> list[BaseException | bytes]:
        client = aioredis.Redis.from_url(redis_url)
        coalescer = Coalescer(client, "if ARGV[1] == 'bad' then error('nope') end return ARGV[1]")
        out = await asyncio.gather(
            coalescer.call("ok"), coalescer.call("bad"), coalescer.call("fine"),
            return_exceptions=True,
        )  # fmt: skip
        await client.aclose()
        return out

    ok, bad, fine = asyncio.run(run())
    assert ok == b"ok" and fine == b"fine"
    with pytest.raises(Exception, match="nope"):
        raise bad  # type: ignore[misc]


def test_a_reply_lost_after_the_script_ran_is_not_sent_again(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reset that takes a submit's reply after submit.lua ran must not run it again
    (the same ids queued twice, the class's counters doubled): on the client the API
    builds, the caller gets the error (the API answers 503, the client retries with its
    Idempotency-Key)."""
    read = AsyncConnection.read_response
    lost: list[Any] = []

    async def reply_lost(self: AsyncConnection, *args: Any, **kwargs: Any) -> Any:
        reply = await read(self, *args, **kwargs)
        if reply == 1 and not lost:  # INCR's first reply: it ran, the reply is lost
            lost.append(reply)
            raise RedisConnectionError("Connection reset by peer")
        return reply

    async def run() -> tuple[BaseException | Any, Any]:
        client = async_client(make_settings(redis_url), socket_timeout=5, connect_timeout=3)
        coalescer = Coalescer(client, "return redis.call('INCR', 'runs')")
        monkeypatch.setattr(AsyncConnection, "read_response", reply_lost)
        try:
            first = await coalescer.call()
        except RedisConnectionError as exc:
            first = exc
        monkeypatch.undo()
        runs = await client.get("runs")
        await client.aclose()
        return first, runs

    first, runs = asyncio.run(run())
    assert isinstance(first, RedisConnectionError), first
    assert runs == b"1"  # ran once


def test_the_sha_is_the_one_redis_gives_the_script(redis_url: str) -> None:
    """The script goes by a sha computed here (SCRIPT LOAD rides with the first calls
    instead of a round trip of its own): it must be Redis' own."""
    source = "return {ARGV[1], 'é'}"  # not ASCII: hashed as the bytes Redis receives

    async def run() -> tuple[str, str, Any]:
        client = aioredis.Redis.from_url(redis_url)
        coalescer = Coalescer(client, source)
        reply = await coalescer.call("x")
        loaded = str(await client.script_load(source))
        await client.aclose()
        return coalescer.sha, loaded, reply

    sha, loaded, reply = asyncio.run(run())
    assert sha == loaded
    assert reply == [b"x", "é".encode()]


def test_a_round_trip_canceled_under_way_cancels_its_callers() -> None:
    """The flushing task canceled mid-round-trip (the event loop closing): its batch's
    callers end canceled instead of waiting forever for an answer nobody will give."""

    async def run() -> bool:
        received = asyncio.Event()

        async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await reader.read(65536):  # takes the request, never answers
                received.set()

        server = await asyncio.start_server(mute, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = aioredis.Redis(port=port)
        coalescer = Coalescer(client, ECHO)
        call = asyncio.create_task(coalescer.call("x"))
        async with asyncio.timeout(10):
            await received.wait()  # the call is out, its reply awaited
        assert coalescer._flusher is not None
        coalescer._flusher.cancel()
        async with asyncio.timeout(10):
            outcome = await asyncio.gather(call, return_exceptions=True)
        server.close()
        await client.aclose()
        return isinstance(outcome[0], asyncio.CancelledError)

    assert asyncio.run(run())
