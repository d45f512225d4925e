"""The one way gpulane processes connect to Redis: a URL, or the master a set of
Sentinels names (``redis_sentinels``), followed across a failover.

With Sentinel, redis-py's managed pool asks the sentinels for the master at every new
connection and treats a ``READONLY`` reply from a demoted master as a lost connection,
so the next attempt reaches the promoted replica. Clients built here (``from_url``,
``master_for``) retry nothing themselves: a reply lost to a reset or a timeout may
belong to a script that ran, so an outage reaches the caller as a ``RedisError`` at
once and each caller's own policy applies (workers back off and retry within their
lease, a claim with ``redeliver``; the API answers ``503 store_unavailable``). A
worker's script round trips (:func:`dispatcher.contract.scripts._exchange`) never
re-send, whatever client they are given. :data:`OUTAGE` and
:func:`refused` tell such an outage from a command Redis refused (a script error).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.connection import parse_url
from redis.exceptions import (
    BusyLoadingError,
    ConnectionError,
    MasterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TimeoutError,
)
from redis.sentinel import Sentinel

from dispatcher.contract.settings import Settings

__all__ = [
    "OUTAGE",
    "REFUSED_FOR_NOW",
    "ReplicaLag",
    "async_client",
    "describe",
    "refused",
    "sync_client",
    "why_refused",
]


class ReplicaLag(ConnectionError):
    """A write did not reach ``min_replica_acks`` replicas in time. It may vanish in a
    failover, so the caller treats it as an outage: it retries (the scripts it retries
    are idempotent for the same attempt) until a master confirms it. ``replies``: what
    the unconfirmed scripts answered, for a caller that needs them (a retry answers
    ``duplicate`` where the first write said when the task ended)."""

    def __init__(self, message: str, replies: list[Any] | None = None) -> None:
        super().__init__(message)
        self.replies = replies or []


# Redis is unreachable or switching masters: wait and retry. (ReadOnlyError: a demoted
# master still answering; MasterDownError: a replica lost its master.)
OUTAGE = (ConnectionError, TimeoutError, BusyLoadingError, ReadOnlyError, MasterDownError)
# Redis refused a write whole (script flags) and will take it later: not a script bug.
REFUSED_FOR_NOW = (OutOfMemoryError, ReadOnlyError)


def why_refused(exc: RedisError) -> str:
    """A write refused for now, in words for ``GET /workers``' reason and the logs."""
    if isinstance(exc, OutOfMemoryError):
        return "redis is full (maxmemory)"
    return "redis is read-only (a replica?)"


# Error replies that a healthy Redis gives while it cannot write for now.
_TRANSIENT_REPLIES = ("NOREPLICAS", "MISCONF", "MASTERDOWN", "LOADING", "READONLY", "TRYAGAIN")


def refused(exc: RedisError) -> bool:
    """True when Redis refused the command itself (a script error), which retrying
    would only repeat; False for an outage or a failover in progress (a demoted master
    answering READONLY, a replica without its master, NOREPLICAS from a master missing
    its replicas), a full Redis (maxmemory) or a failed disk write (MISCONF), which
    waiting cures."""
    if not isinstance(exc, ResponseError) or isinstance(exc, (*OUTAGE, OutOfMemoryError)):
        return False
    return not str(exc).startswith(_TRANSIENT_REPLIES)


def _sentinels(settings: Settings) -> list[tuple[str, int]]:
    out = []
    for address in settings.redis_sentinels:
        host, _, port = address.rpartition(":")
        out.append((host.strip("[]"), int(port)))
    return out


def _master_auth(settings: Settings) -> dict[str, Any]:
    """Credentials and database of the master, from ``redis_url`` when one is given."""
    if settings.redis_url is None:
        return {}
    parsed = parse_url(settings.redis_url)  # type: ignore[no-untyped-call, unused-ignore]  # untyped before redis 8.2
    return {k: parsed[k] for k in ("username", "password", "db") if parsed.get(k) is not None}


def _sentinel_kwargs(settings: Settings, timeout_s: float) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if settings.redis_sentinel_username:
        kwargs["username"] = settings.redis_sentinel_username
    if settings.redis_sentinel_password:
        kwargs["password"] = settings.redis_sentinel_password
    return kwargs


def _sentinel_args(settings: Settings, socket_timeout: float, connect_timeout: float) -> Any:
    """Positional and keyword arguments of redis-py's Sentinel (sync and asyncio)."""
    return (_sentinels(settings),), {
        "sentinel_kwargs": _sentinel_kwargs(settings, connect_timeout),
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": connect_timeout,
        **_master_auth(settings),
    }


def sync_client(settings: Settings, *, socket_timeout: float, connect_timeout: float) -> Redis:
    """A client of the shared Redis (workers, ops tools)."""
    if not settings.redis_sentinels:
        return Redis.from_url(
            settings.redis_url_or_default,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
        )
    args, kwargs = _sentinel_args(settings, socket_timeout, connect_timeout)
    sentinel = Sentinel(*args, **kwargs)  # type: ignore[no-untyped-call, unused-ignore]  # untyped before redis 8.2
    client: Redis = sentinel.master_for(settings.redis_sentinel_master)  # type: ignore[no-untyped-call, unused-ignore]  # untyped before redis 8.2
    return client


def async_client(
    settings: Settings, *, socket_timeout: float, connect_timeout: float
) -> AsyncRedis:
    """An asyncio client of the shared Redis (the API)."""
    if not settings.redis_sentinels:
        return AsyncRedis.from_url(
            settings.redis_url_or_default,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
        )
    args, kwargs = _sentinel_args(settings, socket_timeout, connect_timeout)
    sentinel = AsyncSentinel(*args, **kwargs)  # type: ignore[no-untyped-call, unused-ignore]  # untyped before redis 8.2
    client: AsyncRedis = sentinel.master_for(settings.redis_sentinel_master)
    return client


def describe(settings: Settings) -> str:
    """Where Redis is, for logs: no password."""
    if settings.redis_sentinels:
        return f"master {settings.redis_sentinel_master!r} via sentinels " + ",".join(
            settings.redis_sentinels
        )
    parts = urlsplit(settings.redis_url_or_default)
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{parts.hostname}"
        if parts.port is not None:
            netloc += f":{parts.port}"
        parts = parts._replace(netloc=netloc)
    return urlunsplit(parts)
