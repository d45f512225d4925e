"""Results stored in parts (a task split into parts, ``dispatcher.contract.parts``):
the record's result, merged, and ``GET /tasks/<id>/result``, streamed.

A split task's result is never cut: up to ``max_result_bytes`` its record holds it
whole (its own fields plus its parts' entries in order under its ``merge`` key);
past that the record's ``result`` is null and ``result_url`` says where to read it.
That read streams part by part (one part's JSON in memory at a time), whole or a
range of entries numbered from the task's ``first`` (pages, for ``document.extract``).
A part's own record reads its result from the same store.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis

from dispatcher.api.errors import ApiError
from dispatcher.contract import keys
from dispatcher.contract.jobs import TaskStatus
from dispatcher.contract.parts import EntryRange

__all__ = ["Layout", "complete", "layout", "select", "stream"]


@dataclass(frozen=True)
class Layout:
    """How a split task's result is stored: the merged list's key, whether parts'
    lists are concatenated, the first entry's number, and each part's entry count."""

    merge: str
    first: int
    counts: list[int]

    @property
    def entries(self) -> int:
        return sum(self.counts)

    @property
    def last(self) -> int:
        return self.first + self.entries - 1


def _text(raw: Any, default: str = "") -> str:
    return raw.decode() if isinstance(raw, bytes) and raw else default


async def layout(client: Redis, task_id: str, count: int) -> Layout:
    merge, first = await client.hmget(keys.job(task_id), ["merge", "first"])
    counts = await client.hmget(keys.parts(task_id), [f"n:{k}" for k in range(count)])
    return Layout(_text(merge, "results"), int(first or 1), [int(n or 0) for n in counts])


async def complete(client: Redis, record: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    """The record with its stored parts read in: a split task that succeeded holds its
    merged result (or, past ``max_bytes``, ``result_url``); a part holds its own."""
    if record["status"] != TaskStatus.SUCCEEDED:
        return record
    parts = record.get("parts")
    if parts is not None:
        if parts["bytes"] + len(orjson.dumps(record["result"])) > max_bytes:
            return {**record, "result": None, "result_url": f"/tasks/{record['id']}/result"}
        merge, stored = await _merged(client, record["id"], parts["count"])
        entries: list[Any] = []
        for raw in stored:
            entries.extend(orjson.loads(raw) if raw else [])
        return {**record, "result": {**(record["result"] or {}), merge: entries}}
    if record.get("parent") is not None and record.get("part") is not None:
        return {**record, "result": await _part_result(client, record["parent"], record["part"])}
    return record


async def _merged(client: Redis, task_id: str, count: int) -> tuple[str, list[Any]]:
    """The merged list's key and every part's stored entries, in one round trip."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.hget(keys.job(task_id), "merge")
        pipe.hmget(keys.parts(task_id), [str(k) for k in range(count)])
        merge, stored = await pipe.execute()
    return _text(merge, "results"), stored


async def _part_result(client: Redis, parent: str, part: int) -> Any:
    """A part's own result, from its parent's store: its entries (under the parent's
    key when its result held a list there), or its one entry."""
    async with client.pipeline(transaction=False) as pipe:
        pipe.hget(keys.parts(parent), str(part))
        pipe.hmget(keys.job(parent), ["merge", "flatten"])
        raw, (merge, flatten) = await pipe.execute()
    if raw is None:
        return None
    entries = orjson.loads(raw)
    if flatten == b"1":
        return {_text(merge, "results"): entries}
    return entries[0] if entries else None


def select(shape: Layout, wanted: EntryRange | None) -> list[tuple[int, int, int]]:
    """The parts holding the ``wanted`` entries (all: None), each as (part, the first
    entry to take in it, the entry after the last); 416 for a range past the result."""
    if wanted is not None and (wanted.first < shape.first or wanted.last > shape.last):
        held = f"{shape.first}-{shape.last}" if shape.entries else "none"
        message = f"pages={wanted} is out of range: the result holds entries {held}."
        raise ApiError(416, "range_not_satisfiable", message, entries=shape.entries)
    out = []
    at = shape.first
    for part, n in enumerate(shape.counts):
        lo, hi = 0, n
        if wanted is not None:
            lo, hi = max(0, wanted.first - at), min(n, wanted.last - at + 1)
        if lo < hi:
            out.append((part, lo, hi))
        at += n
    return out


async def stream(
    client: Redis, record: dict[str, Any], shape: Layout, wanted: EntryRange | None
) -> AsyncIterator[bytes]:
    """The result's JSON, its parts read one at a time: the task's own fields, then the
    merged list (or its ``wanted`` range)."""
    chosen = select(shape, wanted)  # before the first byte: a 416 is still possible
    return _chunks(client, record, shape, chosen)


async def _chunks(
    client: Redis, record: dict[str, Any], shape: Layout, chosen: list[tuple[int, int, int]]
) -> AsyncIterator[bytes]:
    head = orjson.dumps(record["result"] or {})
    yield head[:-1] + (b"," if len(head) > 2 else b"") + orjson.dumps(shape.merge) + b":["
    key = keys.parts(record["id"])
    sep = b""
    for part, lo, hi in chosen:
        raw: bytes | None = await client.hget(key, str(part))  # type: ignore[assignment]
        if raw is None:  # expired while streaming: an unterminated body, never a short one
            raise RuntimeError(f"part {part} of {record['id']} is gone")
        if (lo, hi) != (0, shape.counts[part]):
            raw = orjson.dumps(orjson.loads(raw)[lo:hi])
        inner = raw[1:-1]
        if inner:
            yield sep + inner
            sep = b","
    yield b"]}"
