"""Replaying one trace on time through several systems at once, shared by the
balancing and mixed-speed scenarios.

A :class:`System` is one dispatch policy on a private stack: ``pull`` (gpulane: one
shared class queue, a free worker claims) or a push router of
:class:`bench.hetero.Router` (``rr``, ``lc``, ``ll``: each worker serves a class of its
own, the router picks it when the task arrives), the same router the zero-overhead
models use. Both scenarios build theirs from it, so what differs between a measured
policy and its model is only the real system's overhead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import redis

from bench import hetero
from bench import trace as tr
from bench.glside import Submitter, gl_done, records
from bench.harness import Stack, classes_json
from dispatcher.contract import keys
from testkit import wait_for

__all__ = ["System", "replay_systems", "started"]


class System:
    """One system under test: its stack, its workers and its routing policy.

    ``env`` adds variables to each worker's environment (per worker, in order).
    """

    def __init__(
        self,
        kind: str,
        stack: Stack,
        names: list[str],
        task: str,
        env: Sequence[dict[str, str]] | None = None,
    ) -> None:
        self.kind = kind
        self.stack = stack
        self.names = names
        self.workers = len(names)
        self.task = task
        self.env = env or [{} for _ in names]
        self.classes = ["batch"] if kind == "pull" else [f"w{k}" for k in range(self.workers)]
        self.client: redis.Redis = stack.client()
        self.submitter = Submitter(self.client, self.classes, self.workers)
        self.router: hetero.Router | None = None
        self.pending: list[tuple[str, int]] = []  # lowest latency: routed, not seen to end
        self.reset()

    def reset(self) -> None:
        """A fresh router (round-robin pointer, latency estimates), nothing pending."""
        self.router = None if self.kind == "pull" else hetero.Router(self.kind, self.workers)
        self.pending = []

    def start(self) -> None:
        procs = []
        config = classes_json(self.classes)
        for k, name in enumerate(self.names):
            serve = None if self.kind == "pull" else [self.classes[k]]
            env = self.stack.env(classes=config, default_class=self.classes[0])
            env.update(self.env[k])
            procs.append(self.stack.spawn(name, self.stack.worker_argv(name, serve), env))
        for proc in procs:
            self.stack.wait_registered(proc)

    def _outstanding(self) -> list[int]:
        """Per worker: its queue's length plus its in-flight tasks, read now."""
        pipe = self.client.pipeline(transaction=False)
        for k, name in enumerate(self.names):
            pipe.llen(keys.queue(self.classes[k]))
            pipe.llen(keys.inflight(name, self.classes[k]))
        lens = pipe.execute()
        return [lens[2 * k] + lens[2 * k + 1] for k in range(self.workers)]

    def _observe(self, router: hetero.Router) -> None:
        """Feed the router the latency of every routed task that ended since, in order."""
        if not self.pending:
            return
        pipe = self.client.pipeline(transaction=False)
        for task_id, _ in self.pending:
            pipe.hmget(keys.job(task_id), "created_ms", "ended_ms")
        ended, still = [], []
        for (task_id, k), (created, end) in zip(self.pending, pipe.execute(), strict=True):
            if end:
                ended.append((int(end), k, (int(end) - int(created)) / 1000))
            else:
                still.append((task_id, k))
        for _, k, latency in sorted(ended):
            router.observe(k, latency)
        self.pending = still

    def route(self) -> int:
        """The worker (its queue) for the task arriving now; -1: the shared queue."""
        if self.router is None:
            return -1
        if self.kind == "lc":
            return self.router.choose(self._outstanding())
        if self.kind == "ll":
            self._observe(self.router)
        return self.router.choose()

    def submit(self, seconds: float) -> tuple[str, int]:
        """Submit a task of ``seconds``; its id and the queue it went to (-1: shared)."""
        k = self.route()
        task_id = self.submitter.submit(self.task, {"seconds": seconds}, self.classes[max(k, 0)])
        if self.kind == "ll":
            self.pending.append((task_id, k))
        return task_id, k


@contextmanager
def started(kinds: Sequence[str], make: Callable[[str, Stack], System]) -> Iterator[list[System]]:
    """One fresh stack per kind, ``make(kind, stack)``'s system on each, all started;
    every stack stops when the block ends."""
    with ExitStack() as exits:
        stacks = [exits.enter_context(Stack()) for _ in kinds]
        systems = [make(k, s) for k, s in zip(kinds, stacks, strict=True)]
        for system in systems:
            system.start()
        yield systems


def _replay(system: System, trace: tr.Trace, t0: float, out: dict[str, Any]) -> None:
    sent = []
    for arrival, service in zip(trace.arrivals, trace.services, strict=True):
        delay = t0 + arrival - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sent.append(system.submit(service))
    out[system.kind] = sent


def _tasks(system: System, sent: list[tuple[str, int]]) -> list[tr.Task]:
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
    systems: Sequence[System], trace: tr.Trace, limit_s: float
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
