"""Helpers for the observability tests: scraping and checking /metrics, a simulated GPU
worker, headless Chromium, and reading JSON log files."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
from playwright.sync_api import Page, sync_playwright
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from dispatcher.contract import keys
from worker.gpu.devices import Device
from worker.state import WorkerState

ARTIFACTS = Path(__file__).resolve().parents[2] / ".test-artifacts"
CHROMIUM = "/usr/bin/chromium"
# Headless and quiet: no sandbox (containers run as root), no GPU, no network calls home.
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@dataclass
class Scrape:
    """One /metrics response, parsed by prometheus_client's own text parser."""

    text: str
    families: dict[str, Metric]

    def value(self, sample_name: str, **labels: str) -> float | None:
        """The value of the sample with exactly these labels, None when absent."""
        for family in self.families.values():
            for sample in family.samples:
                if sample.name == sample_name and sample.labels == labels:
                    return float(sample.value)
        return None

    def series(self, sample_name: str) -> list[dict[str, str]]:
        """Label sets of every sample of that name."""
        return [
            dict(s.labels)
            for family in self.families.values()
            for s in family.samples
            if s.name == sample_name
        ]

    def buckets(self, histogram: str, **labels: str) -> list[tuple[float, float]]:
        """(le, cumulative count) of one histogram series, in exposition order."""
        out = []
        for labelset in self.series(f"{histogram}_bucket"):
            le = labelset.pop("le")
            if labelset == labels:
                value = self.value(f"{histogram}_bucket", **labels, le=le)
                out.append((float(le), value or 0.0))
        return out


@contextmanager
def dashboard(url: str) -> Iterator[Page]:
    """The live dashboard at ``url`` open in headless Chromium (closed after)."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(url)
            yield page
        finally:
            browser.close()


def scrape(http: httpx.Client, **headers: str) -> Scrape:
    response = http.get("/metrics", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    return Scrape(response.text, families)


def promtool(
    *args: str, cwd: Path | None = None, stdin: str | None = None, timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    """Prometheus' own `promtool`, its output captured: the reference the metrics and the
    alerting rules are checked against (a missing binary fails, not skips: make test
    installs it)."""
    binary = shutil.which("promtool")
    assert binary, "promtool is not installed (make test installs it)"
    return subprocess.run(
        [binary, *args],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def promtool_check(text: str) -> subprocess.CompletedProcess[str]:
    """`promtool check metrics`: the exposition format and Prometheus' naming lints."""
    return promtool("check", "metrics", stdin=text, timeout_s=30)


def fake_gpu_worker(
    client: redis.Redis,
    name: str,
    utilization: float,
    used_bytes: int,
    total_bytes: int,
    index: int = 0,
    classes: tuple[str, ...] = ("interactive", "batch"),
    busy: bool = False,
) -> None:
    """Publish a live worker on a GPU without one: the worker hash is built by the real
    WorkerState, so only NVML's sample is made up. Its lease lasts an hour (it never
    beats, and must not be reaped during the test). Call again to publish a new sample."""
    device = Device("gpu", index, f"GPU-{index:04d}-test", "NVIDIA H100 80GB HBM3", total_bytes)
    state = WorkerState(name, device, list(classes), ["echo", "sleep"])
    state.set("busy" if busy else "idle")
    state.device_sample = {
        "utilization": utilization,
        "memory_used_bytes": used_bytes,
        "memory_total_bytes": total_bytes,
    }
    now_ms = int(time.time() * 1000)
    fields: dict[str, str | int] = {**state.info(), "last_heartbeat_ms": now_ms}
    client.hset(keys.worker(name), mapping=fields)  # type: ignore[arg-type]
    client.zadd(keys.WORKERS, {name: now_ms + 3_600_000})


def json_lines(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a log file, each parsed as JSON (a torn last line that
    is still being written is left out; anything else that is not JSON fails)."""
    text = path.read_text(errors="replace")
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


@contextmanager
def fake_gpu_load(
    client: redis.Redis, names: list[str], classes: tuple[str, ...], period_s: float = 0.25
) -> Iterator[None]:
    """Simulated busy GPU workers whose utilization and memory rise and fall (a slow
    wave, one phase per worker), republished every ``period_s`` while the block runs:
    what the dashboard's GPU history draws. Each holds a made-up task in its in-flight
    list of ``classes[0]`` (the API reads busy/idle there); nothing runs it."""
    stop = threading.Event()
    total = 80 * 2**30
    for name in names:
        client.rpush(keys.inflight(name, classes[0]), str(uuid.uuid4()))

    def publish() -> None:
        start = time.monotonic()
        while not stop.is_set():
            t = time.monotonic() - start
            for i, name in enumerate(names):
                wave = math.sin(t / 2.5 + 2.1 * i)
                util = 0.6 + 0.35 * wave * (1 if i % 2 == 0 else 0.6)
                used = int(total * (0.45 + 0.15 * i + 0.1 * math.sin(t / 6 + i)))
                fake_gpu_worker(client, name, util, used, total, i, classes, busy=True)
            stop.wait(period_s)

    thread = threading.Thread(target=publish, name="fake-gpu-load", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
