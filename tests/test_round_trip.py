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

import worker.broker
from dispatcher.contract import keys
from dispatcher.contract.connect import refused
from dispatcher.contract.scripts import SyncScripts
from testkit import RedisServer, wait_for
from worker.broker import Broker
from worker.claims import Claimed, Report

NAME = "rt-worker"
_NO_SUCH_TASK = json.dumps(  # finish.lua's records: one
    [{"id": "none", "worker": NAME, "class": "batch", "attempt": 1, "status": "finished"}
     | {"error": "", "progress": "", "ttl_s": 60}]
)  # fmt: skip


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
    assert scripts.run_many([report], wait=(0, 10)) == [[[b"gone"]], 0]  # loaded, no replicas
    r.script_flush()
    round_trips.clear()
    scripts._bound["broken"] = held.register_script("this is not lua")
    replies = scripts.run_many([report, ("broken", ("{}",)), report], wait=(0, 10))
    assert len(round_trips) == 2  # the calls, then the loads with the lost calls again
    assert round_trips[1].count(b"SCRIPT") == 2 and round_trips[1].count(b"EVALSHA") == 3
    assert replies[0] == replies[2] == [[b"gone"]]
    assert isinstance(replies[1], ResponseError) and not isinstance(replies[1], NoScriptError)
    assert replies[3] == 0  # WAIT's
    held.close()


def _batch(r: redis.Redis, broker: Broker, n: int) -> list[Claimed]:
    """``n`` tasks queued, then claimed as one batch."""
    s = SyncScripts(r)
    register(s, NAME)
    ids = [submit(s) for _ in range(n)]
    claims = broker.claim(False, "{}", batch={"echo": n})
    assert [c.task_id for c in claims] == ids
    return claims


@pytest.mark.parametrize(("records", "calls"), [(1, 1), (64, 1), (65, 2), (130, 3)])
def test_a_batch_is_reported_in_one_finish_call_per_64_records(
    r: redis.Redis, broker: Broker, records: int, calls: int
) -> None:
    """A batch's records share finish.lua calls (its cost paid once, not per record),
    at most FINISH_PER_CALL each, so that none holds Redis long; all in one round trip."""
    claims = _batch(r, broker, records)
    r.config_resetstat()
    replies = broker.finish_many([Report(c, "finished", json.dumps({"i": k})) for k, c in
                                  enumerate(claims)])  # fmt: skip
    assert r.info("commandstats")["cmdstat_evalsha"]["calls"] == calls
    assert [reply[0] for reply in replies] == ["ok"] * records  # type: ignore[index]
    stored = [r.hget(keys.job(c.task_id), "result") for c in claims]
    assert stored == [json.dumps({"i": k}).encode() for k in range(records)]  # each its own
    assert r.llen(keys.inflight(NAME, "batch")) == 0


def test_an_error_on_one_record_is_its_own_the_others_are_recorded(
    r: redis.Redis, broker: Broker
) -> None:
    """Records that share a finish.lua call stand alone, as with a call each: a record
    the script fails on (here its hash replaced by a string) answers with that error,
    a script error (refused: the worker gives that one up), and the rest are recorded."""
    claims = _batch(r, broker, 5)
    broken = claims[2].task_id
    r.delete(keys.job(broken))
    r.set(keys.job(broken), "not a hash")
    replies = broker.finish_many([Report(c, "finished", "{}") for c in claims])
    error = replies[2]
    assert isinstance(error, ResponseError) and "WRONGTYPE" in str(error)
    assert refused(error)
    for claimed, reply in zip(claims, replies, strict=True):
        if claimed.task_id != broken:
            assert not isinstance(reply, Exception) and reply[0] == "ok"
            assert r.hget(keys.job(claimed.task_id), "status") == b"finished"
    assert _ids(r, keys.inflight(NAME, "batch")) == [broken]  # left for the reaper


def test_a_call_carries_a_bounded_size_of_results(
    r: redis.Redis, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis holds a command's arguments whole before it runs: a call ends before a
    result that would take it past FINISH_BYTES_PER_CALL (one larger goes alone)."""
    monkeypatch.setattr(worker.broker, "FINISH_BYTES_PER_CALL", 1000)
    claims = _batch(r, broker, 5)
    sizes = [400, 400, 400, 1500, 100]  # calls: [400, 400], [400], [1500], [100]
    r.config_resetstat()
    results = [json.dumps("x" * (n - 2)) for n in sizes]  # n characters each
    reports = [Report(c, "finished", res) for c, res in zip(claims, results, strict=True)]
    replies = broker.finish_many(reports)
    assert r.info("commandstats")["cmdstat_evalsha"]["calls"] == 4
    assert [reply[0] for reply in replies] == ["ok"] * 5  # type: ignore[index]


def test_finish_refuses_a_record_not_in_a_list(r: redis.Redis) -> None:
    """One record's options as an object (not a list of one) would loop over nothing
    and record nothing: refused, a script error."""
    with pytest.raises(ResponseError, match="list of records"):
        SyncScripts(r).run("finish", _NO_SUCH_TASK[1:-1], "")
