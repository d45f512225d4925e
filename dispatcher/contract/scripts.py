"""gpulane's Lua scripts: loaded from ``dispatcher/contract/lua/*.lua`` and registered once.

Each script's text is the key builders from :mod:`dispatcher.contract.keys` and the
final statuses from :mod:`dispatcher.contract.jobs`, then the helper libraries it uses
(:mod:`dispatcher.contract.lualib`), then the script. Every multi-key change gpulane
makes goes through one of them, so it is atomic. Calls use ``EVALSHA``; redis-py reloads a script by
itself after ``NOSCRIPT`` (a restarted or flushed Redis).

Options travel as one JSON object in ``ARGV[1]`` (readable Lua, no positional soup);
binary payloads (call data, files, results) follow as raw arguments.

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
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any, Literal, cast

from redis import Redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from dispatcher.contract import jobs, keys, lualib, parts

__all__ = [
    "FLAGS",
    "NAMES",
    "CancelVerdict",
    "FinishVerdict",
    "ReleaseVerdict",
    "SubmitVerdict",
    "SyncScripts",
    "options",
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
)


# Script flags (Redis 7 shebang); a script not named here may write and is refused
# before it runs while Redis is over maxmemory.
FLAGS = {
    "get": "no-writes",
    "heartbeat": "allow-oom",
    "gpu_lease": "allow-oom",
    "ratelimit": "allow-oom",
    "tokens": "allow-oom",
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
    generated = keys.lua_prelude(set(_KEY_USE.findall(shared + helpers + body))) + shared
    return f"{shebang}\n-- gpulane:{name}\n{generated}{helpers}\n{body}"


def verdict(value: bytes | str, allowed: Any) -> Any:
    """A script's verdict, checked against its ``Literal`` type: a script and its
    caller that disagree fail loudly here, not somewhere downstream."""
    text = value.decode() if isinstance(value, bytes) else value
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
        the list.

        ``EVALSHA`` goes straight into the pipeline: redis-py's Script objects would
        add a ``SCRIPT EXISTS`` round trip to every pipeline. A script Redis lost (a
        restart, a flush) answers ``NOSCRIPT`` without running; it is loaded and only
        those calls are sent again."""
        replies = self._send(calls, wait)
        lost = [
            k for k, reply in enumerate(replies[: len(calls)]) if isinstance(reply, NoScriptError)
        ]
        if not lost:
            return replies
        for name in {calls[k][0] for k in lost}:
            self.client.script_load(self._bound[name].script)
        again = self._send([calls[k] for k in lost], wait)
        for k, reply in zip(lost, again, strict=False):  # WAIT's reply, if any, comes last
            replies[k] = reply
        if wait is not None:
            replies[-1] = _fewer_acks(replies[-1], again[-1])
        return replies

    def _send(
        self, calls: Sequence[tuple[str, Sequence[bytes | str]]], wait: tuple[int, int] | None
    ) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for name, argv in calls:
            pipe.execute_command("EVALSHA", self._bound[name].sha, 0, *argv)  # type: ignore[no-untyped-call]
        if wait is not None:
            pipe.execute_command("WAIT", *wait)  # type: ignore[no-untyped-call]
        replies: list[Any] = pipe.execute(raise_on_error=False)
        return replies
