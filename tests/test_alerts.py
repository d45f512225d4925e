"""deploy/prometheus: the alerting rules pass `promtool check rules`, their unit tests
(deploy/prometheus/tests.yml) pass `promtool test rules`, every alert is tested firing
and silent, and the tests fail when an alert goes missing; the series the rules read
about Redis and per-class workers come out of a real API's /metrics."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from conftest import WorkerFactory, make_settings
from support.catalog import tenant
from support.observe import promtool, promtool_check, scrape

from dispatcher.contract.settings import Settings
from testkit import ApiServer, free_port, wait_for

PROMETHEUS = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
RULES = PROMETHEUS / "gpulane.rules.yml"
TESTS = PROMETHEUS / "tests.yml"


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in _rules() if "alert" in rule}


def test_rules_pass_promtool_check() -> None:
    result = promtool("check", "rules", RULES.name, cwd=PROMETHEUS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


def test_rule_unit_tests_pass() -> None:
    result = promtool("test", "rules", TESTS.name, cwd=PROMETHEUS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_alerts_the_issue_asks_for() -> None:
    alerts = _alerts()
    assert set(alerts) == {
        "GpulaneClassNotServed",  # a class with queued work and no serving worker
        "GpulaneInteractiveWaitHigh",  # interactive wait p99 above its target
        "GpulaneWorkersLost",  # rising worker_lost failures
        "GpulaneGpuFaults",  # rising gpu_fault failures
        "GpulaneWorkerUnhealthy",
        "GpulaneRedisDown",
        "GpulaneMetricsAbsent",  # no API scraped at all: RedisDown could not fire
        "GpulaneRedisMemoryHigh",  # near maxmemory
        "GpulaneRedisMemoryFull",
        "GpulaneGpuHot",
    }
    for name, alert in alerts.items():
        assert alert["labels"]["severity"] in ("warning", "critical"), name
        assert {"summary", "description"} <= set(alert["annotations"]), name


def test_the_wait_target_is_the_interactive_max_wait() -> None:
    target = Settings().classes["interactive"].max_wait_s
    expr = _alerts()["GpulaneInteractiveWaitHigh"]["expr"]
    assert re.search(rf'{{class="interactive"}}\s*>\s*{target:g}\b', expr), expr


def test_failure_alerts_read_the_reasons_the_workers_record() -> None:
    """worker_lost and gpu_fault are the `reason` label of gpulane_tasks_requeued_total
    (dispatcher/reaper.py, worker/loop.py); finished_total has no error code."""
    alerts = _alerts()
    for name, reason in (("GpulaneWorkersLost", "worker_lost"), ("GpulaneGpuFaults", "gpu_fault")):
        assert f'gpulane_tasks_requeued_total{{reason="{reason}"}}' in alerts[name]["expr"]


def test_every_alert_is_tested_firing_and_silent() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for case in yaml.safe_load(TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check["exp_alerts"] else silent).add(check["alertname"])
    assert firing == set(_alerts())
    assert silent == set(_alerts())


def _without(alert: str, tmp_path: Path) -> Path:
    """A copy of the rules and their tests with ``alert`` left out of the rules."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        group["rules"] = [r for r in group["rules"] if r.get("alert") != alert]
    (tmp_path / RULES.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    shutil.copy(TESTS, tmp_path / TESTS.name)
    return tmp_path


@pytest.mark.parametrize("alert", sorted(_alerts()))
def test_the_rule_tests_fail_without_the_alert(alert: str, tmp_path: Path) -> None:
    result = promtool("test", "rules", TESTS.name, cwd=_without(alert, tmp_path))
    assert result.returncode != 0
    assert alert in result.stdout + result.stderr


# --- the series the rules read, from a real API -----------------------------------------


def test_redis_and_class_worker_gauges(
    known_types: None,
    maxmemory: int,
    http: httpx.Client,
    r: redis.Redis,
    start_worker: WorkerFactory,
) -> None:
    start_worker(classes="batch")

    def served() -> Any:
        result = scrape(http)
        return result if result.value("gpulane_class_workers", **{"class": "batch"}) else None

    result = wait_for(served, 15, interval_s=0.1, what="the worker in gpulane_class_workers")
    assert result.value("gpulane_class_workers", **{"class": "batch"}) == 1
    assert result.value("gpulane_class_workers", **{"class": "interactive"}) == 0
    assert result.value("gpulane_redis_up") == 1
    assert result.value("gpulane_redis_maxmemory_bytes") == maxmemory
    used = result.value("gpulane_redis_memory_used_bytes")
    assert used is not None
    assert 0 < used < maxmemory
    checked = promtool_check(result.text)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("keys", [False, True], ids=["open", "admin-key"])
def test_metrics_while_redis_is_down(keys: bool) -> None:
    """/metrics still answers, with gpulane_redis_up 0 and no pool series (none is known),
    with keys configured too (the rate limit lives in Redis; the key check does not)."""
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    tenants = [tenant("ops", "ops-key", admin=True)] if keys else []
    server = ApiServer(make_settings(nowhere, tenants=tenants)).start()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            result = scrape(client, Authorization="Bearer ops-key")
    finally:
        server.stop()
    assert result.value("gpulane_redis_up") == 0
    assert {n for n in result.families if n.startswith("gpulane_")} == {"gpulane_redis_up"}
    assert result.value("process_resident_memory_bytes")
    checked = promtool_check(result.text)
    assert checked.returncode == 0, checked.stdout + checked.stderr
