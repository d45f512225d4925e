"""Replaying one trace on time through several systems at once, shared by the
balancing and mixed-speed scenarios: each system only needs to route and submit."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import redis

from bench import trace as tr
from bench.glside import gl_done, records
from testkit import wait_for

__all__ = ["Replayable", "replay_systems"]


class Replayable(Protocol):
    kind: str
    client: redis.Redis
    names: list[str]

    def submit(self, seconds: float) -> tuple[str, int]:
        """Submit a task of ``seconds``; its id and the queue it went to (-1: shared)."""
        ...


def _replay(system: Replayable, trace: tr.Trace, t0: float, out: dict[str, Any]) -> None:
    sent = []
    for arrival, service in zip(trace.arrivals, trace.services, strict=True):
        delay = t0 + arrival - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sent.append(system.submit(service))
    out[system.kind] = sent


def _tasks(system: Replayable, sent: list[tuple[str, int]]) -> list[tr.Task]:
    rows = records(system.client, [task_id for task_id, _ in sent])
    t0 = min(r["created_ms"] for r in rows)
    return [
        tr.Task(
            created=(r["created_ms"] - t0) / 1000,
            started=(r["started_ms"] - t0) / 1000,
            ended=(r["ended_ms"] - t0) / 1000,
            worker=system.names.index(r["worker"]),
            queue=k,
        )
        for r, (_, k) in zip(rows, sent, strict=True)
    ]


def replay_systems(
    systems: Sequence[Replayable], trace: tr.Trace, limit_s: float
) -> dict[str, list[tr.Task]]:
    """Replay ``trace`` through every system at once, each on its own thread; their
    tasks (Redis clock) once all have ended, waiting at most ``limit_s`` per system."""
    sent: dict[str, Any] = {}
    t0 = time.monotonic() + 0.1
    threads = [
        threading.Thread(target=_replay, args=(system, trace, t0, sent)) for system in systems
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out = {}
    for system in systems:
        ids = [task_id for task_id, _ in sent[system.kind]]
        wait_for(lambda: gl_done(system.client, ids), limit_s, "the trace", interval_s=0.1)  # noqa: B023
        out[system.kind] = _tasks(system, sent[system.kind])
    return out
