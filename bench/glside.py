"""Client-side helpers over Redis for both systems under test.

:class:`Submitter` enqueues gpulane tasks exactly as the API's ``TaskStore.submit``
does (one ``submit.lua`` call each, same options and call data) but without HTTP, to
fill queues faster than workers drain them and to replay traces on time. The plain-RQ
helpers enqueue with RQ's own ``Queue`` and JSON serializer.
"""

from __future__ import annotations

import json
from typing import Any

import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from bench.harness import UNLIMITED
from dispatcher.api.store import Submission, submit_options
from dispatcher.contract import keys
from dispatcher.contract.jobs import FINAL_STATUSES, encode_call
from dispatcher.contract.scripts import SyncScripts, source
from dispatcher.contract.settings import Settings

RECORD = ("created_ms", "started_ms", "ended_ms", "worker_name", "status")


class Submitter:
    """gpulane submits through ``submit.lua``, as the API makes them."""

    def __init__(self, client: redis.Redis, classes: list[str], workers: int = 1) -> None:
        self.client = client
        self.classes = classes
        self.workers = workers
        self.scripts = SyncScripts(client)
        self.settings = Settings(classes={c: UNLIMITED for c in classes}, default_class=classes[-1])

    def options(self, task_type: str, cls: str) -> str:
        """``submit.lua``'s options for a task of ``task_type`` in ``cls``."""
        sub = Submission(task_type, cls, {}, timeout_s=600.0, tenant="default")
        return submit_options(sub, UNLIMITED, self.workers, 1.0, self.settings)

    def submit(self, task_type: str, args: dict[str, Any], cls: str) -> str:
        reply = self.scripts.run(
            "submit", self.options(task_type, cls), encode_call(task_type, args), b""
        )
        if reply[0] != b"accepted":
            raise RuntimeError(f"submit refused: {reply!r}")
        return str(reply[1].decode())

    def fill(self, n: int, task_type: str, args: dict[str, Any], cls: str) -> list[str]:
        """Enqueue ``n`` tasks in pipelined batches; returns their ids."""
        script = self.client.register_script(source("submit"))
        data = encode_call(task_type, args)
        ids: list[str] = []
        for start in range(0, n, 500):
            pipe = self.client.pipeline(transaction=False)
            for _ in range(min(500, n - start)):
                script(keys=[], args=[self.options(task_type, cls), data, b""], client=pipe)
            ids += [reply[1].decode() for reply in pipe.execute()]
        return ids


def records(client: redis.Redis, ids: list[str]) -> list[dict[str, Any]]:
    """``created_ms``, ``started_ms``, ``ended_ms`` (ints), ``worker_name``, ``status``."""
    pipe = client.pipeline(transaction=False)
    for task_id in ids:
        pipe.hmget(keys.job(task_id), *RECORD)
    out = []
    for values in pipe.execute():
        raw = dict(zip(RECORD, values, strict=True))
        out.append(
            {
                **{k: int(raw[k]) if raw[k] else None for k in RECORD[:3]},
                "worker": raw["worker_name"].decode() if raw["worker_name"] else None,
                "status": raw["status"].decode() if raw["status"] else None,
            }
        )
    return out


def gl_results(client: redis.Redis, ids: list[str]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for task_id in ids:
        pipe.hget(keys.job(task_id), "result")
    return [json.loads(raw) if raw else None for raw in pipe.execute()]


def gl_done(client: redis.Redis, ids: list[str]) -> bool:
    """True once every task reached a final status."""
    pipe = client.pipeline(transaction=False)
    for task_id in ids:
        pipe.hget(keys.job(task_id), "status")
    return all(s is not None and s.decode() in FINAL_STATUSES for s in pipe.execute())


# -- plain RQ -----------------------------------------------------------------------
RQ_FUNC = "bench.rq_tasks.stamp"


def rq_queue(client: redis.Redis, name: str) -> Queue:
    return Queue(name, connection=client, serializer=JSONSerializer)


def rq_fill(queue: Queue, n: int) -> list[str]:
    ids: list[str] = []
    for start in range(0, n, 500):
        batch = [Queue.prepare_data(RQ_FUNC) for _ in range(min(500, n - start))]
        ids += [job.id for job in queue.enqueue_many(batch)]
    return ids


def rq_results(client: redis.Redis, ids: list[str]) -> list[Any]:
    jobs = Job.fetch_many(ids, connection=client, serializer=JSONSerializer)
    return [job.return_value() if job is not None else None for job in jobs]


def rq_done(client: redis.Redis, ids: list[str]) -> bool:
    pipe = client.pipeline(transaction=False)
    for task_id in ids:
        pipe.hget(f"rq:job:{task_id}", "status")
    return all(s in (b"finished", b"failed") for s in pipe.execute())
