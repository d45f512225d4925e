"""deploy/grafana/gpulane.json against a real Prometheus (Debian's package) scraping a
real gpulane stack: the API, one worker on a (fake-NVML) GPU, tasks run and refused.
Every panel's query must parse and return data with a finite value; the alerting rules
loaded into the same Prometheus must evaluate without errors on the real series."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from conftest import WorkerFactory, make_settings, submit, wait_status

from dispatcher.contract import keys
from dispatcher.contract.metrics import Recorder
from testkit import (
    ApiServer,
    fake_gpu_env,
    free_port,
    http_ok,
    wait_for,
)

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "gpulane.json"
RULES = DEPLOY / "prometheus" / "gpulane.rules.yml"
# Grafana's variables, as Grafana fills them in: "All" classes, and a rate window that
# covers the whole test (each rate sees every task the test ran).
VARIABLES = {"$__rate_interval": "1m", "${class}": ".*", "$class": ".*"}


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _targets() -> list[tuple[str, str]]:
    """(panel title and refId, expression with the variables filled in) for every target."""
    out = []
    for panel in _dashboard()["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, f"{panel['title']}: unknown variable in {expr}"
            out.append((f"{panel['title']} {target['refId']}", expr))
    return out


# --- the dashboard file ----------------------------------------------------------------


def test_dashboard_structure() -> None:
    dashboard = _dashboard()
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] == "gpulane"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["class"]["allValue"] == ".*"
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles))
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]


def test_dashboard_shows_what_the_issue_asks_for() -> None:
    exprs = " ".join(expr for _, expr in _targets())
    for needed in (
        "gpulane_queue_depth",  # queue depth per class
        "histogram_quantile(0.99, max by (class, le) (rate(gpulane_queue_wait_seconds_bucket",
        "histogram_quantile(0.99, max by (class, le) (rate(gpulane_task_latency_seconds_bucket",
        "sum by (reason) (max by (class, reason) (rate(gpulane_tasks_rejected_total",
        "max by (worker, gpu) (gpulane_gpu_utilization_ratio)",  # per GPU, over time
        "max by (worker, gpu) (gpulane_gpu_memory_used_bytes)",
        "max by (state) (gpulane_workers)",
    ):
        assert needed in exprs, needed


# --- a real Prometheus scraping a real stack -------------------------------------------


class Prometheus:
    """/usr/bin/prometheus on a free loopback port, scraping ``target`` every second,
    with the gpulane rules loaded; its data in a temporary folder."""

    def __init__(self, directory: Path, target: str) -> None:
        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed (Debian: apt-get install prometheus)"
        self.port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "gpulane", "static_configs": [{"targets": [target]}]}
            ],
        }  # fmt: skip
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = directory / "prometheus.log"
        self._out = self.log.open("wb")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={directory / 'prometheus.yml'}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=10)

    def ready(self) -> bool:
        assert self.process.poll() is None, self.log.read_text()
        return http_ok("/-/ready", self.http)

    def query(self, expr: str) -> dict[str, Any]:
        data: dict[str, Any] = self.http.get("/api/v1/query", params={"query": expr}).json()
        return data

    def stop(self) -> None:
        self.http.close()
        self.process.terminate()
        self.process.wait(20)
        self._out.close()


@pytest.fixture
def prometheus(
    tmp_path: Path, redis_url: str, known_types: None, maxmemory: int
) -> Iterator[tuple[Prometheus, httpx.Client]]:
    api = ApiServer(make_settings(redis_url)).start()
    server = Prometheus(tmp_path, f"127.0.0.1:{api.url.rsplit(':', 1)[1]}")
    try:
        with httpx.Client(base_url=api.url, timeout=10) as http:
            wait_for(server.ready, 30, interval_s=0.1, what="prometheus to be ready")
            yield server, http
    finally:
        server.stop()
        api.stop()


def _values(answer: dict[str, Any]) -> list[float]:
    """The sample values of an instant query's answer (vector or scalar)."""
    data = answer["data"]
    if data["resultType"] == "scalar":
        return [float(data["result"][1])]
    return [float(sample["value"][1]) for sample in data["result"]]


def _seed_requeues(r: redis.Redis) -> None:
    """A task given back for each reason: the pool-wide counters a lost worker and a GPU
    fault record (dispatcher.reaper.record_reaped), folded in as a heartbeat does."""
    recorder = Recorder()
    recorder.count("requeued", "batch", "worker_lost")
    recorder.count("requeued", "batch", "gpu_fault")
    for field, n in recorder.drain().counters.items():
        r.hincrby(keys.METRICS, field, n)


def _wave(http: httpx.Client, r: redis.Redis) -> None:
    """Tasks that run (batch, on the GPU worker) and one refused (interactive has no
    worker and refuses without one), then the counts as the next scrape sees them."""
    tasks = [submit(http, "sleep", {"seconds": 0.6}), submit(http, "echo", {"text": "hi"})]
    refused = http.post("/tasks", json={"type": "echo", "class": "interactive", "args": {}})
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"] == "no_workers"
    for task in tasks:
        assert wait_status(http, task["id"], {"succeeded"})["status"] == "succeeded"
    _seed_requeues(r)


def test_every_panel_query_returns_data(
    prometheus: tuple[Prometheus, httpx.Client],
    known_types: None,
    r: redis.Redis,
    start_worker: WorkerFactory,
) -> None:
    server, http = prometheus
    start_worker(classes="batch", extra=["--gpu", "auto"], env=fake_gpu_env(1))
    _wave(http, r)
    # Rates need the counters to grow between two scrapes: a second wave once Prometheus
    # holds the first.
    wait_for(
        lambda: _values(server.query("gpulane_task_latency_seconds_count")),
        30,
        interval_s=0.2,
        what="prometheus to scrape the first tasks",
    )
    _wave(http, r)

    targets = _targets()
    missing: dict[str, str] = {}

    def all_answer() -> bool:
        missing.clear()
        for name, expr in targets:
            answer = server.query(expr)
            assert answer["status"] == "success", f"{name}: {expr}: {answer}"
            if not any(math.isfinite(v) for v in _values(answer)):
                missing[name] = expr
        return not missing

    try:
        wait_for(all_answer, 45, interval_s=0.5, what="every panel's query to return data")
    except AssertionError:
        pytest.fail(f"panels without data: {json.dumps(missing, indent=1)}")

    # The GPU panels show the GPU worker's card.
    [util] = server.query("max by (worker, gpu) (gpulane_gpu_utilization_ratio)")["data"]["result"]
    assert util["metric"]["gpu"] == "0"

    _rules_evaluate(server)


def _rules_evaluate(server: Prometheus) -> None:
    """Each alerting and recording rule ran on the real series without an error, and every
    gpulane series a rule reads exists under that name."""
    written = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    # Metric names, not recording rules' (level:metric:operations).
    names = {n for r in written for n in re.findall(r"(?<![\w:])gpulane_\w+\b(?!:)", r["expr"])}
    assert "gpulane_queue_wait_seconds_bucket" in names
    for name in sorted(names):
        assert _values(server.query(f"count({name})")), f"no series {name} in prometheus"

    def evaluated() -> list[dict[str, Any]] | None:
        groups = server.http.get("/api/v1/rules").json()["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        done = all(not rule["lastEvaluation"].startswith("0001") for rule in rules)
        return rules if rules and done else None

    rules = wait_for(evaluated, 15, interval_s=0.2, what="prometheus to evaluate the rules")
    assert len(rules) == len(written)
    for rule in rules:
        assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
