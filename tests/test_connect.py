"""The Redis connection factory: sentinel settings, and which errors are an outage."""

from __future__ import annotations

import pytest
from redis.exceptions import ConnectionError, MasterDownError, ReadOnlyError, ResponseError

from dispatcher.contract.connect import describe, refused, sync_client
from dispatcher.contract.settings import Settings, SettingsError, load_settings


def test_sentinel_addresses_are_validated() -> None:
    for bad in (["localhost"], ["h:port"], [":26379"], ["h:70000"]):
        with pytest.raises(SettingsError, match="redis_sentinels"):
            load_settings(redis_sentinels=bad)
    ok = load_settings(redis_sentinels=["10.0.0.1:26379", "[::1]:26380"])
    assert ok.redis_remote and ok.redis_url is None


def test_describe_hides_passwords() -> None:
    assert "s3cret" not in describe(Settings(redis_url="redis://:s3cret@db:6380/2"))
    sentinel = Settings(redis_sentinels=["a:1", "b:2"], redis_sentinel_master="m")
    assert describe(sentinel) == "master 'm' via sentinels a:1,b:2"


def test_sentinel_client_takes_master_credentials_from_the_url() -> None:
    settings = Settings(
        redis_url="redis://u:pw@ignored:1/3",
        redis_sentinels=["127.0.0.1:1"],
        redis_sentinel_password="spw",
    )
    client = sync_client(settings, socket_timeout=1, connect_timeout=1)
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("u", "pw", 3)
    assert client.connection_pool.service_name == "gpulane"


def test_a_failover_is_an_outage_not_a_refusal() -> None:
    assert not refused(ReadOnlyError("READONLY You can't write against a read only replica."))
    assert not refused(MasterDownError("MASTERDOWN"))
    assert not refused(ConnectionError("reset"))
    assert refused(ResponseError("ERR user_script:1: Script attempted to access ..."))
