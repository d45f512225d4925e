"""A fresh deployment takes work before its first worker is ready: the configured task
types are published at API start (or by `gpulane catalog`), from worker code run in a
subprocess with CUDA hidden; a worker is `starting` until its own types are published."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import redis
from conftest import WorkerFactory, make_settings
from redis.asyncio import Redis as AsyncRedis

from dispatcher.api.task_types import Catalog
from dispatcher.contract import keys
from testkit import CLI, REPO, TEST_TASKS, ApiServer, free_port, run_cli, wait_for, worker_env

BUILTIN = {"echo", "sleep", "document.extract"}


def test_a_fresh_api_knows_the_configured_types(
    redis_url: str, r: redis.Redis, api_factory: Callable[..., ApiServer]
) -> None:
    assert r.hlen(keys.CATALOG) == 0  # a fresh Redis, no worker ever ran
    api = api_factory(make_settings(redis_url, catalog_on_start=True))
    with httpx.Client(base_url=api.url, timeout=30) as http:
        batch = http.post("/tasks", json={"type": "sleep", "args": {"seconds": 1}})
        assert batch.status_code == 202, batch.text
        assert batch.json()["status"] == "queued"
        interactive = http.post("/tasks", json={"type": "echo", "class": "interactive"})
        assert interactive.status_code == 503 and interactive.json()["error"] == "no_workers"
        bad = http.post("/tasks", json={"type": "sleep", "args": {"seconds": -1}})
        assert bad.status_code == 422  # the published schema is enforced
        unknown = http.post("/tasks", json={"type": "test.env"})  # not a configured module
        assert unknown.status_code == 422
        assert unknown.json()["error"] == "unknown_task_type"
        assert set(unknown.json()["known"]) == BUILTIN
    assert {k.decode() for k in r.hkeys(keys.CATALOG)} == BUILTIN


def test_catalog_command_publishes_and_refuses_a_broken_module(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    env = worker_env(redis_url)
    done = run_cli("catalog", "--tasks", f"worker.tasks.builtin,{TEST_TASKS}", env=env)
    assert done.returncode == 0, done.stderr
    published = {k.decode() for k in r.hkeys(keys.CATALOG)}
    assert BUILTIN | {"test.env", "test.fail"} <= published
    # The subprocess sees no GPU: CUDA is hidden before task modules load.
    entry = json.loads(r.hget(keys.CATALOG, "sleep") or b"{}")
    assert entry["schema"]["properties"]["seconds"]["maximum"] == 86400

    (tmp_path / "broken_tasks.py").write_text("raise ImportError('needs torch')\n")
    env["PYTHONPATH"] += f":{tmp_path}"
    broken = run_cli("catalog", "--tasks", "broken_tasks", env=env)
    assert broken.returncode == 1
    assert "needs torch" in broken.stderr and "Traceback" not in broken.stderr


GATED = """
import os, time
from worker import task
while not os.path.exists({gate!r}):
    time.sleep(0.02)
@task("test.gated")
def gated(args, ctx):
    return {{"cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}}
"""


def test_a_worker_is_starting_until_its_types_are_published(
    r: redis.Redis, start_worker: WorkerFactory, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    (tmp_path / "gated_tasks.py").write_text(GATED.format(gate=str(gate)))
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'tests' / 'support'}:{tmp_path}"}
    worker = start_worker("gated", wait=False, env=env, extra=["--tasks", "gated_tasks"])
    wait_for(lambda: r.hget(keys.worker("gated"), "state") == b"starting", 20, what="starting")
    assert not r.hexists(keys.CATALOG, "test.gated")
    gate.touch()
    wait_for(lambda: r.hget(keys.worker("gated"), "state") == b"idle", 20, what="idle")
    assert r.hexists(keys.CATALOG, "test.gated") and worker.alive()


COUNTED = """
from pathlib import Path
from worker import task
with open({log!r}, "a") as imports:  # one line per process that imports this module
    imports.write("imported\\n")
@task("test.counted")
def counted(args, ctx):
    return {{}}
"""


def test_api_processes_started_together_publish_the_catalog_once(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    imports = tmp_path / "imports"
    (tmp_path / "counted_tasks.py").write_text(COUNTED.format(log=str(imports)))
    env = worker_env(redis_url, catalog_on_start="true", task_modules='["counted_tasks"]')
    env["PYTHONPATH"] += f":{tmp_path}"
    port = free_port()
    log = tmp_path / "api.log"
    with log.open("w") as out:
        api = subprocess.Popen(
            [*CLI, "api", "--port", str(port), "--workers", "3"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        published = "published the catalog of ['counted_tasks']"
        by_another = "the catalog of ['counted_tasks'] was published by another process of this API"

        def every_process_done() -> bool:
            text = log.read_text()
            return text.count(published) + text.count(by_another) == 3

        wait_for(every_process_done, 60, what="3 API processes to have the catalog")
        text = log.read_text()
        assert text.count(published) == 1 and text.count(by_another) == 2, text
        assert imports.read_text() == "imported\n"  # one catalog subprocess, not three
        assert r.hexists(keys.CATALOG, "test.counted")
        marks = r.keys(keys.catalog_publisher("*", "*"))  # one, for this API's processes
        assert len(marks) == 1 and r.get(marks[0]) == b"done"
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            for _ in range(6):  # whichever process answers knows the type
                reply = http.post("/tasks", json={"type": "test.counted"})
                assert reply.status_code == 202, reply.text
    finally:
        api.terminate()
        api.wait(15)


def test_a_sibling_starting_after_the_publication_reuses_it(
    redis_url: str, r: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Processes of one API start staggered (a loaded machine, a supervisor restarting
    one): a sibling that starts once the publication is done does not run it again."""
    imports = tmp_path / "imports"
    (tmp_path / "counted_tasks.py").write_text(COUNTED.format(log=str(imports)))
    monkeypatch.setenv("PYTHONPATH", f"{REPO}:{tmp_path}")  # the catalog subprocess's path

    async def start_one() -> set[str]:
        client = AsyncRedis.from_url(redis_url)
        catalog = Catalog(client)
        catalog.publish_configured(["counted_tasks"])
        await catalog._published()
        known = set(catalog.types)
        await catalog.close()
        await client.aclose()
        return known

    assert "test.counted" in asyncio.run(start_one())
    assert "test.counted" in asyncio.run(start_one())  # one after the other, same parent
    assert imports.read_text() == "imported\n"
