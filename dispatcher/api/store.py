"""The API's task operations: submit, read and cancel, each one script call."""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from dispatcher.api import parts
from dispatcher.api.coalesce import AsyncScripts
from dispatcher.api.pool import ClassState
from dispatcher.contract import vectors
from dispatcher.contract.connect import ReplicaLag
from dispatcher.contract.jobs import (
    PUBLIC_STATUS,
    RECORD_FIELDS,
    FileMeta,
    encode_call,
    record_from_fields,
)
from dispatcher.contract.scripts import CancelVerdict, SubmitVerdict, as_text, options
from dispatcher.contract.scripts import verdict as script_verdict
from dispatcher.contract.settings import ClassConfig, Settings

__all__ = [
    "CancelResult",
    "Record",
    "Submission",
    "SubmitResult",
    "TaskStore",
    "fingerprint",
    "record_of",
    "submit_options",
]


@dataclass(frozen=True)
class Submission:
    task_type: str
    cls: str
    args: dict[str, Any]
    timeout_s: float
    tenant: str
    file: FileMeta | None = None
    file_data: bytes = b""
    idempotency_key: str | None = None
    max_in_flight: int = 0  # the tenant's quota of queued + running tasks; 0: none
    weight: float | None = None  # the tenant's fair-share weight; None: no tenant config
    gpu_memory_mb: int = 0  # GPU memory it needs; 0: any worker can run it
    # What the request itself said (None: its type's declaration applies). The
    # idempotency fingerprint takes this: a type republished with another declaration
    # must not turn a client's retry into a different request.
    gpu_memory_asked: int | None = None
    routed: bool = False  # a backend model's type: only its backend workers take it
    device_quota_s: float = 0.0  # the tenant's device-seconds per rolling hour; 0: none


@dataclass(frozen=True)
class Record:
    """One record of a request that submits several at once (a bulk submit, the
    chunks of /v1/embeddings): a task (``items`` 1) or a chunk of ``items`` items of one
    batched type, its call already encoded."""

    task_type: str
    data: bytes
    timeout_s: float
    items: int = 1
    gpu_memory_mb: int = 0
    task_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    routed: bool = False  # a backend model's type: only its backend workers take it
    tpm: int = 0  # model tokens its tenant's tpm budget was charged (settled later)
    # How the requester takes embedding vectors (the handler's ctx.encoding_format):
    # /v1/embeddings asks for base64, packed (dispatcher.contract.vectors).
    encoding_format: str = vectors.FLOAT

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.task_id,
            "type": self.task_type,
            "items": self.items,
            "timeout": self.timeout_s,
            "gpu_mb": self.gpu_memory_mb,
        }
        if self.routed:
            out["routed"] = True
        if self.tpm:
            out["tpm"] = self.tpm
        if self.encoding_format != vectors.FLOAT:
            out["encoding_format"] = self.encoding_format
        return out


def record_of(sub: Submission) -> Record:
    """A single submit's one record: its task, the call encoded."""
    data = encode_call(sub.task_type, sub.args, sub.file)
    return Record(sub.task_type, data, sub.timeout_s, 1, sub.gpu_memory_mb, routed=sub.routed)


@dataclass(frozen=True)
class SubmitResult:
    verdict: SubmitVerdict
    task_id: str
    depth: int  # items queued in the class after this submit
    estimated_wait_s: float | None
    status: str = "queued"  # public status (for a duplicate: the original's)
    cls: str = ""
    task_type: str = ""
    limit: str = ""  # queue_full: the limit reached, 'depth', 'wait' or 'bytes'
    position: int | None = None  # accepted: tasks ahead of it (fair order under fair share)
    # What submit.lua decided for the answer's headers: the pressure the next submit
    # meets (accepted) and the Retry-After of a refusal, in seconds.
    pressure: str = ""
    retry_after_s: int | None = None


@dataclass(frozen=True)
class CancelResult:
    verdict: CancelVerdict
    status: str | None = None  # for a conflict: the status it already had
    cls: str = ""  # for canceled: what the metrics count it under
    task_type: str = ""
    items: int = 1  # for canceled: a chunk's items (the metrics count items)
    parent: str = ""  # for part_of: the task the part is part of


def fingerprint(sub: Submission) -> str:
    """sha256 of the canonical request (type, class, args, timeout, the file's bytes):
    an Idempotency-Key replays only the request it was first sent with."""
    canonical = {
        "type": sub.task_type,
        "class": sub.cls,
        "args": sub.args,
        "timeout_s": sub.timeout_s,
        "file": hashlib.sha256(sub.file_data).hexdigest() if sub.file is not None else None,
        "file_name": sub.file.name if sub.file is not None else None,
    }
    if sub.gpu_memory_asked is not None:  # absent: keys sent before placement still match
        canonical["gpu_memory_mb"] = sub.gpu_memory_asked
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def submit_options(
    sub: Submission,
    cfg: ClassConfig,
    workers: int,
    run_s: float,
    settings: Settings,
    serving: int | None = None,
    records: list[Record] | None = None,
    measured: bool = True,
) -> str:
    """submit.lua's options: the request (``sub``'s task, or ``records`` in its class
    for its tenant), its class's limits and the pool's state (``workers``: live workers
    of the class whose GPU could hold the task; ``serving``: all live workers of the
    class, default the same; ``measured``: whether ``run_s`` was measured)."""
    digest = fp = ""
    if sub.idempotency_key is not None:
        digest = hashlib.sha256(sub.idempotency_key.encode()).hexdigest()
        fp = fingerprint(sub)
    if records is None:
        records = [Record(sub.task_type, b"", sub.timeout_s, 1, sub.gpu_memory_mb)]
    return options(
        records=[r.to_json() for r in records],
        tenant=sub.tenant,
        ttl_s=settings.result_ttl_s,
        max_queued=cfg.max_queued,
        max_bytes=cfg.max_queued_bytes,
        max_wait_s=cfg.max_wait_s,
        reject_without_workers=cfg.reject_without_workers,
        workers=workers,
        run_s=run_s,
        idem=digest,
        fingerprint=fp,
        idem_ttl_s=settings.idempotency_ttl_s,
        max_in_flight=sub.max_in_flight,
        dq=round(sub.device_quota_s * 1e6),
        lane=sub.tenant if settings.fair_share and sub.weight is not None else "",
        weight=sub.weight or 1.0,
        serving=workers if serving is None else serving,
        measured=measured,
        classes=settings.class_names,
        **{"class": sub.cls},
    )


class TaskStore:
    def __init__(self, client: Redis, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self.scripts = AsyncScripts(
            client,
            replica_acks=settings.min_replica_acks,
            ack_timeout_ms=max(1, int(settings.replica_ack_timeout_s * 1000)),
        )

    async def submit(self, sub: Submission, state: ClassState) -> SubmitResult:
        return await self.submit_records(sub, [record_of(sub)], state)

    async def submit_records(
        self, sub: Submission, records: list[Record], state: ClassState
    ) -> SubmitResult:
        """Admit ``records`` whole or not at all, in ``sub``'s class for its tenant (its
        quota, weight and idempotency key; its file goes with the first record)."""
        need = max(r.gpu_memory_mb for r in records)
        workers = state.fitting(need)
        opts = submit_options(
            sub,
            state.config,
            workers,
            state.run_s,
            self.settings,
            state.workers,
            records,
            state.measured,
        )
        argv = [r.data for r in records]
        wanted = self.settings.min_replica_acks
        if wanted > 0:
            reply, acks = await self.scripts.run_acked("submit", opts, *argv, sub.file_data)
            if acks < wanted:
                # The task may exist on the master and be lost in a failover.
                raise ReplicaLag(f"{acks} of {wanted} replicas confirmed the task in time")
        else:
            reply = await self.scripts.run("submit", opts, *argv, sub.file_data)
        verdict: SubmitVerdict = script_verdict(reply[0], SubmitVerdict)
        if verdict == "duplicate":
            _, task_id, status, cls, task_type = (as_text(x) for x in reply)
            return SubmitResult(
                verdict, task_id, -1, None, PUBLIC_STATUS.get(status, status), cls, task_type
            )
        if verdict == "idempotency_key_reused":
            return SubmitResult(verdict, as_text(reply[1]), -1, None)
        accepted = verdict == "accepted"
        depth = int(reply[2]) + (sum(r.items for r in records) if accepted else 0)
        est_ms = int(reply[3])
        common = (verdict, as_text(reply[1]), depth, est_ms / 1000 if est_ms >= 0 else None)
        if accepted:  # reply[4]: its position, reply[5]: the pressure
            return SubmitResult(*common, "queued", sub.cls, sub.task_type,
                                position=int(reply[4]), pressure=as_text(reply[5]))  # fmt: skip
        # reply[4]: the limit refused (device_quota: ms), reply[5]: Retry-After.
        return SubmitResult(*common, "queued", sub.cls, sub.task_type, limit=as_text(reply[4]),
                            pressure="full", retry_after_s=int(reply[5]))  # fmt: skip

    async def retain(self, task_ids: list[str], ttl_s: int) -> int:
        """Keep these final records at most ``ttl_s`` more (``retain.lua``, which never
        lengthens a TTL: ``result_ttl_s`` stays the most); how many it shortened."""
        return int(await self.scripts.run("retain", str(ttl_s), *task_ids))

    async def get(
        self, task_id: str, tenant: str | None, whole: bool = True
    ) -> dict[str, Any] | None:
        """The public record, or None when absent or owned by another tenant. ``whole``:
        with a split task's or a part's result read from its parts (api/parts.py)."""
        values, position = await self.scripts.run("get", task_id, *RECORD_FIELDS)
        raw = dict(zip(RECORD_FIELDS, values, strict=True))
        if raw["status"] is None:
            return None
        if tenant is not None and (raw["tenant"] or b"").decode() != tenant:
            return None
        record = record_from_fields(task_id, values, position)
        if whole and (record["parts"] is not None or record["parent"] is not None):
            record = await parts.complete(self.client, record, self.settings.max_result_bytes)
        return record

    async def cancel(self, task_id: str, tenant: str | None) -> CancelResult:
        opts = options(
            id=task_id,
            tenant=tenant or "",
            any_tenant=tenant is None,
            ttl_s=self.settings.result_ttl_s,
        )
        reply = [as_text(x) for x in await self.scripts.run("cancel", opts)]
        verdict: CancelVerdict = script_verdict(reply[0], CancelVerdict)
        if verdict == "canceled":
            return CancelResult("canceled", cls=reply[1], task_type=reply[2], items=int(reply[3]))
        if verdict == "part_of":
            return CancelResult(verdict, parent=reply[1])
        status = PUBLIC_STATUS.get(reply[1], reply[1]) if len(reply) > 1 else None
        return CancelResult(verdict, status)
