"""A worker's script round trips (``SyncScripts.run_many``) on a real Redis: a reply
lost to a reset or a timeout is never answered by sending the scripts again (a claim
that ran would take a second task and strand the first), and a connection the server
closed while it sat idle is opened again before anything is sent."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.connection import Connection
from redis.exceptions import NoScriptError, ResponseError
from redis.retry import Retry
from support.lua import SETTINGS, register, submit

from dispatcher.contract import keys
from dispatcher.contract.scripts import SyncScripts
from testkit import RedisServer, wait_for
from worker.broker import Broker

NAME = "rt-worker"
_NO_SUCH_TASK = json.dumps(
    {"id": "none", "worker": NAME, "class": "batch", "attempt": 1, "status": "finished"}
    | {"error": "", "progress": "", "ttl_s": 60}
)


@pytest.fixture
def broker(redis_url: str) -> Iterator[Broker]:
    # A client that retries (as a plain Redis(host=...) does): the round trips must not.
    client = redis.Redis.from_url(redis_url, retry=Retry(NoBackoff(), 3))
    yield Broker(client, SETTINGS, NAME, SETTINGS.class_names)
    client.close()


def _ids(r: redis.Redis, key: str) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else v for v in r.lrange(key, 0, -1)]


@pytest.mark.parametrize(
    "loss",
    [redis.ConnectionError("Connection reset by peer"), redis.TimeoutError("Timeout reading")],
)
def test_a_claim_whose_reply_was_lost_is_asked_again_with_redeliver_not_resent(
    r: redis.Redis, broker: Broker, monkeypatch: pytest.MonkeyPatch, loss: redis.RedisError
) -> None:
    s = SyncScripts(r)
    register(s, NAME)
    assert broker.claim(False, "{}") == []  # nothing queued: its connection is open
    first, second = submit(s), submit(s)
    read = Connection.read_response
    lost: list[object] = []

    def reply_lost(self: Connection, *args: object, **kwargs: object) -> object:
        reply = read(self, *args, **kwargs)
        if not lost:  # the claim ran; its reply never reaches the worker
            lost.append(reply)
            raise loss
        return reply

    monkeypatch.setattr(Connection, "read_response", reply_lost)
    with pytest.raises(type(loss)):
        broker.claim(False, "{}")
    inflight = keys.inflight(NAME, "batch")
    # Sent again as it was (what redis-py's Pipeline does on a client built with
    # retries), the claim would have taken the second task as well, and the first
    # would sit 'started' until the worker exits.
    assert _ids(r, inflight) == [first]
    claims = broker.claim(False, "{}", redeliver=True)
    assert [c.task_id for c in claims] == [first]
    assert _ids(r, inflight) == [first]
    assert _ids(r, keys.queue("batch")) == [second]


def test_a_connection_closed_while_idle_is_opened_again_before_sending(
    private_redis: RedisServer,
) -> None:
    """A server that closed the worker's connection while it sat idle (a restart,
    Redis' ``timeout``, a proxy) costs nothing: the round trip reconnects first, where
    sending into the closed socket would leave the claim in doubt."""
    r = private_redis.client()
    broker = Broker(private_redis.client(), SETTINGS, NAME, SETTINGS.class_names)
    s = SyncScripts(r)
    register(s, NAME)
    assert broker.claim(False, "{}") == []  # nothing queued: its connection is open
    task = submit(s)
    r.client_kill_filter(_type="normal", skipme=True)  # every client but this one
    wait_for(lambda: r.info("clients")["connected_clients"] == 1, 10, what="the kill")
    assert [c.task_id for c in broker.claim(False, "{}")] == [task]
    assert _ids(r, keys.inflight(NAME, "batch")) == [task]


def test_a_thread_that_ends_gives_its_connection_back(private_redis: RedisServer) -> None:
    """Each thread holds a connection while it lives; one that ends (an executor's,
    when its pool shrinks or shuts down) gives it back, and the next thread takes it."""
    r = private_redis.client()
    held = redis.Redis.from_url(private_redis.url, client_name="held-by-threads")
    scripts = SyncScripts(held)
    options = '{"id":"none"}'
    for _ in range(20):
        thread = threading.Thread(target=scripts.run_many, args=([("get", (options,))],))
        thread.start()
        thread.join()
    named = [c for c in r.client_list() if c["name"] == "held-by-threads"]
    assert len(named) == 1, named  # one connection, not one per thread that ever ran


def test_a_lost_script_is_loaded_and_sent_again_in_one_round_trip(
    redis_url: str, r: redis.Redis, round_trips: list[bytes]
) -> None:
    """After NOSCRIPT (a restart, a flush, a promoted replica) the scripts are loaded in
    the packet that sends the lost calls again, on the same connection; a script Redis
    will not load answers its calls with that error; WAIT's reply still ends the list."""
    held = redis.Redis.from_url(redis_url)
    scripts = SyncScripts(held)
    report = ("finish", (_NO_SUCH_TASK, ""))
    assert scripts.run_many([report], wait=(0, 10)) == [[b"gone"], 0]  # loaded, no replicas
    r.script_flush()
    round_trips.clear()
    scripts._bound["broken"] = held.register_script("this is not lua")
    replies = scripts.run_many([report, ("broken", ("{}",)), report], wait=(0, 10))
    assert len(round_trips) == 2  # the calls, then the loads with the lost calls again
    assert round_trips[1].count(b"SCRIPT") == 2 and round_trips[1].count(b"EVALSHA") == 3
    assert replies[0] == replies[2] == [b"gone"]
    assert isinstance(replies[1], ResponseError) and not isinstance(replies[1], NoScriptError)
    assert replies[3] == 0  # WAIT's
    held.close()
