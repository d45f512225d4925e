"""Results without polling, over real HTTP with real workers: ``Prefer: wait``,
``GET /tasks/<id>?wait=N``, the event stream, across API replicas, and what waiting
costs (one subscription per API process, nothing left after a client leaves)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from conftest import WorkerFactory, make_settings, submit
from support.catalog import tenant
from support.lua import claim, register
from support.lua import finish as finish_task
from support.lua import submit as submit_task

from dispatcher.api import waiters as waiters_module
from dispatcher.api.deps import Services
from dispatcher.api.store import TaskStore
from dispatcher.api.waiters import Waiters
from dispatcher.client import AsyncClient, Client
from dispatcher.contract import keys
from dispatcher.contract.scripts import SyncScripts
from dispatcher.contract.settings import Settings
from testkit import ApiServer, wait_for

ApiFactory = Callable[[Settings], ApiServer]


def waiters(api: ApiServer) -> Waiters:
    svc: Services = api.server.config.app.state.services  # type: ignore[attr-defined]
    return svc.waiters


def events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """The (event, data) pairs of a text/event-stream, until the server closes it."""
    out: list[tuple[str, dict[str, Any]]] = []
    kind = ""
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[len("event: ") :]
        elif line.startswith("data: "):
            out.append((kind, json.loads(line[len("data: ") :])))
    return out


def subscribers(r: redis.Redis) -> int:
    return int(dict(r.pubsub_numsub(keys.EVENTS))[keys.EVENTS.encode()])


def test_prefer_wait_answers_200_with_the_final_record(
    http: httpx.Client, start_worker: WorkerFactory
) -> None:
    start_worker()
    body = {"type": "echo", "class": "interactive", "args": {"x": 1}}
    headers = {"Prefer": "respond-async, wait=10", "Idempotency-Key": "k-1"}
    response = http.post("/tasks", json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["preference-applied"] == "wait=10"
    assert response.headers["location"] == f"/tasks/{response.json()['id']}"
    record = response.json()
    assert record["status"] == "succeeded" and record["result"] == {"x": 1}
    assert "gpulane-queue-depth" in response.headers

    replay = http.post("/tasks", json=body, headers=headers)  # idempotent replay, waits too
    assert replay.status_code == 200
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.headers["preference-applied"] == "wait=10"
    assert replay.json()["id"] == record["id"] and replay.json()["result"] == {"x": 1}

    for huge in ("3600", "99999999999999999999"):  # any delta-seconds is clamped
        clamped = http.post("/tasks", json=body, headers={"Prefer": f"wait={huge}"})
        assert clamped.status_code == 200 and clamped.headers["preference-applied"] == "wait=60"


def test_prefer_wait_answers_202_when_the_task_outlives_it(
    http: httpx.Client, start_worker: WorkerFactory
) -> None:
    start_worker()
    body = {"type": "test.poll_cancel", "class": "interactive", "args": {"seconds": 30}}
    response = http.post("/tasks", json=body, headers={"Prefer": "wait=1"})
    assert response.status_code == 202, response.text
    assert "preference-applied" not in response.headers
    assert set(response.json()) == {"id", "status", "type", "class", "position", "estimated_wait_s"}
    http.delete(f"/tasks/{response.json()['id']}")

    for garbage in ("wait=soon", "wait=-1", "wait", "wait=1.5e3"):  # malformed: ignored
        response = http.post("/tasks", json=body, headers={"Prefer": garbage})
        assert response.status_code == 202, garbage
        http.delete(f"/tasks/{response.json()['id']}")


def test_get_wait_returns_when_final_or_with_the_live_record(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory
) -> None:
    queued = submit(http, "echo", {"x": 2})  # batch, no worker yet: stays queued
    response = http.get(f"/tasks/{queued['id']}", params={"wait": "0.3"})
    assert response.status_code == 200 and response.json()["status"] == "queued"

    for bad in ("soon", "-1", "nan", "inf", "1" * 40):
        response = http.get(f"/tasks/{queued['id']}", params={"wait": bad})
        assert response.status_code == 400, bad
        assert response.json()["error"] == "invalid_request"
    assert http.get("/tasks/nope", params={"wait": "1"}).status_code == 404

    start_worker()
    task = submit(http, "sleep", {"seconds": 1}, cls="interactive")
    # Waits up to 60 s, but the client gives up after 10: the answer must come when the
    # task ends (its notification), not when the wait runs out.
    response = http.get(f"/tasks/{task['id']}", params={"wait": "60"}, timeout=10)
    assert response.status_code == 200
    assert response.json()["status"] == "succeeded"
    assert response.json()["result"]["slept_s"] >= 1


def test_event_stream_reports_each_change_and_ends_final(
    http: httpx.Client, start_worker: WorkerFactory
) -> None:
    start_worker()
    task = submit(http, "test.steps", {"steps": 3, "step_s": 0.4}, cls="interactive")
    with http.stream("GET", f"/tasks/{task['id']}/events", timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        seen = events(response)
    kinds = [kind for kind, _ in seen]
    assert kinds[0] == "status" and kinds[-1] == "final" and kinds.count("final") == 1
    assert seen[-1][1]["status"] == "succeeded" and seen[-1][1]["result"] == {"steps": 3}
    fractions = [data["progress"]["fraction"] for kind, data in seen if kind == "progress"]
    assert len(fractions) >= 2 and fractions == sorted(fractions), seen
    assert all(data["status"] in ("queued", "running") for kind, data in seen[:-1])
    assert all(data["id"] == task["id"] for _, data in seen)

    # A task already final: one final event, then the stream closes.
    with http.stream("GET", f"/tasks/{task['id']}/events", timeout=10) as response:
        assert [kind for kind, _ in events(response)] == ["final"]


def test_a_quiet_event_stream_keeps_alive_and_ends_after_events_max_s(
    known_types: None, redis_url: str, api_factory: ApiFactory
) -> None:
    api = api_factory(make_settings(redis_url, events_keepalive_s=0.2, events_max_s=1.0))
    with httpx.Client(base_url=api.url, timeout=10) as http:
        task = submit(http, "echo", {})  # batch, no worker: nothing changes
        with http.stream("GET", f"/tasks/{task['id']}/events") as response:
            lines = list(response.iter_lines())  # ends: the server closed the stream
    assert lines[0] == "retry: 1000"
    assert [line for line in lines if line.startswith("event: ")] == ["event: status"]
    assert lines.count(": keep-alive") >= 2
    assert waiters(api).count == 0


def test_waiting_keeps_tenants_apart(
    known_types: None, redis_url: str, api_factory: ApiFactory
) -> None:
    keys_ = {"acme": "acme-secret-key", "globex": "globex-secret-key"}
    settings = make_settings(redis_url, tenants=[tenant(n, k) for n, k in keys_.items()])
    api = api_factory(settings)
    acme = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {keys_['acme']}"})
    globex = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {keys_['globex']}"})
    with acme, globex:
        task_id = submit(acme, "echo", {"x": 1})["id"]
        for path, params in ((f"/tasks/{task_id}/events", {}), (f"/tasks/{task_id}", {"wait": 1})):
            response = globex.get(path, params=params)
            assert response.status_code == 404, path
            assert response.json()["error"] == "not_found"
        assert acme.get(f"/tasks/{task_id}", params={"wait": 0.1}).json()["id"] == task_id
        anonymous = httpx.get(f"{api.url}/tasks/{task_id}/events")
        assert anonymous.status_code == 401


def test_wait_on_another_replica_than_the_submit(
    settings: Settings, api_factory: ApiFactory, start_worker: WorkerFactory
) -> None:
    first, second = api_factory(settings), api_factory(settings)
    start_worker()
    with httpx.Client(base_url=first.url) as a, httpx.Client(base_url=second.url) as b:
        task = submit(a, "sleep", {"seconds": 0.5}, cls="interactive")
        response = b.get(f"/tasks/{task['id']}", params={"wait": 60}, timeout=10)
        assert response.json()["status"] == "succeeded"
        echo = submit(a, "echo", {}, cls="interactive")
        with b.stream("GET", f"/tasks/{echo['id']}/events") as stream:
            assert events(stream)[-1][0] == "final"


def test_clients_that_leave_free_their_waiters(
    known_types: None, api: ApiServer, http: httpx.Client
) -> None:
    hub = waiters(api)
    task_id = submit(http, "echo", {"x": 1})["id"]  # no worker: never ends

    async def leave_mid_wait() -> None:
        async with httpx.AsyncClient(base_url=api.url, timeout=60) as client:
            polls = [
                asyncio.create_task(client.get(f"/tasks/{task_id}", params={"wait": 60}))
                for _ in range(5)
            ]
            prefer = asyncio.create_task(
                client.post(
                    "/tasks", json={"type": "echo", "args": {}}, headers={"Prefer": "wait=60"}
                )
            )
            async with client.stream("GET", f"/tasks/{task_id}/events") as stream:
                lines = stream.aiter_lines()  # held: a dropped iterator closes the stream
                async for line in lines:
                    if line.startswith("event: "):
                        break
                await _until(lambda: hub.count == 7)
            for request in [*polls, prefer]:
                request.cancel()  # closes their connections
            await asyncio.gather(*polls, prefer, return_exceptions=True)

    asyncio.run(leave_mid_wait())
    wait_for(lambda: hub.count == 0, 5, what="every waiter removed")


async def _until(check: Callable[[], bool], timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.02)


def test_one_subscription_whatever_the_number_of_waiters(
    known_types: None, api: ApiServer, http: httpx.Client, r: redis.Redis
) -> None:
    hub = waiters(api)
    ids = [submit(http, "echo", {"x": i})["id"] for i in range(5)]  # queued, no worker
    wait_for(lambda: subscribers(r) == 1, 5, what="the API's subscription")

    async def fifty_waiters() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=api.url, timeout=15, limits=limits) as client:
            polls = [  # they would wait 60 s, but the client gives up after 15
                asyncio.create_task(client.get(f"/tasks/{ids[i % 5]}", params={"wait": 60}))
                for i in range(50)
            ]
            await _until(lambda: hub.count == 50)
            assert subscribers(r) == 1
            kinds = [c.get("flags", "") for c in r.client_list()]
            assert sum("P" in flags for flags in kinds) == 1  # one pub/sub connection in all
            for task_id in ids:  # a cancel is a change: every waiter answers at once
                assert (await client.delete(f"/tasks/{task_id}")).status_code == 200
            return [(await poll).json() for poll in polls]

    records = asyncio.run(fifty_waiters())
    assert {record["status"] for record in records} == {"canceled"}
    assert hub.count == 0


def test_subscription_comes_back_after_its_connection_dies(
    http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    wait_for(lambda: subscribers(r) == 1, 5, what="the API's subscription")
    r.client_kill_filter(_type="pubsub")
    wait_for(lambda: subscribers(r) == 1, 10, what="the subscription to come back")
    start_worker()
    task = submit(http, "sleep", {"seconds": 0.5}, cls="interactive")
    record = http.get(f"/tasks/{task['id']}", params={"wait": 60}, timeout=10).json()
    assert record["status"] == "succeeded"


class FreezingRelay:
    """A TCP relay to Redis that can go silent without closing anything: what a
    subscription sees when Redis' host vanishes without a reset (a half-open socket)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.frozen = False
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.frozen:  # a new connection after the freeze finds the host gone
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                if not self.frozen:  # frozen: bytes vanish, nothing is closed
                    dst.write(data)
                    await dst.drain()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))


def test_a_subscription_whose_socket_goes_silent_is_found_lost(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PING unanswered by the next quiet tick ends the subscription: the watches
    are woken (to read the record) and ``online`` falls, so a new wait reads first
    instead of waiting for a notification that cannot come."""
    monkeypatch.setattr(waiters_module, "IDLE_PING_S", 0.2)
    port = int(redis_url.rsplit(":", 1)[1].split("/", maxsplit=1)[0])

    async def scenario() -> tuple[bool, bool]:
        relay = FreezingRelay(port)
        client = aioredis.Redis(port=await relay.start())
        hub = Waiters(client, TaskStore(client, make_settings(redis_url)))
        hub.start()
        await _until(lambda: hub.online)
        with hub.watch("some-task") as watch:
            relay.frozen = True
            await _until(lambda: not hub.online)
            woken = watch.pending and watch.final
        await hub.stop()
        await client.aclose()
        assert relay.server is not None
        relay.server.close()
        return woken, hub.online

    woken, online = asyncio.run(scenario())
    assert woken  # as a possible end: the wait reads the record
    assert not online


def test_clients_wait_by_long_polling(http: httpx.Client, start_worker: WorkerFactory) -> None:
    start_worker()
    url = str(http.base_url)
    with Client(url) as client:
        task = client.submit("sleep", {"seconds": 1.5}, cls="interactive")
        seen: list[dict[str, Any]] = []
        done = client.wait(task["id"], timeout_s=30, on_update=seen.append)
        assert done["status"] == "succeeded"
        assert seen == [done]  # one long-poll answered when it ended, not a poll per 0.5 s

        stuck = client.submit("test.poll_cancel", {"seconds": 30}, cls="interactive")
        with pytest.raises(TimeoutError):
            client.wait(stuck["id"], timeout_s=0.5)
        client.cancel(stuck["id"])

    async def async_wait() -> list[dict[str, Any]]:
        async with AsyncClient(url) as client:
            task = await client.submit("sleep", {"seconds": 1.5}, cls="interactive")
            seen: list[dict[str, Any]] = []
            await client.wait(task["id"], timeout_s=30, wait_s=0.5, on_update=seen.append)
            return seen

    seen = asyncio.run(async_wait())
    assert seen[-1]["status"] == "succeeded"
    assert len(seen) >= 2  # long-polls answered until the last one, at the end


class CountingStore(TaskStore):
    """The API's store, counting the record reads a wait makes."""

    reads = 0

    async def get(
        self, task_id: str, tenant: str | None, whole: bool = True
    ) -> dict[str, Any] | None:
        self.reads += 1
        return await super().get(task_id, tenant, whole)


def _counting_hub(redis_url: str, online: bool) -> tuple[aioredis.Redis, CountingStore, Waiters]:
    """Waiters on a store that counts its reads, not subscribed: the tests hand the
    published messages to its handler themselves."""
    client = aioredis.Redis.from_url(redis_url)
    store = CountingStore(client, make_settings(redis_url))
    hub = Waiters(client, store)
    hub.online = online
    return client, store, hub


def test_a_wait_for_the_end_reads_the_record_again_only_for_a_change_that_may_end_it(
    redis_url: str,
) -> None:
    """A start (or a progress step) wakes the wait but cannot end the task: the record
    is read when the wait begins and after the change that ended it, not in between.
    The published messages go to the subscription's handler as Redis sends them (the
    scripts' publishing is tested in test_scripts)."""
    s = SyncScripts(redis.Redis.from_url(redis_url))
    task_id = submit_task(s)
    register(s, "w")

    async def scenario() -> tuple[dict[str, Any] | None, list[int]]:
        # online: as once subscribed (offline, it would re-read every second)
        client, store, hub = _counting_hub(redis_url, online=True)
        wait = asyncio.create_task(hub.until_final(task_id, None, 30))
        first = await _settled(lambda: _waiting(hub, task_id))  # read once, now waiting
        reads = [store.reads]
        assert claim(s, "w") == [task_id]
        hub._wake(f"{task_id} started")  # as claim.lua publishes it
        await _settled(lambda: _waiting(hub, task_id, first))  # waiting again
        reads.append(store.reads)
        assert finish_task(s, "w", task_id, {"ok": True}) == b"ok"
        hub._wake(task_id)  # as finish.lua publishes it (a bare id may be an end)
        record = await asyncio.wait_for(wait, 10)
        reads.append(store.reads)
        await client.aclose()
        return record, reads

    record, reads = asyncio.run(scenario())
    assert record is not None and record["status"] == "succeeded"
    assert reads == [1, 1, 2]


@pytest.mark.parametrize("live", [True, False])
def test_a_wait_on_a_watch_registered_before_the_record_changed_reads_it_only_at_the_end(
    redis_url: str, live: bool
) -> None:
    """``wait_final(unread=False)``: the route registered the watch while the
    subscription was up and knows the record was not final then (it created it, or
    read it after registering), so nothing is read until a change that may end the
    task: one read per record (``/v1/embeddings``, ``Prefer: wait``, ``?wait=N``).
    Registered while the subscription was down, the watch may have missed a change:
    the wait reads first."""
    s = SyncScripts(redis.Redis.from_url(redis_url))
    task_id = submit_task(s)
    register(s, "w")

    async def scenario() -> tuple[dict[str, Any] | None, list[int]]:
        client, store, hub = _counting_hub(redis_url, online=live)
        with hub.watch_all([task_id]) as (watch,):
            hub.online = True  # a wait on a watch registered offline still reads first
            wait = asyncio.create_task(hub.wait_final(watch, None, 30, unread=False))
            first = await _settled(lambda: _waiting(hub, task_id))
            reads = [store.reads]
            assert claim(s, "w") == [task_id]
            hub._wake(f"{task_id} started")  # as claim.lua publishes it
            await _settled(lambda: _waiting(hub, task_id, first))
            reads.append(store.reads)
            assert finish_task(s, "w", task_id, {"ok": True}) == b"ok"
            hub._wake(task_id)
            record = await asyncio.wait_for(wait, 10)
            reads.append(store.reads)
        assert not hub._by_id  # the block's end removed the watch
        await client.aclose()
        return record, reads

    record, reads = asyncio.run(scenario())
    assert record is not None and record["status"] == "succeeded"
    assert reads == ([0, 0, 1] if live else [1, 1, 2])


def _waiting(hub: Waiters, task_id: str, before: object = None) -> object:
    """The future the wait on ``task_id`` waits on now, if not ``before``, else None."""
    watch = next(iter(hub._by_id.get(task_id, ())), None)
    future = watch._future if watch is not None else None
    return future if future is not None and future is not before and not future.done() else None


async def _settled(found: Callable[[], object]) -> object:
    """``found()`` once it is something, letting the event loop run meanwhile (a
    record read waits on Redis: turns of the loop, up to a deadline)."""
    deadline = asyncio.get_running_loop().time() + 10
    while (value := found()) is None:
        assert asyncio.get_running_loop().time() < deadline, "the wait did not get there"
        await asyncio.sleep(0.001)
    return value
