"""A worker's script round trips (``SyncScripts.run_many``) on a real Redis: a reply
lost to a timeout is never answered by sending the scripts again (a claim that ran
would take a second task and strand the first), and a dropped connection comes back
by itself on the next call."""

from __future__ import annotations

import pytest
import redis
from redis.connection import Connection
from support.lua import SETTINGS, register, submit

from dispatcher.contract import keys
from dispatcher.contract.scripts import SyncScripts
from worker.broker import Broker

NAME = "rt-worker"


@pytest.fixture
def broker(redis_url: str) -> Broker:
    return Broker(redis.Redis.from_url(redis_url), SETTINGS, NAME, SETTINGS.class_names)


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
    # Sent again as it was (redis-py Pipeline's retry), the claim would have taken the
    # second task as well, and the first would sit 'started' until the worker exits.
    assert _ids(r, inflight) == [first]
    claims = broker.claim(False, "{}", redeliver=True)
    assert [c.task_id for c in claims] == [first]
    assert _ids(r, inflight) == [first]
    assert _ids(r, keys.queue("batch")) == [second]


def test_a_dropped_connection_fails_one_call_and_the_next_reconnects(
    r: redis.Redis, broker: Broker
) -> None:
    s = SyncScripts(r)
    register(s, NAME)
    assert broker.claim(False, "{}") == []  # nothing queued: its connection is open
    task = submit(s)
    r.client_kill_filter(_type="normal", skipme=True)  # every client but this one
    with pytest.raises(redis.ConnectionError):
        broker.claim(False, "{}", redeliver=True)
    claims = broker.claim(False, "{}", redeliver=True)
    assert [c.task_id for c in claims] == [task]
