"""Celery peer for the overhead scenario, run by the peers venv (``.venv-peers``, made by
``scripts/bench-peers-venv.sh``; the project itself never installs Celery).

One app, :data:`app`, whose broker and result backend are the same bench Redis
(``BENCH_CELERY_URL``), JSON throughout, ``task_acks_late=True`` and a prefetch of 1;
one task, ``bench.celery.stamp``, a no-op returning the wall-clock time its body began
and the worker's pid, like :func:`bench.rq_tasks.stamp` (same host clock).

- the worker, as :mod:`bench.scenarios.overhead` starts it (:func:`worker_argv`):
  ``celery -A bench.celery_tasks worker --pool solo -c 1 --prefetch-multiplier 1``;
- ``python -m bench.celery_tasks fill N``: enqueue N stamps (one producer connection)
  and print their ids as a JSON list, so the scenario fills the queue without
  importing Celery itself; results are read straight from Redis
  (``celery-task-meta-<id>``, JSON) by :func:`results_keys`' keys.

Types: celery is not installed where mypy runs, so it is imported as ``Any``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

TASK = "bench.celery.stamp"
QUEUE = "celery"
URL = os.environ.get("BENCH_CELERY_URL", "redis://127.0.0.1:6379/0")


def stamp() -> dict[str, Any]:
    """No-op: when the task began (epoch seconds) and which worker process ran it."""
    return {"t": time.time(), "w": os.getpid()}


def make_app(url: str) -> Any:
    celery: Any = importlib.import_module("celery")
    app = celery.Celery("bench", broker=url, backend=url)
    app.conf.update(
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_default_queue=QUEUE,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    app.task(name=TASK)(stamp)
    return app


def worker_argv(venv: Path, name: str) -> list[str]:
    """The ``celery worker`` command line of one solo worker named ``name``."""
    argv = [str(venv / "bin" / "celery"), "-A", "bench.celery_tasks", "worker"]
    argv += ["--pool", "solo", "-c", "1", "--prefetch-multiplier", "1"]
    return [*argv, "-n", f"{name}@%h", "-Q", QUEUE, "-l", "WARNING"]


def results_keys(ids: list[str]) -> list[str]:
    """The result backend's keys for these task ids."""
    return [f"celery-task-meta-{task_id}" for task_id in ids]


def fill(n: int) -> list[str]:
    """Enqueue ``n`` stamps through one producer; their ids."""
    task = app.tasks[TASK]
    ids: list[str] = []
    with app.producer_or_acquire() as producer:
        for _ in range(n):
            ids.append(task.apply_async(producer=producer).id)
    return ids


app: Any = make_app(URL) if importlib.util.find_spec("celery") else None


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "fill":
        sys.exit("usage: python -m bench.celery_tasks fill N")
    print(json.dumps(fill(int(sys.argv[2]))))
