"""The task types the pool runs, as published by the workers in ``gpulane:catalog``.

The API never imports task code: it learns each type's argument schema (JSON Schema,
from the task's pydantic model) and file use from this catalog and refuses bad
submissions before they are queued. Entries persist, so types stay known while their
workers restart; a type with no live worker is a capacity question, not an unknown
type.

At start (``catalog_on_start``) the API also publishes the catalog of the configured
``task_modules`` from a subprocess of worker code (:mod:`dispatcher.contract.catalog`),
so a fresh deployment knows its types before any worker is ready. A lookup that misses
while that is under way waits for it. The processes of one API (``api_workers``: one
host and parent process) run that subprocess once: the first to take
``gpulane:catalog:publisher:<digest>:<host>:<parent pid>`` publishes, the others wait
for it to finish and read what it published.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from dispatcher.contract import keys
from dispatcher.contract.catalog import CatalogError, catalog_command, parse_catalog
from dispatcher.contract.settings import Settings

__all__ = ["Catalog", "TaskTypeInfo", "configured_catalog"]

log = logging.getLogger("gpulane.api")

_MAX_ERRORS = 5
PUBLISH_TIMEOUT_S = 60.0  # importing task modules (torch...) may take a while
_PUBLISHING_MS = int((PUBLISH_TIMEOUT_S + 10) * 1000)  # outlives the subprocess it guards
_DONE_MS = 600_000  # siblings starting (or restarted) within 10 min reuse a publication
_POLL_S = 0.1  # how often a process waiting for a sibling's publication looks


@dataclass(frozen=True)
class TaskTypeInfo:
    name: str
    description: str
    file: str  # none | optional | required
    validator: Draft202012Validator
    model: str | None = None  # the model id the type serves, when it names one
    gpu_memory_mb: int = 0  # GPU memory a task of the type needs (its @task declaration)
    batch_size: int = 0  # a batched type's Batch.max_size; 0: not batched
    backend: bool = False  # a backend model's type, routed to its backend workers
    context_length: int | None = None  # a backend model's context, when its server says

    def chunk_size(self, settings: Settings) -> int:
        """Items one record of a request holds: a batched type's batch size (its
        ``[types.<name>]`` override first), so one claim takes a full batch; 1 (every
        item its own task) for a type that is not batched."""
        if not self.batch_size:
            return 1
        override = settings.types.get(self.name)
        return max((override.batch_max_size if override else None) or self.batch_size, 1)

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


def _whole(entry: dict[str, Any], name: str) -> int:
    """An entry's whole-number field (absent: 0), or ValueError."""
    value = entry.get(name) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a whole number, 0 or more; got {value!r}")
    return value


def _parse(name: str, raw: bytes) -> TaskTypeInfo | None:
    try:
        entry = json.loads(raw)
        schema = entry["schema"]
        Draft202012Validator.check_schema(schema)
        gpu_memory_mb = _whole(entry, "gpu_memory_mb")
        batch_size = _whole(entry, "batch_max_size")
        context_length = _whole(entry, "context_length") or None
    except (ValueError, KeyError, TypeError, AttributeError, SchemaError) as exc:
        log.warning("ignoring malformed catalog entry %r: %s", name, exc)
        return None
    return TaskTypeInfo(
        name=name,
        description=str(entry.get("description", "")),
        file=str(entry.get("file", "none")),
        validator=Draft202012Validator(schema),
        model=str(entry["model"]) if entry.get("model") else None,
        gpu_memory_mb=gpu_memory_mb,
        batch_size=batch_size,
        backend=entry.get("backend") is True,
        context_length=context_length,
    )


async def configured_catalog(modules: list[str], timeout_s: float) -> dict[str, str]:
    """``{type: entry JSON}`` of ``modules``, from ``python -m worker.describe``."""
    argv, env = catalog_command(modules)
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise CatalogError(f"loading {modules} took over {timeout_s:g} s") from None
    return parse_catalog(proc.returncode or 0, out, err)


class Catalog:
    def __init__(self, client: Redis) -> None:
        self._client = client
        self._types: dict[str, TaskTypeInfo] = {}
        self._raw: dict[bytes, bytes] = {}
        self._publishing: asyncio.Task[None] | None = None

    def publish_configured(self, modules: list[str]) -> None:
        """Start publishing the configured modules' types (in the background)."""
        self._publishing = asyncio.create_task(self._publish(modules), name="gpulane-catalog")

    async def _publish(self, modules: list[str]) -> None:
        """Publish ``modules``' types, or wait for the process that does: the processes
        of one API (``api_workers``, or one restarted by its supervisor: the same host
        and parent process) run one catalog subprocess between them, however far
        apart they start."""
        digest = hashlib.sha256("\n".join(sorted(modules)).encode()).hexdigest()[:16]
        mark = keys.catalog_publisher(digest, f"{socket.gethostname()}:{os.getppid()}")
        try:
            if await self._client.set(mark, "publishing", nx=True, px=_PUBLISHING_MS):
                done = False
                try:
                    await self._run_subprocess(modules)
                    done = True
                finally:
                    # A failure leaves no mark: the next sibling to start tries again.
                    # (With Redis gone, the TTL frees it.)
                    with contextlib.suppress(RedisError):
                        if done:
                            await self._client.set(mark, "done", px=_DONE_MS)
                        else:
                            await self._client.delete(mark)
            else:
                await self._sibling_publishes(mark)
                log.info("the catalog of %s was published by another process of this API", modules)
            await self.refresh()
        except (CatalogError, OSError) as exc:
            log.warning("could not publish the configured task catalog: %s", exc)
        except RedisError as exc:
            log.warning("could not publish the configured task catalog (redis: %s)", exc)

    async def _run_subprocess(self, modules: list[str]) -> None:
        entries = await configured_catalog(modules, PUBLISH_TIMEOUT_S)
        if entries:
            await self._client.hset(keys.CATALOG, mapping=entries)  # type: ignore[arg-type]
        log.info("published the catalog of %s: %s", modules, sorted(entries))

    async def _sibling_publishes(self, mark: str) -> None:
        """Until the sibling process that took ``mark`` is done (or its TTL ran out)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _PUBLISHING_MS / 1000
        while await self._client.get(mark) == b"publishing" and loop.time() < deadline:
            await asyncio.sleep(_POLL_S)

    async def _published(self) -> None:
        """Wait for a publication under way (a failed one was logged)."""
        if self._publishing is not None and not self._publishing.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._publishing), PUBLISH_TIMEOUT_S)

    async def close(self) -> None:
        if self._publishing is not None and not self._publishing.done():
            self._publishing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._publishing

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
            await self._published()
            raw = await self._client.hget(keys.CATALOG, name)
            if raw is not None:
                info = _parse(name, _bytes(raw))
                if info is not None:
                    self._types = {**self._types, name: info}
        return info

    def models(self) -> dict[str, str]:
        """model id -> task type, for the types that declare a model."""
        return {info.model: name for name, info in self._types.items() if info.model}

    async def names(self) -> list[str]:
        """Known type names, read afresh: for the error that lists them."""
        await self._published()
        await self.refresh()
        return sorted(self._types)
