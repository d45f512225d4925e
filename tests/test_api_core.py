"""The core task path over real HTTP with real workers: submit, poll, results."""

from __future__ import annotations

import re

import httpx
import pytest
import redis
from conftest import WorkerFactory, submit, wait_status
from rq.job import Job
from rq.serializers import JSONSerializer
from support.pdf import make_pdf

from dispatcher.contract import keys
from dispatcher.contract.jobs import ENTRY_POINT

RECORD_FIELDS = {
    "id",
    "type",
    "class",
    "status",
    "position",
    "progress",
    "result",
    "error",
    "attempts",
    "worker",
    "device",
    "created_at",
    "started_at",
    "finished_at",
    "queue_wait_s",
    "run_s",
}


def test_echo_round_trip(http: httpx.Client, start_worker: WorkerFactory) -> None:
    start_worker()
    response = http.post(
        "/tasks", json={"type": "echo", "class": "interactive", "args": {"x": [1, 2]}}
    )
    assert response.status_code == 202
    body = response.json()
    assert set(body) == {"id", "status", "type", "class", "position", "estimated_wait_s"}
    assert body["status"] == "queued" and body["type"] == "echo" and body["class"] == "interactive"
    assert response.headers["location"] == f"/tasks/{body['id']}"
    for header in ("gpulane-queue-depth", "gpulane-estimated-wait", "gpulane-pressure"):
        assert header in response.headers

    record = wait_status(http, body["id"], {"succeeded"})
    assert set(record) >= RECORD_FIELDS
    assert record["result"] == {"x": [1, 2]}
    assert record["error"] is None and record["position"] is None
    assert record["attempts"] == 1
    assert record["device"]["kind"] == "cpu"
    assert record["queue_wait_s"] >= 0 and record["run_s"] >= 0
    assert record["created_at"] <= record["started_at"] <= record["finished_at"]


def test_sleep_reports_progress(http: httpx.Client, start_worker: WorkerFactory) -> None:
    start_worker()
    task = submit(http, "sleep", {"seconds": 1.5})
    running = wait_status(http, task["id"], {"running"})
    assert running["worker"] and running["started_at"] and running["finished_at"] is None

    def progressed() -> dict | None:
        record = http.get(f"/tasks/{task['id']}").json()
        return record if record["progress"] and record["progress"]["fraction"] > 0 else None

    from testkit import wait_for

    record = wait_for(progressed, 5, what="progress")
    assert 0 < record["progress"]["fraction"] <= 1 and "slept" in record["progress"]["message"]
    done = wait_status(http, task["id"], {"succeeded"})
    assert done["result"]["slept_s"] >= 1.5
    assert done["progress"]["fraction"] == 1.0


def test_document_extract_multipage_pdf(http: httpx.Client, start_worker: WorkerFactory) -> None:
    start_worker()
    pdf = make_pdf(["Invoice 42", "Terms and conditions", "Signature page"], title="Contract")
    response = http.post("/tasks", files={"file": ("contract.pdf", pdf, "application/pdf")})
    assert response.status_code == 202, response.text
    assert response.json()["type"] == "document.extract"
    assert response.json()["class"] == "batch"
    record = wait_status(http, response.json()["id"], {"succeeded"})
    result = record["result"]
    assert result["pages"] == 3
    assert [p["text"] for p in result["text"]] == [
        "Invoice 42",
        "Terms and conditions",
        "Signature page",
    ]
    assert result["metadata"]["Title"] == "Contract"


def test_multipart_with_type_class_and_args(
    http: httpx.Client, start_worker: WorkerFactory
) -> None:
    start_worker()
    pdf = make_pdf(["one", "two", "three", "four"])
    response = http.post(
        "/tasks",
        files={"file": ("d.pdf", pdf, "application/pdf")},
        data={"type": "document.extract", "class": "interactive", "args": '{"max_pages": 2}'},
    )
    assert response.status_code == 202, response.text
    result = wait_status(http, response.json()["id"], {"succeeded"})["result"]
    assert result["pages"] == 4 and result["extracted_pages"] == 2 and len(result["text"]) == 2


def test_bad_pdf_fails_the_task_not_the_worker(
    http: httpx.Client, start_worker: WorkerFactory
) -> None:
    worker = start_worker()
    response = http.post(
        "/tasks", files={"file": ("notes.pdf", b"this is not a pdf", "application/pdf")}
    )
    record = wait_status(http, response.json()["id"], {"failed"})
    assert record["error"]["code"] == "invalid_document"
    assert (
        "notes.pdf" in record["error"]["message"]
        and "not a readable PDF" in record["error"]["message"]
    )
    assert worker.alive()
    follow_up = submit(http, "echo", {"still": "alive"})
    assert wait_status(http, follow_up["id"], {"succeeded"})["result"] == {"still": "alive"}


def test_handler_exception_fails_task_with_message(
    http: httpx.Client, start_worker: WorkerFactory
) -> None:
    worker = start_worker()
    plain = submit(http, "test.fail", {"message": "kaput"})
    coded = submit(http, "test.fail", {"code": "model_refused", "message": "too long"})
    assert wait_status(http, plain["id"], {"failed"})["error"] == {
        "code": "task_error",
        "message": "RuntimeError: kaput",
    }
    assert wait_status(http, coded["id"], {"failed"})["error"] == {
        "code": "model_refused",
        "message": "too long",
    }
    assert worker.alive()


def test_job_is_a_real_rq_job(
    http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    start_worker(classes="interactive")  # registers the catalog, never takes batch
    task = submit(http, "sleep", {"seconds": 2}, timeout_s=2.5)
    job = Job.fetch(task["id"], connection=r, serializer=JSONSerializer)
    assert job.timeout == 3  # RQ reads whole seconds; the worker uses the exact 2.5
    assert job.func_name == ENTRY_POINT
    assert job.args == ["sleep", {"seconds": 2}]
    assert job.origin == "batch" and job.get_status() == "queued"
    assert r.lrange(keys.queue("batch"), 0, -1) == [task["id"].encode()]
    assert keys.queue("batch").encode() in r.smembers(keys.RQ_QUEUES)


def test_unknown_task_id_is_404(http: httpx.Client) -> None:
    for method in ("GET", "DELETE"):
        response = http.request(method, "/tasks/does-not-exist")
        assert response.status_code == 404
        assert response.json()["error"] == "not_found"


def test_health_counts_workers(http: httpx.Client, start_worker: WorkerFactory) -> None:
    health = http.get("/health").json()
    assert health.pop("memory")["used_bytes"] > 0
    assert health == {
        "status": "ok",
        "redis": "ok",
        "workers": 0,
        "serving": 0,
    }
    start_worker()
    from testkit import wait_for

    wait_for(lambda: http.get("/health").json()["workers"] == 1, 5, what="health to see the worker")


def test_openapi_docs_served(known_types: None, http: httpx.Client) -> None:
    docs = http.get("/docs")
    assert docs.status_code == 200
    # Swagger UI works offline: every asset the page names is on this origin, and served.
    urls = re.findall(r"""(?:src|href)=["']([^"']+)|url: ?'([^']+)'""", docs.text)
    urls = [a or b for a, b in urls]
    assert len(urls) == 4, docs.text  # css, favicon, js, the spec
    for url in urls:
        assert url.startswith("/") and not url.startswith("//"), url
        asset = http.get(url)
        assert asset.status_code == 200 and len(asset.content) > 100, url
    assert "SwaggerUIBundle" in http.get("/static/swagger-ui-bundle.js").text
    spec = http.get("/openapi.json").json()
    assert {"/tasks", "/tasks/{task_id}", "/queues", "/workers", "/health"} <= set(spec["paths"])
    content = spec["paths"]["/tasks"]["post"]["requestBody"]["content"]
    assert {"application/json", "multipart/form-data"} <= set(content)
    # Every field the API accepts is in the branches (they forbid any other).
    for media, fields in (
        ("application/json", {"type", "class", "args", "timeout_s", "gpu_memory_mb"}),
        ("multipart/form-data", {"file", "type", "class"}),  # text parts: see openapi.py
    ):
        for branch in content[media]["schema"]["oneOf"]:
            assert fields <= set(branch["properties"]), (media, branch["properties"].keys())


@pytest.mark.parametrize("status", ["succeeded", "failed"])
def test_cancel_final_task_is_409(
    http: httpx.Client, start_worker: WorkerFactory, status: str
) -> None:
    start_worker()
    task = submit(http, "echo" if status == "succeeded" else "test.fail")
    wait_status(http, task["id"], {status})
    response = http.delete(f"/tasks/{task['id']}")
    assert response.status_code == 409
    assert response.json()["error"] == "conflict"
