"""Bounded memory per task: a decompression-bomb PDF fails with a clear code before it
is decoded, and a worker left above max_worker_rss_mb after a task exits (status 72,
after reporting the task) and is restarted by `gpulane up`; the pool serves on."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
from support.pdf import make_bomb_pdf, make_pdf
from support.up import Up, up_env

from testkit import REPO, TEST_TASKS, wait_for
from worker.tasks.inflate import check_inflation


def test_inflation_check_measures_decoded_size() -> None:
    assert check_inflation(make_pdf(["a", "b"])) is None
    bomb = make_bomb_pdf(40)
    assert len(bomb) < 100_000
    assert check_inflation(bomb) is None  # within the default limits
    assert check_inflation(bomb, per_stream=32 * 2**20) == "a stream inflates past 32 MiB"
    assert check_inflation(bomb, total=16 * 2**20) is not None


def _final(http: httpx.Client, task_id: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        record: dict[str, Any] = http.get(f"/tasks/{task_id}").json()
        return record if record["status"] in ("succeeded", "failed", "canceled") else None

    result: dict[str, Any] = wait_for(done, 30, what=f"task {task_id} to end")
    return result


def test_bomb_fails_clearly_and_a_bloated_worker_is_recycled(tmp_path: Path) -> None:
    env = up_env(
        tmp_path,
        max_worker_rss_mb=150,
        task_modules=json.dumps(["worker.tasks.builtin", TEST_TASKS]),
    )
    env["PYTHONPATH"] = f"{REPO}:{REPO / 'tests' / 'support'}"
    up = Up(env, "--workers", "1")
    try:
        url = up.url()
        with httpx.Client(base_url=url, timeout=30) as http:
            bomb = make_bomb_pdf(300)  # ~300 KB that decodes to 300 MiB
            doc = http.post("/tasks", files={"file": ("bomb.pdf", bomb, "application/pdf")})
            assert doc.status_code == 202, doc.text
            failed = _final(http, doc.json()["id"])
            assert failed["status"] == "failed"
            assert failed["error"]["code"] == "document_too_large", failed
            (worker,) = http.get("/workers").json()["workers"]

            hog = http.post("/tasks", json={"type": "test.hog", "args": {"mb": 200}}).json()
            record = _final(http, hog["id"])
            assert record["status"] == "succeeded"  # reported before the worker left
            first_pid = record["result"]["pid"]

            def recycled() -> bool:
                return "exited with status 72 (recycled" in up.output()

            wait_for(recycled, 20, what="the worker to recycle itself")
            again = http.post("/tasks", json={"type": "test.hog", "args": {"mb": 1}}).json()
            fresh = _final(http, again["id"])
            assert fresh["status"] == "succeeded"
            assert fresh["result"]["pid"] != first_pid and fresh["result"]["held_mb"] == 1
            assert worker["name"] == fresh["worker"]
    finally:
        assert up.stop() == 0, up.output()
    assert re.search(r"restarted \S+ \(cpu[ )]", up.output()), up.output()
