"""Counting Redis commands: ``CONFIG RESETSTAT`` then ``INFO commandstats``.

Redis counts the commands a Lua script runs (``redis.call``) under their own names
as well as the ``EVALSHA`` that ran them, so totals here include Lua-internal
commands. :func:`trace` uses ``MONITOR`` (which tags script commands with ``lua``) to
split one lifecycle into client round trips and Lua-internal commands, and lists it.

The bench's own reads (waiting for completion) are subtracted through
:class:`Counting`; ``INFO``, ``CONFIG`` and ``SCRIPT`` (redis-py's script loading)
are never counted.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import Counter
from typing import Any

import redis

from dispatcher.contract.scripts import NAMES, source

IGNORED = {
    "info",
    "config",
    "config|resetstat",
    "config|get",
    "script",
    "script|exists",
    "script|load",
    "monitor",
    "client",
    "client|setinfo",
    "client|setname",
    "hello",
}
# Commands only the periodic heartbeat, reaper or API maintenance send (never a task's
# own lifecycle): a window containing one of them is contaminated by background work.
# Not ZADD: a worker parking scores itself in the idle ZSETs (the heartbeat's lease
# ZADD is caught by its PEXPIREs of RQ's worker registry).
BACKGROUND = {"zrange", "zrangebyscore", "set", "hgetall", "echo", "hincrby", "pexpire"}


def reset(client: redis.Redis) -> None:
    client.config_resetstat()


def read(client: redis.Redis) -> Counter[str]:
    """Calls per command since the last reset, without the bench's own admin commands."""
    stats: dict[str, Any] = client.info("commandstats")
    out: Counter[str] = Counter()
    for key, value in stats.items():
        name = key.removeprefix("cmdstat_")
        if name not in IGNORED and not name.startswith(("config", "client", "script")):
            out[name] = int(value["calls"])
    return out


class Counting:
    """The bench's own commands in a window, to subtract from the server's counts."""

    def __init__(self) -> None:
        self.own: Counter[str] = Counter()

    def add(self, command: str, n: int = 1) -> None:
        self.own[command] += n

    def net(self, stats: Counter[str]) -> Counter[str]:
        out = stats.copy()
        out.subtract(self.own)
        return +out


def script_names() -> dict[str, str]:
    """sha1 -> gpulane script name (what EVALSHA's first argument means)."""
    return {hashlib.sha1(source(n).encode()).hexdigest(): n for n in NAMES}


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32}")


def _label(command: str, shas: dict[str, str]) -> str:
    """``EVALSHA claim``, ``HSET rq:job:<id>``...: the command and its key, ids redacted."""
    parts = command.split(" ")
    name = parts[0].upper()
    if name == "EVALSHA" and len(parts) > 1:
        return f"EVALSHA {shas.get(parts[1], parts[1][:8])}"
    arg = _UUID.sub("<id>", parts[1]) if len(parts) > 1 else ""
    return f"{name} {arg[:48]}".strip()


class Monitor:
    """Records every command Redis runs while active (``with Monitor(client) as m``)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.lines: list[tuple[bool, str]] = []  # (from lua, label)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()
        self._shas = script_names()

    def __enter__(self) -> Monitor:
        self._thread.start()
        self._ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.client.echo("bench-monitor-stop")
        self._thread.join(5)

    def _run(self) -> None:
        with self.client.monitor() as mon:  # type: ignore[no-untyped-call]
            self._ready.set()
            for event in mon.listen():
                command = str(event["command"])
                if command.startswith("ECHO bench-monitor-stop"):
                    return
                name = command.split(" ", 1)[0].lower()
                if name in IGNORED or name.startswith(("config", "client", "script")):
                    continue
                self.lines.append((event.get("client_type") == "lua", _label(command, self._shas)))

    @property
    def counts(self) -> tuple[int, int]:
        """(client round trips, Lua-internal commands)."""
        lua = sum(1 for from_lua, _ in self.lines if from_lua)
        return len(self.lines) - lua, lua


class ScriptTime:
    """Redis's own time in each gpulane script while active (``with ScriptTime(client)
    as t: ...; t.us``, microseconds by script name): every command goes to the SLOWLOG
    (``slowlog-log-slower-than 0``), which is read and reset after, and its ``EVALSHA``
    entries are summed. A script's own commands are logged too, inside its time (not
    summed again), and their logging is in it: the times are upper bounds (logging every
    command made Redis about a third slower on single-input requests). More entries than
    the log holds (:data:`MAX_ENTRIES`) fail the measurement rather than undercount it.
    The settings Redis had are put back."""

    MAX_ENTRIES = 200_000

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.us: Counter[str] = Counter()  # script name -> microseconds
        self._shas = script_names()
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> ScriptTime:
        names = ("slowlog-log-slower-than", "slowlog-max-len")
        self._saved = {n: self.client.config_get(n)[n] for n in names}
        self.client.config_set("slowlog-max-len", self.MAX_ENTRIES)
        self.client.slowlog_reset()
        self.client.config_set("slowlog-log-slower-than", 0)
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.config_set("slowlog-log-slower-than", self._saved["slowlog-log-slower-than"])
        entries = self.client.slowlog_get(self.MAX_ENTRIES)
        # A full log may have dropped its oldest. (Not SLOWLOG LEN against them: the long
        # SLOWLOG GET just sent is itself slower than the restored threshold, logged.)
        dropped = len(entries) >= self.MAX_ENTRIES
        self.client.config_set("slowlog-max-len", self._saved["slowlog-max-len"])
        self.client.slowlog_reset()
        if dropped and exc[0] is None:  # never mask what the measured code raised
            raise RuntimeError(f"the SLOWLOG filled ({self.MAX_ENTRIES:,} entries): measure less")
        for entry in entries:
            command = entry["command"]
            text = command.decode(errors="replace") if isinstance(command, bytes) else command
            label = _label(text, self._shas).split(" ")
            if label[0] == "EVALSHA" and len(label) > 1:
                self.us[label[1]] += int(entry["duration"])
