"""GET /metrics over real HTTP with real workers: docs/design.md's names, Prometheus' own
parser and promtool, counters and histograms that follow real tasks, pool gauges.

Workers and the API flush their counts every heartbeat (0.2 s here), so every check
waits on a condition with a deadline.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import httpx
import pytest
import redis
from conftest import WorkerFactory, make_settings, submit, wait_status
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from support.catalog import tenant
from support.observe import Scrape, fake_gpu_worker, promtool_check, scrape

from dispatcher.api.exporter import Histogram, parse
from dispatcher.api.stats import LatencyWindow, quantile
from dispatcher.contract import keys
from dispatcher.contract.metrics import BUCKETS, Recorder
from dispatcher.contract.reap import Reaped, record_reaped
from dispatcher.contract.settings import ClassConfig, Settings
from testkit import ApiServer, wait_for

COUNTERS = {
    "gpulane_tasks_submitted": ("class", "type"),
    "gpulane_tasks_rejected": ("class", "reason"),
    "gpulane_tasks_finished": ("class", "type", "status"),
    "gpulane_tasks_requeued": ("class", "reason"),
    "gpulane_reports_fenced": ("report",),
    "gpulane_tokens": ("tenant", "model", "kind"),
    "gpulane_device_seconds": ("tenant", "class", "type"),
}
GAUGES = {
    "gpulane_queue_depth",
    "gpulane_tasks_running",
    "gpulane_tenant_queued_tasks",
    "gpulane_workers",
    "gpulane_gpu_utilization_ratio",
    "gpulane_gpu_memory_used_bytes",
    "gpulane_gpu_memory_total_bytes",
    "gpulane_gpu_temperature_celsius",
    "gpulane_gpu_power_watts",
    "gpulane_class_workers",
    "gpulane_redis_up",
    "gpulane_redis_memory_used_bytes",
    "gpulane_redis_maxmemory_bytes",
    "gpulane_model_load_seconds",
}
HISTOGRAMS = {
    "gpulane_queue_wait_seconds": ("class",),
    "gpulane_task_run_seconds": ("class", "type"),
    "gpulane_task_latency_seconds": ("class",),
    "gpulane_batch_size": ("type",),
    "gpulane_time_to_first_token_seconds": ("backend",),
    "gpulane_time_between_tokens_seconds": ("backend",),
    "gpulane_backend_tokens_per_second": ("backend",),
}
GiB = 2**30


def wait_scrape(http: httpx.Client, check: Callable[[Scrape], bool], what: str) -> Scrape:
    def attempt() -> Scrape | None:
        result = scrape(http)
        return result if check(result) else None

    found: Scrape = wait_for(attempt, 15, interval_s=0.1, what=what)
    return found


def assert_histogram(result: Scrape, name: str, count: int, **labels: str) -> None:
    """Cumulative, monotonic, one bucket per standard bound, +Inf == _count == count."""
    buckets = result.buckets(name, **labels)
    assert [le for le, _ in buckets] == list(BUCKETS), buckets
    values = [n for _, n in buckets]
    assert values == sorted(values), f"{name}{labels} buckets are not cumulative: {values}"
    assert values[-1] == count == result.value(f"{name}_count", **labels)
    total = result.value(f"{name}_sum", **labels)
    assert total is not None and total >= 0


@pytest.fixture
def limited(redis_url: str) -> Settings:
    """Interactive refuses without workers (the default); batch holds one task."""
    return make_settings(
        redis_url,
        classes={
            "interactive": ClassConfig(max_queued=50, max_wait_s=30, reject_without_workers=True),
            "batch": ClassConfig(max_queued=1, max_wait_s=3600),
        },
    )


def _seed_every_series(r: redis.Redis) -> None:
    """One sample of every counter and histogram in the pool-wide hash, so the label
    checks below have samples to look at (a fresh pool has none of most)."""
    recorder = Recorder()
    recorder.count("submitted", "batch", "echo")
    recorder.count("rejected", "batch", "queue_full")
    recorder.count("finished", "batch", "echo", "succeeded")
    recorder.count("requeued", "batch", "worker_lost")
    recorder.count("fenced", "finish")
    recorder.observe("queue_wait", 0.2, "batch")
    recorder.observe("run", 0.3, "batch", "echo")
    recorder.observe("latency", 0.5, "batch")
    recorder.observe("batch_size", 3, "embed")
    recorder.count("tokens", "default", "tiny-llama", "completion", n=7)
    recorder.observe("ttft", 0.02, "http://127.0.0.1:8000")
    recorder.observe("tbt", 0.004, "http://127.0.0.1:8000")
    recorder.observe("tokens_per_s", 120.0, "http://127.0.0.1:8000")
    drained = recorder.drain()
    for field, n in drained.counters.items():
        r.hincrby(keys.METRICS, field, n)
    for field, x in drained.floats.items():
        r.hincrbyfloat(keys.METRICS, field, x)
    # Device time comes in with a heartbeat (heartbeat.lua), as a float counter.
    r.hincrbyfloat(keys.METRICS, "c|device|default|batch|echo", 0.25)


def test_names_format_and_promtool(
    known_types: None, http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory
) -> None:
    start_worker()  # for worker and GPU-less device gauges
    _seed_every_series(r)
    result = wait_scrape(
        http,
        lambda s: s.value("gpulane_workers", state="idle") == 1,
        "the worker in the gauges",
    )
    for name, labels in COUNTERS.items():
        samples = result.families[name].samples
        assert result.families[name].type == "counter"
        assert samples and all(set(s.labels) == set(labels) for s in samples), name
    for name in ("gpulane_queue_depth", "gpulane_tasks_running"):
        samples = result.families[name].samples
        assert samples and all(set(s.labels) == {"class"} for s in samples), name
    assert {s.labels["state"] for s in result.families["gpulane_workers"].samples} >= {"idle"}
    for name in GAUGES:
        assert result.families[name].type == "gauge"
    for name, labels in HISTOGRAMS.items():
        samples = result.families[name].samples
        assert result.families[name].type == "histogram"
        assert samples and all(set(s.labels) - {"le"} == set(labels) for s in samples), name
    ours = {n for n in result.families if n.startswith("gpulane_")}
    assert ours == set(COUNTERS) | GAUGES | set(HISTOGRAMS)
    # The API's own process metrics come along.
    assert result.value("process_resident_memory_bytes")
    assert "python_info" in result.families

    checked = promtool_check(result.text)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.strip() == "", checked.stdout  # no lint findings either


def test_counters_and_histograms_follow_tasks(
    known_types: None,
    limited: Settings,
    api_factory: Callable[[Settings], ApiServer],
    start_worker: WorkerFactory,
) -> None:
    api = api_factory(limited)
    with httpx.Client(base_url=api.url, timeout=10) as http:
        refused = http.post("/tasks", json={"type": "echo", "class": "interactive"})
        assert refused.status_code == 503 and refused.json()["error"] == "no_workers"
        queued = submit(http, "sleep", {"seconds": 0.3}, cls="batch")
        full = http.post("/tasks", json={"type": "echo", "class": "batch"})
        assert full.status_code == 503 and full.json()["error"] == "queue_full"

        before = wait_scrape(
            http,
            lambda s: (
                s.value("gpulane_tasks_rejected_total", **{"class": "batch"}, reason="queue_full")
                == 1
                and s.value(
                    "gpulane_tasks_rejected_total", **{"class": "interactive"}, reason="no_workers"
                )
                == 1
            ),
            "both refusals to be counted",
        )
        assert (
            before.value("gpulane_tasks_submitted_total", **{"class": "batch"}, type="sleep") == 1
        )
        assert before.value("gpulane_queue_depth", **{"class": "batch"}) == 1
        assert before.value("gpulane_workers", state="idle") == 0

        start_worker()
        wait_status(http, queued["id"], {"succeeded"})
        ids = [submit(http, "echo", cls="interactive")["id"] for _ in range(3)]
        ids.append(submit(http, "test.fail", cls="interactive")["id"])
        for task_id in ids:
            wait_status(http, task_id, {"succeeded", "failed"})

        def finished(s: Scrape, type_: str, status: str) -> float | None:
            labels = {"class": "interactive", "type": type_, "status": status}
            return s.value("gpulane_tasks_finished_total", **labels)

        after = wait_scrape(
            http,
            lambda s: (
                finished(s, "echo", "succeeded") == 3
                and finished(s, "test.fail", "failed") == 1
                and s.value("gpulane_task_latency_seconds_count", **{"class": "batch"}) == 1
            ),
            "the finished tasks to be counted",
        )
        # Every label set ever recorded stays exported (the refusals above included).
        assert after.value(
            "gpulane_tasks_rejected_total", **{"class": "batch"}, reason="queue_full"
        )
        assert (
            after.value(
                "gpulane_tasks_finished_total",
                **{"class": "batch"},
                type="sleep",
                status="succeeded",
            )
            == 1
        )
        assert_histogram(after, "gpulane_task_latency_seconds", 4, **{"class": "interactive"})
        assert_histogram(after, "gpulane_queue_wait_seconds", 4, **{"class": "interactive"})
        assert_histogram(
            after, "gpulane_task_run_seconds", 3, **{"class": "interactive"}, type="echo"
        )
        assert_histogram(after, "gpulane_task_run_seconds", 1, **{"class": "batch"}, type="sleep")
        # The sleep ran at least 0.3 s: its run time fell at or above the 0.25 s bucket.
        run = dict(after.buckets("gpulane_task_run_seconds", **{"class": "batch"}, type="sleep"))
        assert run[0.25] == 0 and run[0.5] + run[1.0] >= 1
        assert (
            after.value("gpulane_task_run_seconds_sum", **{"class": "batch"}, type="sleep") >= 0.3
        )
        assert (
            after.value("gpulane_tasks_requeued_total", **{"class": "batch"}, reason="worker_lost")
            is None
        )

        checked = promtool_check(after.text)
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_pool_gauges(http: httpx.Client, r: redis.Redis, start_worker: WorkerFactory) -> None:
    start_worker()
    fake_gpu_worker(r, "gpu-sim", utilization=0.42, used_bytes=12 * GiB, total_bytes=80 * GiB)
    running = submit(http, "sleep", {"seconds": 30})
    wait_status(http, running["id"], {"running"})
    queued = [submit(http, "echo") for _ in range(2)]

    result = wait_scrape(
        http,
        lambda s: (
            s.value("gpulane_queue_depth", **{"class": "batch"}) == 2
            and s.value("gpulane_tasks_running", **{"class": "batch"}) == 1
            # the worker publishes its state with its next heartbeat
            and s.value("gpulane_workers", state="busy") == 1
        ),
        "the queue, the running task and the busy worker",
    )
    assert result.value("gpulane_queue_depth", **{"class": "interactive"}) == 0
    assert result.value("gpulane_tasks_running", **{"class": "interactive"}) == 0
    assert result.value("gpulane_workers", state="idle") == 1  # the simulated GPU worker
    assert result.value("gpulane_workers", state="starting") == 0
    gpu = {"worker": "gpu-sim", "gpu": "0"}
    assert result.value("gpulane_gpu_utilization_ratio", **gpu) == pytest.approx(0.42)
    assert result.value("gpulane_gpu_memory_used_bytes", **gpu) == 12 * GiB
    assert result.value("gpulane_gpu_memory_total_bytes", **gpu) == 80 * GiB
    # A cpu worker has no GPU: it is counted as a worker, never as a zero GPU.
    assert {s["worker"] for s in result.series("gpulane_gpu_memory_total_bytes")} == {"gpu-sim"}

    for task in (running, *queued):
        http.delete(f"/tasks/{task['id']}")


def test_openmetrics_when_asked(http: httpx.Client) -> None:
    response = http.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")
    names = {f.name for f in openmetrics_families(response.text)}
    assert {"gpulane_queue_depth", "gpulane_tasks_submitted", "gpulane_task_run_seconds"} <= names


def test_metrics_needs_an_admin_key_when_keys_are_set(
    redis_url: str, api_factory: Callable[[Settings], ApiServer]
) -> None:
    settings = make_settings(
        redis_url, tenants=[tenant("ops", "ops-key", admin=True), tenant("acme", "acme-key")]
    )
    api = api_factory(settings)
    with httpx.Client(base_url=api.url, timeout=10) as http:
        assert http.get("/metrics").status_code == 401
        denied = http.get("/metrics", headers={"Authorization": "Bearer acme-key"})
        assert denied.status_code == 404 and denied.json()["error"] == "not_found"
        scraped = scrape(http, Authorization="Bearer ops-key")
        assert "gpulane_queue_depth" in scraped.families


# ---- the pieces, without servers ----


def test_parse_cumulates_buckets_and_skips_foreign_fields() -> None:
    recorder = Recorder()
    for seconds in (0.001, 0.02, 0.02, 7.0, 9999.0):
        recorder.observe("latency", seconds, "batch")
    recorder.count("submitted", "batch", "echo", n=5)
    drained = recorder.drain()
    raw: dict[bytes | str, bytes | str] = {k: str(v) for k, v in drained.counters.items()}
    raw.update({k: repr(v) for k, v in drained.floats.items()})
    raw["c|from_a_newer_version|x"] = "3"  # unknown metric: skipped, not a crash
    raw["c|submitted|too|many|labels"] = "1"
    raw["h|latency|batch|not-a-number"] = "1"

    recorded = parse(raw)
    assert recorded.counters["submitted"] == {("batch", "echo"): 5.0}
    hist = recorded.histograms["latency"][("batch",)]
    cumulative = dict(hist.cumulative())
    assert cumulative[0.005] == 1 and cumulative[0.025] == 3 and cumulative[10.0] == 4
    assert cumulative[7200.0] == 4 and cumulative[math.inf] == 5 == hist.count
    assert hist.sum == pytest.approx(0.001 + 0.04 + 7.0 + 9999.0)


def test_quantile_matches_histogram_quantile() -> None:
    # 10 observations in (0.1, 0.25], 10 in (0.25, 0.5]: the median is the 0.25 bound.
    hist = Histogram({0.25: 10, 0.5: 10})
    assert quantile(0.5, hist.cumulative()) == pytest.approx(0.25)
    assert quantile(0.75, hist.cumulative()) == pytest.approx(0.375)
    assert quantile(0.99, Histogram({math.inf: 3}).cumulative()) == 7200.0
    assert quantile(0.5, Histogram().cumulative()) is None


def test_latency_window_reports_recent_tasks_only() -> None:
    window = LatencyWindow(span_s=300, spacing_s=5)
    old = {"batch": Histogram({10.0: 100})}
    assert window.since(0.0, old) is None  # nothing to compare with yet
    assert window.since(1.0, old) == ({"batch": Histogram({10.0: 0})}, 1.0)
    newer = {"batch": Histogram({10.0: 100, 0.01: 4}, 0.03)}
    recent, age = window.since(200.0, newer) or ({}, 0.0)
    assert age == 200.0 and recent["batch"].count == 4
    assert quantile(0.99, recent["batch"].cumulative()) <= 0.01
    # Samples older than the span are dropped; a Redis reset starts over.
    recent, age = window.since(400.0, newer) or ({}, 0.0)
    assert age == 200.0 and recent["batch"].count == 0
    assert window.since(401.0, {"batch": Histogram({0.01: 1})}) is None


def test_tasks_ended_without_a_worker_report_are_counted(
    known_types: None, http: httpx.Client
) -> None:
    """A queued task canceled by the API never reaches a worker: the API counts it."""
    task = submit(http, "echo", cls="batch")
    assert http.delete(f"/tasks/{task['id']}").status_code == 200
    labels = {"class": "batch", "type": "echo", "status": "canceled"}
    wait_scrape(
        http,
        lambda s: s.value("gpulane_tasks_finished_total", **labels) == 1,
        "the canceled task to be counted",
    )


def test_reaped_tasks_count_by_outcome() -> None:
    """What a reaper pass ended counts as finished; only requeued ones as requeued."""
    recorder = Recorder()
    record_reaped(
        [
            Reaped("a", "batch", "sleep", "requeued"),
            Reaped("b", "batch", "sleep", "failed"),
            Reaped("c", "interactive", "echo", "canceled"),
            Reaped("d", "batch", "-", "gone"),
            Reaped("e", "batch", "embed", "requeued", items=64),  # a chunk counts its items
            Reaped("f", "batch", "embed", "failed", items=3),
        ],
        recorder,
        "test",
    )
    assert recorder.drain().counters == {
        "c|requeued|batch|worker_lost": 65,
        "c|finished|batch|sleep|failed": 1,
        "c|finished|interactive|echo|canceled": 1,
        "c|finished|batch|embed|failed": 3,
    }
