"""Driving gpulane's Lua scripts directly on the test Redis, as the API and workers
would, for tests of the paths processes reach only by chance."""

from __future__ import annotations

import json
from typing import Any

from dispatcher.api.store import Submission, submit_options
from dispatcher.contract.jobs import encode_call
from dispatcher.contract.reap import lease_options
from dispatcher.contract.scripts import SyncScripts, options
from dispatcher.contract.settings import Settings

__all__ = [
    "CLASSES",
    "SETTINGS",
    "claim",
    "claim_tasks",
    "finish",
    "park_score",
    "register",
    "submit",
    "submit_reply",
]

SETTINGS = Settings(redis_url="redis://unused", heartbeat_interval_s=0.2, lease_ttl_s=1.0)
CLASSES = SETTINGS.class_names


def submit_reply(
    s: SyncScripts,
    cls: str = "batch",
    task_type: str = "echo",
    tenant: str = "t",
    weight: float | None = None,
    gpu_mb: int = 0,
    workers: int = 1,
    settings: Settings = SETTINGS,
    serving: int | None = None,
    args: dict[str, Any] | None = None,
) -> list[Any]:
    """submit.lua's reply; ``weight`` set: the tenant has a fair-share lane."""
    args = args or {}
    sub = Submission(
        task_type, cls, args, timeout_s=60, tenant=tenant, weight=weight, gpu_memory_mb=gpu_mb
    )
    opts = submit_options(sub, settings.classes[cls], workers, 1.0, settings, serving)
    reply: list[Any] = s.run("submit", opts, encode_call(task_type, args), "")
    return reply


def submit(s: SyncScripts, cls: str = "batch", **kw: Any) -> str:
    """Submit a task; its id (asserts it was accepted)."""
    reply = submit_reply(s, cls, **kw)
    assert reply[0] == b"accepted", reply
    return str(reply[1].decode())


def register(s: SyncScripts, worker: str) -> None:
    rq = {"fields": {"state": "idle"}, "queues": CLASSES, "execution": None}
    opts = options(
        **lease_options(SETTINGS), worker=worker, info={"state": "idle"}, catalog={}, rq=rq
    )
    assert s.run("register", opts)[0] == b"ok"


def park_score(rank: int = 1000, mem: int | None = None) -> float:
    """A parked worker's score in the idle sets (the prelude's park_score)."""
    return float(rank * 2**32 + min(mem if mem is not None else 2**31 - 1, 2**31 - 1))


def claim_tasks(
    s: SyncScripts,
    worker: str,
    mem: int | None = None,
    batch: dict[str, int] | None = None,
    classes: list[str] = CLASSES,
    rank: int = 1000,
    redeliver: bool = False,
    aging: dict[str, int] | None = None,
    more: dict[str, Any] | None = None,
    fair_time: bool = False,
) -> list[Any]:
    """The tasks one claim took, as claim.lua returns them: [id, class, data, attempt,
    timeout, created_ms, started_ms, file, type]; empty: the worker parked. With
    ``more`` ({class, type, n}): [stop, task, ...]."""
    opts = options(
        worker=worker,
        classes=classes,
        aging=aging or {},
        was_idle=False,
        device="{}",
        redeliver=redeliver,
        batch=batch or {},
        rank=rank,
        fair_time=fair_time,
        **({} if mem is None else {"mem": mem}),
        **({} if more is None else {"more": more}),
    )
    return list(s.run("claim", opts) or [])


def claim(s: SyncScripts, worker: str, **kw: Any) -> list[str]:
    """Ids of the tasks one claim took (empty: the worker parked)."""
    return [task[0].decode() for task in claim_tasks(s, worker, **kw)]


def finish(
    s: SyncScripts,
    worker: str,
    task_id: str,
    result: Any,
    attempt: int = 1,
    cls: str = "batch",
    device_us: int | None = None,
) -> bytes:
    """finish.lua's verdict for a successful report of ``result`` (``device_us``: the
    device time measured, as a worker in device_time mode reports it)."""
    timed = {} if device_us is None else {"device_us": device_us}
    opts = options(id=task_id, worker=worker, attempt=attempt, status="finished", error="",
                   progress="", ttl_s=60, **{"class": cls}, **timed)  # fmt: skip
    return bytes(s.run("finish", f"[{opts}]", json.dumps(result))[0][0])  # a batch of one
