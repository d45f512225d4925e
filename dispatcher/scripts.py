"""gpulane's Lua scripts: loaded from ``dispatcher/lua/*.lua`` and registered once.

Each script's text is the key builders from :mod:`dispatcher.keys`, then
``_prelude.lua``, then the script. Every multi-key change gpulane makes goes through
one of them, so it is atomic. Calls use ``EVALSHA``; redis-py reloads a script by
itself after ``NOSCRIPT`` (a restarted or flushed Redis).

Options travel as one JSON object in ``ARGV[1]`` (readable Lua, no positional soup);
binary payloads (call data, files, results) follow as raw arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.commands.core import Script

from dispatcher import keys
from dispatcher.coalesce import Coalescer

__all__ = ["NAMES", "AsyncScripts", "SyncScripts", "options", "source"]

NAMES = (
    "submit",
    "claim",
    "finish",
    "release",
    "cancel",
    "get",
    "heartbeat",
    "reap",
    "register",
    "unregister",
    "ratelimit",
    "gpu_lease",
    "unpark",
)


@cache
def source(name: str) -> str:
    """Full text of script ``name`` as sent to Redis."""
    lua = resources.files("dispatcher") / "lua"
    prelude = (lua / "_prelude.lua").read_text()
    body = (lua / f"{name}.lua").read_text()
    return f"-- gpulane:{name}\n{keys.lua_prelude()}{prelude}\n{body}"


def options(**values: Any) -> str:
    """Encode a script's options object (``ARGV[1]``)."""
    return json.dumps(values, separators=(",", ":"))


@dataclass
class SyncScripts:
    """The scripts bound to a synchronous client (workers)."""

    client: Redis
    _bound: dict[str, Script] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in NAMES:
            self._bound[name] = self.client.register_script(source(name))

    def run(self, name: str, opts: str, *payload: bytes | str) -> Any:
        return self._bound[name](keys=[], args=[opts, *payload])


@dataclass
class AsyncScripts:
    """The scripts bound to an asyncio client (the API). Concurrent calls of one script
    share round trips (:mod:`dispatcher.coalesce`)."""

    client: AsyncRedis
    _bound: dict[str, Coalescer] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in NAMES:
            self._bound[name] = Coalescer(self.client, source(name))

    async def run(self, name: str, opts: str, *payload: bytes | str) -> Any:
        return await self._bound[name].call(opts, *payload)
