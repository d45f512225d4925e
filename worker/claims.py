"""What a worker holds and what it reports: the records :class:`worker.broker.Broker`
reads from its scripts' answers and sends back in its reports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError, ResponseError

from dispatcher.contract import vectors
from dispatcher.contract.reap import Reaped
from dispatcher.contract.scripts import FinishVerdict, as_text
from dispatcher.contract.scripts import verdict as script_verdict
from worker.registry import Split

__all__ = [
    "Beat",
    "Claimed",
    "Finished",
    "Lease",
    "Report",
    "parse_claimed",
    "parse_finished",
    "parse_lease",
]


@dataclass(frozen=True)
class Claimed:
    """A task this worker holds (it sits in the worker's in-flight list). ``attempt``
    is the fencing token: every report carries it, and the scripts drop a report whose
    attempt a later claim superseded."""

    task_id: str
    cls: str
    data: bytes
    attempt: int
    timeout_s: float
    created_ms: int | None
    started_ms: int
    file: bytes | None
    task_type: str = ""  # the job hash's ``type`` (the call data says it again)
    items: int = 1  # a chunk's item count (a task is one item)
    tenant: str = ""
    # A part's (of a task split into parts): its parent's id, its index, and the key
    # of its result whose list is its part ('': the whole result is one entry).
    parent: str = ""
    part: int | None = None
    merge: str = ""
    encoding_format: str = vectors.FLOAT  # how the requester takes vectors (ctx.encoding_format)


@dataclass(frozen=True)
class Report:
    """An outcome for finish.lua: ``status`` is RQ's (finished, failed, canceled), with
    the result's JSON or the error, and the run's last progress."""

    claimed: Claimed
    status: str
    result_json: str = ""
    error: dict[str, Any] | None = None
    progress: dict[str, Any] | None = None
    device_s: float = 0.0  # the device time the run used (its share of its batch's calls)
    split: Split | None = None  # a split: the parts to queue (split.lua, not finish.lua)
    entries: int = 0  # a part's: the entries its result holds


# finish.lua's answer: ('ok', the Redis time it ended at) or (why not, None).
Finished = tuple[FinishVerdict, int | None]


def parse_finished(reply: Any) -> Finished | RedisError:
    """One record's answer from finish.lua (or split.lua's); an error finish.lua met on
    that record alone (``{'error', message}``) is a script error, as it was when each
    record had a call of its own."""
    if isinstance(reply, RedisError):
        return reply
    if as_text(reply[0]) == "error":
        message = reply[1]  # it may quote a record's bytes
        text = message.decode(errors="replace") if isinstance(message, bytes) else str(message)
        return ResponseError(text)
    verdict: FinishVerdict = script_verdict(reply[0], FinishVerdict)
    return verdict, int(reply[1]) if verdict == "ok" else None


@dataclass(frozen=True)
class Lease:
    """heartbeat.lua's answer: whether the lease was live (False: it had been reaped and
    is renewed afresh), the task ids to cancel, and whether the run in progress is still
    the task's current attempt (False once a later attempt superseded it)."""

    renewed: bool
    cancels: list[str]
    held: bool


@dataclass(frozen=True)
class Beat:
    """One heartbeat's three answers, each a reply or the error Redis gave that script."""

    reaped: list[Reaped] | RedisError
    lease: Lease | RedisError
    gpu: str | RedisError | None  # 'held', 'retaken' or who took it; None: no claim


def parse_lease(reply: list[Any]) -> Lease:
    renewed, cancels, held = reply
    return Lease(bool(renewed), [as_text(c) for c in cancels], bool(held))


def parse_claimed(reply: list[Any], class_timeout_s: Callable[[str], float]) -> Claimed:
    """A task of claim.lua's answer; ``class_timeout_s(cls)`` is asked for its class's
    timeout where the task set none of its own."""
    (task_id, cls, data, attempt, timeout, created, started, file, task_type, items, tenant) = (
        reply[:11]
    )
    parent, part, merge, encoding_format = reply[11:15]
    return Claimed(
        task_id=as_text(task_id),
        cls=as_text(cls),
        data=data,
        attempt=int(attempt),
        timeout_s=float(timeout) if timeout else class_timeout_s(as_text(cls)),
        created_ms=int(created) if created else None,
        started_ms=int(started),
        file=file,
        task_type=as_text(task_type),
        items=int(items),
        tenant=as_text(tenant),
        parent=as_text(parent),
        part=int(part) if part else None,
        merge=as_text(merge),
        encoding_format=as_text(encoding_format) or vectors.FLOAT,
    )
