"""Placement by GPU memory with real worker processes on fake cards of different sizes
(the fake pynvml: a 24 GiB card and an 80 GiB one): a task that needs more than a card
holds never runs there, one no live card could hold is refused at admission, one that
does not fit the memory free right now waits until it does."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from conftest import WorkerFactory, submit, wait_status
from support.pdf import make_pdf

from dispatcher.api.store import Submission, fingerprint
from dispatcher.contract import keys
from dispatcher.contract.settings import Settings
from testkit import fake_gpu_env, wait_for

GIB_MB = 1024
SMALL, LARGE = 24 * GIB_MB, 80 * GIB_MB  # card totals in MB


def _workers(http: httpx.Client) -> dict[str, dict[str, Any]]:
    return {w["name"]: w for w in http.get("/workers").json()["workers"]}


@pytest.fixture
def switches(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def cards(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory, switches: Path
) -> tuple[str, str]:
    """Worker "small" on the 24 GiB card, "large" on the 80 GiB one; both serving."""
    env = fake_gpu_env(2, switches=switches, memory_gib=[24, 80])
    start_worker("small", extra=["--gpu", "0"], env=env)
    start_worker("large", extra=["--gpu", "1", "--speed", "2"], env=env)
    return "small", "large"


def test_a_task_too_big_for_a_card_never_runs_there(
    cards: tuple[str, str], http: httpx.Client
) -> None:
    listed = _workers(http)
    assert listed["small"]["gpu_capacity_mb"] == SMALL  # no models loaded: the whole card
    assert listed["large"]["gpu_capacity_mb"] == LARGE
    assert (listed["small"]["speed"], listed["large"]["speed"]) == (1.0, 2.0)  # as declared
    # The large card busy with a long task only it can hold; the small card takes the
    # rest, test.big too: its 100 MB request overrides the 30,000 MB it declares.
    long = submit(http, "sleep", {"seconds": 60}, gpu_memory_mb=30_000)["id"]
    assert wait_status(http, long, {"running"})["worker"] == "large"
    small_ids = [submit(http, "sleep", {"seconds": 0})["id"] for _ in range(3)]
    small_ids.append(submit(http, "test.big", gpu_memory_mb=100)["id"])  # asks for less
    for task_id in small_ids:
        assert wait_status(http, task_id, {"succeeded"})["worker"] == "small"
    assert http.delete(f"/tasks/{long}").status_code == 202  # a cancel request
    wait_status(http, long, {"canceled"})
    # Tasks of a type that declares 30,000 MB, mixed with tasks any card can run.
    ids = []
    for _ in range(4):
        ids.append(("big", submit(http, "test.big", {"seconds": 0.05})["id"]))
        ids.append(("any", submit(http, "sleep", {"seconds": 0.05})["id"]))
    for kind, task_id in ids:
        record = wait_status(http, task_id, {"succeeded"})
        if kind == "big":
            assert record["worker"] == "large"  # never the 24 GiB card
            assert record["gpu_memory_mb"] == 30_000  # the type's declaration


def test_a_task_no_live_card_could_hold_is_refused(
    cards: tuple[str, str], http: httpx.Client, r: redis.Redis
) -> None:
    response = http.post("/tasks", json={"type": "sleep", "gpu_memory_mb": LARGE + 1})
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["error"] == "no_workers"
    assert body["largest_gpu_memory_mb"] == LARGE and body["gpu_memory_mb"] == LARGE + 1
    assert "GPU" in body["message"] and response.headers["Retry-After"] == "5"
    # More than any card could have (max_gpu_memory_mb): not retryable.
    response = http.post("/tasks", json={"type": "sleep", "gpu_memory_mb": 10**7})
    assert response.status_code == 422 and "max_gpu_memory_mb" in response.json()["message"]
    one = http.post("/tasks", json={"type": "sleep", "gpu_memory_mb": 1200.0})
    assert one.status_code == 202  # an integer-valued number, as JSON Schema counts it
    assert http.get(f"/tasks/{one.json()['id']}").json()["gpu_memory_mb"] == 1200
    for bad in (-1, 1.5, "many", True, 1e300):
        response = http.post("/tasks", json={"type": "sleep", "gpu_memory_mb": bad})
        assert response.status_code == 422, bad
    assert len(list(r.scan_iter(keys.job("*")))) == 1  # only the valid one was accepted


def test_a_task_waits_while_the_card_is_full_and_runs_once_it_frees(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory, switches: Path
) -> None:
    env = fake_gpu_env(2, switches=switches, memory_gib=[24, 80])
    start_worker("large", extra=["--gpu", "1"], env=env)
    (switches / "used-1").write_text(str(79_000))  # another process fills the card
    wait_for(
        lambda: _workers(http)["large"]["device"]["memory_used_bytes"] == 79_000 * 2**20,
        10,
        what="the worker to sample the fuller card",
    )
    big = submit(http, "test.big")["id"]  # fits the card, not what is free on it now
    small = submit(http, "sleep", {"seconds": 0})["id"]
    # The worker looked at the queue (it took the task behind) and left the big one.
    assert wait_status(http, small, {"succeeded"})["worker"] == "large"
    assert http.get(f"/tasks/{big}").json()["status"] == "queued"
    (switches / "used-1").unlink()  # the other process let go
    assert wait_status(http, big, {"succeeded"}, timeout_s=20)["worker"] == "large"


def test_a_cpu_worker_has_no_gpu_memory_limit(
    known_types: None, http: httpx.Client, start_worker: WorkerFactory
) -> None:
    start_worker("cpu")
    assert _workers(http)["cpu"]["gpu_capacity_mb"] is None
    task_id = submit(http, "test.big", gpu_memory_mb=200_000)["id"]
    assert wait_status(http, task_id, {"succeeded"})["worker"] == "cpu"


def test_gpu_memory_in_a_multipart_submit_and_its_limits(
    known_types: None, http: httpx.Client, r: redis.Redis
) -> None:
    pdf = make_pdf(["placement"])
    files = {"file": ("a.pdf", pdf, "application/pdf")}
    accepted = http.post("/tasks", files=files, data={"gpu_memory_mb": "1200"})
    assert accepted.status_code == 202, accepted.text
    record = http.get(f"/tasks/{accepted.json()['id']}").json()
    assert record["gpu_memory_mb"] == 1200  # read back as accepted
    for bad in ("²", "12²", "٣", "-1", "1.5", "9" * 13):  # digits int() takes, but not ASCII
        refused = http.post("/tasks", files=files, data={"gpu_memory_mb": bad})
        assert refused.status_code == 422, (bad, refused.text)
    assert r.llen(keys.queue("batch")) == 1


def test_an_idempotency_key_tells_gpu_memory_apart(known_types: None, http: httpx.Client) -> None:
    key = {"Idempotency-Key": "placement-1"}
    first = http.post("/tasks", json={"type": "sleep", "gpu_memory_mb": 1000}, headers=key)
    assert first.status_code == 202
    again = http.post("/tasks", json={"type": "sleep", "gpu_memory_mb": 1000}, headers=key)
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    other = http.post("/tasks", json={"type": "sleep", "gpu_memory_mb": 5000}, headers=key)
    assert other.status_code == 422 and other.json()["error"] == "idempotency_key_reused"


def test_the_fingerprint_takes_what_the_request_said_not_the_declaration() -> None:
    """A retry sent without gpu_memory_mb is the same request even if its type's
    declared memory changed meanwhile (a worker republished the catalog)."""
    before = Submission("sleep", "batch", {}, 60.0, "t", gpu_memory_mb=0)
    after = dataclasses.replace(before, gpu_memory_mb=2000)  # the new declaration
    assert fingerprint(before) == fingerprint(after)
    asked = dataclasses.replace(before, gpu_memory_mb=2000, gpu_memory_asked=2000)
    assert fingerprint(asked) != fingerprint(after)


def test_catalog_declarations_are_checked(
    known_types: None, r: redis.Redis, settings: Settings, api_factory: Any
) -> None:
    schema = {"type": "object"}
    r.hset(keys.CATALOG, "test.lots", json.dumps({"schema": schema, "gpu_memory_mb": "lots"}))
    r.hset(keys.CATALOG, "test.huge", json.dumps({"schema": schema, "gpu_memory_mb": 10**7}))
    with httpx.Client(base_url=api_factory(settings).url, timeout=10) as http:
        malformed = http.post("/tasks", json={"type": "test.lots"})
        assert malformed.status_code == 422  # the entry is ignored: an unknown type, not a 500
        assert malformed.json()["error"] == "unknown_task_type"
        unknown = http.post("/tasks", json={"type": "no.such"})
        assert unknown.status_code == 422 and "test.lots" not in unknown.json()["known"]
        huge = http.post("/tasks", json={"type": "test.huge"})
        assert huge.status_code == 422 and "no card" in huge.json()["message"]
        # The same rule for /v1/embeddings, whose tasks take the type's declaration.
        entry = {"schema": schema, "gpu_memory_mb": 10**7, "model": "test/huge-model"}
        r.hset(keys.CATALOG, "test.huge_model", json.dumps(entry))
        body = {"model": "test/huge-model", "input": "x"}
        embedded = http.post("/v1/embeddings", json=body)
        assert embedded.status_code == 422 and "no card" in embedded.text, embedded.text
