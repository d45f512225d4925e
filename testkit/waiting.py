"""Waiting on a condition with a deadline, and the "is it up yet" checks polled that
way: a server still starting (or already gone) reads as not yet, never as an error."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import redis


class WaitTimeout(AssertionError):
    """A condition did not come true in time (an AssertionError, so pytest reports it
    as a failed expectation)."""


def wait_for(
    check: Callable[[], Any],
    timeout_s: float = 10.0,
    what: str = "condition",
    *,
    interval_s: float = 0.02,
) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)
    raise WaitTimeout(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")


def redis_answers(client: redis.Redis) -> bool:
    """Whether the server answers PING now (refused, reset or timed out: not yet)."""
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def wait_redis(client: redis.Redis, what: str, timeout_s: float = 10.0) -> None:
    """Until the server ``client`` talks to answers PING: one just started."""
    wait_for(lambda: redis_answers(client), timeout_s, what=what)


def http_ok(url: str, client: httpx.Client | None = None) -> bool:
    """Whether GET ``url`` answers 200 now (nothing listening yet: False). Through
    ``client`` when given (``url`` may then be a path under its base URL), else a
    one-off request with a short timeout."""
    try:
        response = client.get(url) if client is not None else httpx.get(url, timeout=1)
    except httpx.HTTPError:
        return False
    return response.status_code == 200
