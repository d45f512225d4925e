"""gpulane's Lua scripts: loaded from ``dispatcher/contract/lua/*.lua`` and registered once.

Each script's text is the key builders from :mod:`dispatcher.contract.keys` and the
final statuses from :mod:`dispatcher.contract.jobs`, then the helper libraries it uses
(:mod:`dispatcher.contract.lualib`), then the script. Every multi-key change gpulane
makes goes through one of them, so it is atomic. Calls use ``EVALSHA``; a script Redis
lost (``NOSCRIPT``: restarted, flushed, failed over) is loaded again and the call sent
again, by redis-py for single calls and by :meth:`SyncScripts.run_many` for a worker's
round trips.

Options travel as one JSON object in ``ARGV[1]`` (readable Lua, no positional soup);
binary payloads (call data, files, results) follow as raw arguments. ``finish.lua``
takes a list of such objects, one per record of a batch, and each record's result.

Every script declares its flags (a ``#!lua`` first line, :data:`FLAGS`), so a Redis
at ``maxmemory`` (``noeviction``) decides before a script runs: a script that may
write is refused whole (``OOM``), never half-done; ``no-writes`` scripts (reads) run
on; ``allow-oom`` scripts run anyway. Those are only the ones whose writes are small
and bounded by the pool's size, not by the traffic: the lease (heartbeat, GPU claim)
and the tenant's rate-limit bucket, so a full Redis does not turn live workers into
dead ones or lock every tenant out of the read routes.
"""

from __future__ import annotations

import json
import os
import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any, Literal, cast

from hiredis import pack_command
from redis import Redis
from redis.commands.core import Script
from redis.exceptions import ConnectionError, NoScriptError, ResponseError, TimeoutError

from dispatcher.contract import jobs, keys, lualib, parts

__all__ = [
    "FLAGS",
    "NAMES",
    "CancelVerdict",
    "FinishVerdict",
    "ReleaseVerdict",
    "SubmitVerdict",
    "SyncScripts",
    "as_text",
    "options",
    "pack_all",
    "source",
    "verdict",
]

# What the scripts answer (the first element of their reply), one type per script.
SubmitVerdict = Literal[
    "accepted",
    "duplicate",
    "idempotency_key_reused",
    "queue_full",
    "no_workers",
    "over_quota",
    "device_quota",
]
CancelVerdict = Literal["canceled", "cancel_requested", "conflict", "part_of", "not_found"]
# ``duplicate``: already final (another worker or a cancel reported it); ``gone``: no
# such task any more; ``fenced``: a later attempt owns the task, the report was dropped.
FinishVerdict = Literal["ok", "duplicate", "gone", "fenced"]
# ``released``: queued again. With a fault (a lost attempt): ``requeued``, or
# ``failed`` once the budget is spent. ``canceled``: a cancel was pending. Otherwise the
# RQ status it already had, or ``gone`` when this worker no longer held it, or
# ``fenced`` when a later attempt owns the task.
ReleaseVerdict = Literal[
    "released",
    "requeued",
    "failed",
    "canceled",
    "gone",
    "queued",
    "finished",
    "stopped",
    "fenced",
]

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
    "progress",
    "stream",
    "tokens",
    "split",
    "retain",
)


# Script flags (Redis 7 shebang); a script not named here may write and is refused
# before it runs while Redis is over maxmemory.
FLAGS = {
    "get": "no-writes",
    "heartbeat": "allow-oom",
    "gpu_lease": "allow-oom",
    "ratelimit": "allow-oom",
    "tokens": "allow-oom",
    "retain": "allow-oom",  # it only lets memory go sooner
}


_KEY_USE = re.compile(r"\bK\.([A-Za-z_][A-Za-z0-9_]*)")  # a key builder a script calls


@cache
def source(name: str) -> str:
    """Full text of script ``name`` as sent to Redis (its flags on the first line)."""
    body = (resources.files("dispatcher.contract") / "lua" / f"{name}.lua").read_text()
    flags = FLAGS.get(name)
    shebang = f"#!lua flags={flags}" if flags else "#!lua"
    helpers = "\n".join(lualib.text(lib) for lib in lualib.libraries_for(body))
    shared = jobs.lua_statuses() + parts.lua_part_id()
    code = "\n".join(line.split("--", 1)[0] for line in (shared + helpers + body).splitlines())
    generated = keys.lua_prelude(set(_KEY_USE.findall(code))) + shared  # calls, not comments
    return f"{shebang}\n-- gpulane:{name}\n{generated}{helpers}\n{body}"


def as_text(value: Any) -> str:
    """A string from a Redis reply (bytes from a client that does not decode)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def verdict(value: bytes | str, allowed: Any) -> Any:
    """A script's verdict, checked against its ``Literal`` type: a script and its
    caller that disagree fail loudly here, not somewhere downstream."""
    text = as_text(value)
    if text not in allowed.__args__:
        raise ValueError(f"unexpected script verdict {text!r}")
    return cast(Any, text)


def options(**values: Any) -> str:
    """Encode a script's options object (``ARGV[1]``). The standard library's encoder,
    though orjson is ten times faster: it writes ``inf`` (an unbounded ``max_wait_s`` or
    rate) and ``nan`` as ``null``, and refuses integers past 64 bits (a huge device
    quota in microseconds), where the scripts' cjson reads what ``json`` writes."""
    return json.dumps(values, separators=(",", ":"))


def _fewer_acks(first: Any, second: Any) -> Any:
    """Two WAIT replies for one set of writes: both must hold, so the error, if either
    failed, else the fewer replicas."""
    for reply in (first, second):
        if isinstance(reply, Exception):
            return reply
    return min(int(first), int(second))


@dataclass
class SyncScripts:
    """The scripts bound to a synchronous client (workers)."""

    client: Redis
    _bound: dict[str, Script] = field(default_factory=dict)
    _held: threading.local = field(default_factory=threading.local)

    def __post_init__(self) -> None:
        for name in NAMES:
            self._bound[name] = self.client.register_script(source(name))

    def run(self, name: str, opts: str, *payload: bytes | str) -> Any:
        return self._bound[name](keys=[], args=[opts, *payload])

    def run_many(
        self,
        calls: Sequence[tuple[str, Sequence[bytes | str]]],
        wait: tuple[int, int] | None = None,
    ) -> list[Any]:
        """Several scripts (name, ARGV: options first, then payloads) in one round trip,
        in order, each atomic on its own. A script Redis refused (full, read-only, an
        error) is its exception in the list, the others' replies unaffected; a lost
        connection raises. With ``wait`` = (replicas, timeout ms) a ``WAIT`` ends the
        round trip, and its reply (how many replicas hold every write before it) ends
        the list. A lost connection is not retried here (:func:`_exchange`).

        ``EVALSHA`` goes straight into the round trip: redis-py's Script objects would
        add a ``SCRIPT EXISTS`` round trip to every pipeline. A script Redis lost (a
        restart, a flush, a failover to a replica that never ran it) answers
        ``NOSCRIPT`` without running; it is loaded and only those calls are sent again."""
        replies = self._send(calls, wait)
        lost = [
            k for k, reply in enumerate(replies[: len(calls)]) if isinstance(reply, NoScriptError)
        ]
        if not lost:
            return replies
        # Loaded in the round trip that sends them again, on the same connection: after
        # a failover another connection of the pool may reach another server.
        names = sorted({calls[k][0] for k in lost})
        loads = [("SCRIPT", "LOAD", self._bound[name].script) for name in names]
        sent = self._send([calls[k] for k in lost], wait, loads)
        loaded, again = dict(zip(names, sent, strict=False)), sent[len(loads) :]
        for k, reply in zip(lost, again, strict=False):  # WAIT's reply, if any, comes last
            failed = loaded[calls[k][0]]  # a script Redis would not load: that error
            replies[k] = failed if isinstance(failed, ResponseError) else reply
        if wait is not None:
            replies[-1] = _fewer_acks(replies[-1], again[-1])
        return replies

    def _send(
        self,
        calls: Sequence[tuple[str, Sequence[bytes | str]]],
        wait: tuple[int, int] | None,
        before: Sequence[tuple[Any, ...]] = (),
    ) -> list[Any]:
        """One round trip: the ``before`` commands, the calls, the ``WAIT``; every reply."""
        commands: list[tuple[Any, ...]] = [*before]
        commands += [("EVALSHA", self._bound[name].sha, 0, *argv) for name, argv in calls]
        if wait is not None:
            commands.append(("WAIT", *wait))
        return _exchange(self._connection(), commands)

    def _connection(self) -> Any:
        """This thread's connection for :meth:`run_many`, taken from the client's pool
        once and kept while the thread lives (the pool's checkout and return cost a
        fifth of a round trip's CPU), then given back. It stays the pool's: closing
        the client closes it."""
        held = getattr(self._held, "it", None)
        if held is None or held.pid != os.getpid():  # a forked child opens its own
            pool = self.client.connection_pool
            held = self._held.it = _Held(pool.get_connection(), os.getpid())
            # A thread that ends gives its connection back with it (an in-process
            # worker's two threads live as long as it does; a backend worker's
            # executor threads, up to the executor's size, as long as the executor).
            weakref.finalize(held, pool.release, held.conn)
        return held.conn


@dataclass
class _Held:
    """A thread's connection (a holder, so its end can be watched: a thread-local
    value goes when its thread does)."""

    conn: Any
    pid: int  # the process that took it


def _ready(conn: Any) -> None:
    """Connect ``conn`` if it is not, as the pool does at each checkout: a connection
    the server closed while it sat idle (a restart, Redis' ``timeout``, a proxy) reads
    as end of file, and is opened again before anything is sent, so nothing is in
    doubt. Connecting asks Sentinel for the master, when the client has Sentinels (a
    connection reconnecting inside its send would go back to the address it had)."""
    conn.connect()
    try:
        stale = conn.can_read()  # nothing is owed to an idle connection
    except (ConnectionError, TimeoutError, OSError):
        stale = True
    if stale:
        conn.disconnect()
        conn.connect()


def pack_all(commands: list[tuple[Any, ...]]) -> bytes:
    """One round trip's commands as RESP, packed by hiredis in one C call per command
    (the arguments are str, bytes and int): the worker's and the API's exchanges."""
    return b"".join([pack_command(command) for command in commands])


def _exchange(conn: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """One round trip of ``commands`` on ``conn``: each reply, or the error Redis
    answered it with; a lost connection (or a timeout) raises, the connection dropped.

    Never re-sent here, whatever retries the client was built with (redis-py's
    Pipeline sends the whole round trip again up to its client's retry count: none
    for the clients of :mod:`dispatcher.contract.connect`, ten for a plain
    ``Redis(host=...)``): a reply lost to a reset or a timeout may belong to a script
    that ran, and only the caller knows what asking again means (a claim asks with
    ``redeliver``, or it would take a second task and strand the first; a report is
    sent again, answered ``duplicate``).

    Packed by hiredis in one C call per command (the arguments are str, bytes and
    int): redis-py's packer checks and encodes each argument in Python first. With
    the Pipeline's per-call bookkeeping and the pool's checkout gone too, a worker's
    round trip of two scripts costs half the client CPU it did (about 45 us against
    95 on the 2-core machine of ``bench/results``)."""
    packed = pack_all(commands)
    replies: list[Any] = []
    _ready(conn)
    try:
        conn.send_packed_command([packed])
        for _ in commands:
            try:
                replies.append(conn.read_response())
            except ResponseError as exc:
                replies.append(exc)
    except BaseException:
        # Replies may still be on the socket: never use it again as it is.
        conn.disconnect()
        raise
    return replies
