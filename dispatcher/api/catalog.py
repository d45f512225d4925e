"""The task types the pool runs, as published by the workers in ``gpulane:catalog``.

The API never imports task code: it learns each type's argument schema (JSON Schema,
from the task's pydantic model) and file use from this catalog and refuses bad
submissions before they are queued. Entries persist, so types stay known while their
workers restart; a type with no live worker is a capacity question, not an unknown
type.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from redis.asyncio import Redis

from dispatcher.contract import keys

__all__ = ["Catalog", "TaskTypeInfo"]

log = logging.getLogger("gpulane.api")

_MAX_ERRORS = 5


@dataclass(frozen=True)
class TaskTypeInfo:
    name: str
    description: str
    file: str  # none | optional | required
    validator: Draft202012Validator

    def errors(self, args: dict[str, Any]) -> list[str]:
        """Readable messages for ``args`` that fail the type's schema (empty: valid)."""
        found = sorted(self.validator.iter_errors(args), key=lambda e: list(e.absolute_path))
        out = []
        for err in found[:_MAX_ERRORS]:
            where = ".".join(str(p) for p in err.absolute_path)
            out.append(f"{where}: {err.message}" if where else err.message)
        return out


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _parse(name: str, raw: bytes) -> TaskTypeInfo | None:
    try:
        entry = json.loads(raw)
        schema = entry["schema"]
        Draft202012Validator.check_schema(schema)
    except (ValueError, KeyError, TypeError, SchemaError) as exc:
        log.warning("ignoring malformed catalog entry %r: %s", name, exc)
        return None
    return TaskTypeInfo(
        name=name,
        description=str(entry.get("description", "")),
        file=str(entry.get("file", "none")),
        validator=Draft202012Validator(schema),
    )


class Catalog:
    def __init__(self, client: Redis) -> None:
        self._client = client
        self._types: dict[str, TaskTypeInfo] = {}
        self._raw: dict[bytes, bytes] = {}

    async def refresh(self) -> None:
        reply = await self._client.hgetall(keys.CATALOG)
        raw = {_bytes(k): _bytes(v) for k, v in reply.items()}
        if raw == self._raw:
            return
        parsed = {k.decode(): _parse(k.decode(), v) for k, v in raw.items()}
        self._types = {name: info for name, info in parsed.items() if info is not None}
        self._raw = raw

    @property
    def types(self) -> dict[str, TaskTypeInfo]:
        """The types known now (as last read), by name."""
        return self._types

    async def lookup(self, name: str) -> TaskTypeInfo | None:
        """A cache miss reads that one entry: a worker that registered a moment ago is
        seen at once, and a junk name costs one HGET, never a full re-read."""
        info = self._types.get(name)
        if info is None:
            raw = await self._client.hget(keys.CATALOG, name)
            if raw is not None:
                info = _parse(name, _bytes(raw))
                if info is not None:
                    self._types = {**self._types, name: info}
        return info

    async def names(self) -> list[str]:
        """Known type names, read afresh: for the error that lists them."""
        await self.refresh()
        return sorted(self._types)
