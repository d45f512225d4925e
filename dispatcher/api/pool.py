"""Read-side view of the pool: classes (depth, running, workers, run time) and live
workers, from two pipelined round trips. Serves ``GET /queues``, ``GET /workers``,
``/health`` and the admission cache that the API refreshes every heartbeat."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from dispatcher.api import admission
from dispatcher.contract import keys
from dispatcher.contract.jobs import iso_ms
from dispatcher.contract.settings import ClassConfig, Settings
from dispatcher.contract.workers import NOT_SERVING

__all__ = ["ClassState", "Pool", "Snapshot"]


@dataclass(frozen=True)
class ClassState:
    name: str
    config: ClassConfig
    depth: int
    running: int
    workers: int
    busy_workers: int
    oldest_wait_s: float | None
    run_s: float
    # GPU memory (MB) each live worker of the class could give a task; None: no limit.
    capacities: tuple[int | None, ...] = ()
    # Under fair share: queued tasks per tenant with any (its lane's length).
    tenants: tuple[tuple[str, int], ...] = ()
    # Whether run_s was measured (False: the default_run_s guess of a fresh pool, which
    # never refuses a submit for its wait).
    measured: bool = True

    def fitting(self, need_mb: int) -> int:
        """Live workers of the class whose GPU could ever hold a task needing ``need_mb``."""
        if need_mb <= 0:
            return self.workers
        return sum(1 for cap in self.capacities if cap is None or cap >= need_mb)

    @property
    def largest_mb(self) -> int | None:
        """The most GPU memory a live worker's card of the class offers (None: no card)."""
        return max((cap for cap in self.capacities if cap is not None), default=None)

    @property
    def estimated_wait_s(self) -> float | None:
        return admission.estimate_s(self.depth, self.run_s, self.workers)

    @property
    def pressure(self) -> str:
        # A fresh pool's guessed run time never makes it refuse (submit.lua's `measured`).
        run_s = self.run_s if self.measured else 0.0
        return admission.pressure(self.depth, run_s, self.workers, self.config)

    def to_json(self) -> dict[str, Any]:
        est = self.estimated_wait_s
        return {
            "name": self.name,
            "depth": self.depth,
            "running": self.running,
            "workers": self.workers,
            "busy_workers": self.busy_workers,
            "oldest_wait_s": self.oldest_wait_s,
            "estimated_wait_s": round(est, 3) if est is not None else None,
            "pressure": self.pressure,
        }


@dataclass(frozen=True)
class Snapshot:
    now_ms: int
    classes: dict[str, ClassState]
    workers: list[dict[str, Any]] = field(default_factory=list)

    def admitting(self, cls: str, task_type: str, routed: bool) -> ClassState:
        """The class as admission sees it for a task of ``task_type``: for a routed type
        (a backend model's), only the live workers that serve that type are its
        capacity; other types are served by the class's in-process workers."""
        state = self.classes[cls]
        if not routed:
            return state
        serving = sum(
            1
            for w in self.workers
            if w["state"] not in NOT_SERVING
            and cls in w["classes"]
            and task_type in w["task_types"]
        )
        return dataclasses.replace(state, workers=serving, capacities=())


def _decode(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}


def _worker_view(
    name: str, info: dict[str, str], current: tuple[str, str] | None, batch: list[str]
) -> dict[str, Any]:
    # The in-flight list is the truth about busy/idle; the published state lags a beat.
    state = info.get("state", "starting")
    if current and state not in ("stopping", "unhealthy", "backend_down"):
        state = "busy"
    elif state == "busy":
        state = "idle"
    heartbeat = info.get("last_heartbeat_ms")
    return {
        "name": name,
        "host": info.get("host"),
        "state": state,
        "classes": json.loads(info.get("classes", "[]")),
        "task_types": json.loads(info.get("task_types", "[]")),
        "current_task": current[0] if current else None,
        "current_class": current[1] if current else None,
        "current_batch": batch,
        "tasks_done": int(info.get("tasks_done", 0)),
        "tasks_failed": int(info.get("tasks_failed", 0)),
        "last_heartbeat": iso_ms(int(heartbeat)) if heartbeat else None,
        "device": json.loads(info.get("device", "null")),
        "reason": info.get("reason") or None,
        "models": json.loads(info.get("models", "{}")),
        "gpu_capacity_mb": int(info["gpu_capacity_mb"]) if info.get("gpu_capacity_mb") else None,
        "speed": float(info.get("speed") or 1.0),
        # A backend worker's server: {url, slots, busy, models}; None for the others.
        "backend": json.loads(info["backend"]) if info.get("backend") else None,
    }


class _Tally:
    """Counts per class while the live workers are read."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.workers: list[dict[str, Any]] = []
        self.serving = dict.fromkeys(names, 0)
        self.busy = dict.fromkeys(names, 0)
        self.running = dict.fromkeys(names, 0)
        self.capacities: dict[str, list[int | None]] = {name: [] for name in names}
        self.tenants: dict[str, list[tuple[str, int]]] = {name: [] for name in names}

    def add(self, name: str, info: dict[str, str], inflight: list[Any]) -> None:
        if not info:  # reaped between the two reads
            return
        current = None
        batch: list[str] = []
        for cls, tasks in zip(self.names, inflight, strict=True):
            if tasks:  # one task, or the tasks of one batch
                batch = [t.decode() for t in tasks]
                current = (batch[0], cls)
                self.running[cls] += len(tasks)
        view = _worker_view(name, info, current, batch)
        self.workers.append(view)
        if view["state"] in NOT_SERVING:
            return
        for cls in view["classes"]:
            if cls in self.serving:
                self.serving[cls] += 1
                self.busy[cls] += current is not None
                self.capacities[cls].append(view["gpu_capacity_mb"])


class Pool:
    def __init__(self, client: Redis, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self.latest: Snapshot | None = None

    async def snapshot(self) -> Snapshot:
        names = self.settings.class_names
        now_ms, live, per_class = await self._read_classes(names)
        pipe = self.client.pipeline(transaction=False)
        for name in live:
            pipe.hgetall(keys.worker(name))
            for cls in names:
                pipe.lrange(keys.inflight(name, cls), 0, -1)
        for _, head, *_ in per_class:
            if head:
                pipe.hget(keys.job(head.decode()), "created_ms")
            else:
                pipe.echo("")  # keeps one reply per class
        lanes = [(c, t.decode()) for c, (*_, active, _) in zip(names, per_class, strict=True)
                 for t in active]  # fmt: skip
        for cls, tenant in lanes:
            pipe.llen(keys.lane(cls, tenant))
        replies = await pipe.execute()
        stride = 1 + len(names)
        tally = _Tally(names)
        for i, name in enumerate(live):
            tally.add(
                name, _decode(replies[i * stride]), replies[i * stride + 1 : (i + 1) * stride]
            )
        rest = replies[len(live) * stride :]
        heads, queued = rest[: len(names)], rest[len(names) :]
        for (cls, tenant), n in zip(lanes, queued, strict=True):
            tally.tenants[cls].append((tenant, int(n)))
        classes = {
            cls: self._class_state(cls, listed, extra, stats, head_created, now_ms, tally)
            for cls, (listed, _, stats, _, extra), head_created in zip(
                names, per_class, heads, strict=True
            )
        }
        snap = Snapshot(now_ms=now_ms, classes=classes, workers=tally.workers)
        self.latest = snap
        return snap

    async def _read_classes(self, names: list[str]) -> tuple[int, list[str], list[list[Any]]]:
        """Redis time, live worker names, and per class [records listed, head id,
        [sum, weight], tenants with a fair-share lane, the chunks' extra items]."""
        pipe = self.client.pipeline(transaction=False)
        pipe.time()
        pipe.zrange(keys.WORKERS, 0, -1, withscores=True)
        for cls in names:
            pipe.llen(keys.queue(cls))
            pipe.lindex(keys.queue(cls), 0)
            pipe.hmget(keys.stats(cls), "sum", "weight")
            pipe.zrange(keys.lanes(cls), 0, -1)
            pipe.get(keys.queued_extra(cls))
        replies = await pipe.execute()
        now_ms = replies[0][0] * 1000 + replies[0][1] // 1000
        live = [m.decode() for m, deadline in replies[1] if deadline > now_ms]
        return now_ms, live, [replies[2 + 5 * i : 7 + 5 * i] for i in range(len(names))]

    def _class_state(
        self,
        cls: str,
        listed: int,
        extra: Any,
        stats: list[Any],
        head_created: Any,
        now_ms: int,
        tally: _Tally,
    ) -> ClassState:
        total, weight = (float(v) if v else 0.0 for v in stats)
        # Items, as admission counts them: the records plus the chunks' extra items (an
        # empty list holds none; submit.lua resets what a lost record left behind).
        depth = int(listed) + max(int(extra or 0), 0) if int(listed) else 0
        oldest = (now_ms - int(head_created)) / 1000 if head_created else None
        return ClassState(
            name=cls,
            config=self.settings.classes[cls],
            depth=depth,
            running=tally.running[cls],
            workers=tally.serving[cls],
            busy_workers=tally.busy[cls],
            oldest_wait_s=round(max(oldest, 0.0), 3) if oldest is not None else None,
            run_s=total / weight if weight > 0 else self.settings.default_run_s,
            measured=weight > 0,
            capacities=tuple(tally.capacities[cls]),
            tenants=tuple(tally.tenants[cls]),
        )

    async def cached(self) -> Snapshot:
        """The snapshot the maintenance loop keeps fresh (one heartbeat old at most)."""
        return self.latest or await self.snapshot()
