"""The dashboard in real headless Chromium against the real API and real workers, and
the GET /stats route behind it.

The live-pool test keeps its screenshots (desktop and phone width) under
.test-artifacts/; `make screenshot` also copies the desktop one to docs/dashboard.png.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator

import httpx
import pytest
import redis
from conftest import WorkerFactory, make_settings, submit, wait_status
from playwright.sync_api import Browser, ConsoleMessage, Page, sync_playwright
from support.catalog import tenant
from support.observe import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, fake_gpu_load, fake_gpu_worker

from dispatcher.contract.settings import ClassConfig, Settings
from testkit import REPO, ApiServer, wait_for

GiB = 2**30
NO_VALUE = "\u2013"  # the en dash the page shows for a value it does not have


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert shutil.which(CHROMIUM), f"{CHROMIUM} is not installed (make test installs it)"
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class Watched:
    """A page plus what it complained about and which origins it talked to."""

    def __init__(
        self, browser: Browser, base_url: str, width: int, height: int, dark: bool = False
    ) -> None:
        self.page: Page = browser.new_page(
            viewport={"width": width, "height": height},
            color_scheme="dark" if dark else "light",
        )
        self.errors: list[str] = []
        self.foreign: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.on(
            "request",
            lambda req: None if req.url.startswith(base_url) else self.foreign.append(req.url),
        )
        self.page.goto(base_url)

    def _console(self, message: ConsoleMessage) -> None:
        # A 401 before the key is typed is the expected way to ask for one.
        if message.type == "error" and "401" not in message.text:
            self.errors.append(message.text)

    def text(self, selector: str) -> str:
        return self.page.locator(selector).first.inner_text()

    def card_value(self, cls: str, label: str) -> str:
        card = self.page.locator("article.card", has=self.page.locator("h3", has_text=cls))
        return (
            card.locator(".stat", has=self.page.locator(f"dt:text-is('{label}')"))
            .locator("dd")
            .inner_text()
        )

    def wait(self, check: Callable[[], object], what: str, timeout_s: float = 20) -> None:
        wait_for(check, timeout_s, interval_s=0.1, what=what)


@pytest.fixture
def pool_settings(redis_url: str) -> Settings:
    """Batch holds six tasks, so a burst of submits shows refusals too."""
    return make_settings(
        redis_url,
        classes={
            "interactive": ClassConfig(max_queued=50, max_wait_s=30, reject_without_workers=True),
            "batch": ClassConfig(max_queued=6, max_wait_s=3600),
        },
    )


@pytest.fixture
def gpu_load(r: redis.Redis) -> Iterator[list[str]]:
    """Two simulated GPU workers (interactive only, busy, load rising and falling), so
    the live page and its screenshot show GPU history next to the real cpu workers."""
    names = ["gpu-worker-a", "gpu-worker-b"]
    with fake_gpu_load(r, names, ("interactive",)):
        yield names


def _row(view: Watched, worker: str) -> str:
    return view.page.locator("#worker-rows tr", has_text=worker).inner_text()


def _spark(view: Watched, worker: str, metric: str) -> tuple[int, str, int]:
    """A worker's history chart: (samples it holds, its description, points drawn)."""
    chart = view.page.locator("#worker-rows tr", has_text=worker).locator(f"svg.spark-{metric}")
    # One read of one element: the page redraws the rows every second.
    samples, label, points = chart.evaluate(
        "n => [n.dataset.samples, n.getAttribute('aria-label'),"
        " n.querySelector('polyline')?.getAttribute('points') || '']"
    )
    return int(samples), str(label), len(str(points).split())


def _submit_burst(http: httpx.Client, count: int, seconds: float) -> None:
    for _ in range(count):
        http.post("/tasks", json={"type": "sleep", "class": "batch", "args": {"seconds": seconds}})


def test_dashboard_shows_the_live_pool(
    pool_settings: Settings,
    api_factory: Callable[[Settings], ApiServer],
    start_worker: WorkerFactory,
    browser: Browser,
    request: pytest.FixtureRequest,
    gpu_load: list[str],
) -> None:
    api = api_factory(pool_settings)
    start_worker("cpu-worker-1")
    start_worker("cpu-worker-2")
    http = httpx.Client(base_url=api.url, timeout=10)
    request.addfinalizer(http.close)
    done = [submit(http, "echo", {"n": i}, cls="interactive")["id"] for i in range(8)]
    done.append(submit(http, "test.fail", cls="interactive")["id"])
    for task_id in done:
        wait_status(http, task_id, {"succeeded", "failed"})

    view = Watched(browser, api.url, 1280, 800)
    view.wait(lambda: "cpu-worker-2" in view.text("#worker-rows"), "both workers listed")
    assert "cpu-worker-1" in view.text("#worker-rows")
    # Load arrives in bursts while the page watches, so the chart has a shape: the
    # batch queue fills to its limit (the excess is refused) and drains in between.
    _submit_burst(http, 12, 1.5)  # 2 run, 6 queue, the rest refused
    view.wait(
        lambda: (
            view.page.locator("polyline.s1").count() == 1
            and len((view.page.locator("polyline.s1").get_attribute("points") or "").split()) >= 8
        ),
        "some queue history in the chart",
    )
    _submit_burst(http, 4, 6.0)  # long enough for the page to show two of them queued

    def depth_shown_matches_api() -> bool:
        api_depth = {c["name"]: c["depth"] for c in http.get("/queues").json()["classes"]}
        return api_depth["batch"] > 0 and view.card_value("batch", "queued") == str(
            api_depth["batch"]
        )

    view.wait(depth_shown_matches_api, "the live batch depth on the page")
    view.wait(
        lambda: all("busy" in _row(view, w) for w in ("cpu-worker-1", "cpu-worker-2")),
        "both cpu workers busy",
    )
    for cpu in ("cpu-worker-1", "cpu-worker-2"):  # cpu devices, shown as such
        assert _row(view, cpu).count("n/a (cpu)") == 2 and "gpu" not in _row(view, cpu)
    # Each GPU worker's utilization and memory over the last minutes, one sample a poll.
    for gpu in gpu_load:
        for metric in ("util", "mem"):
            samples, label, drawn = _spark(view, gpu, metric)
            assert samples >= 8 and drawn == samples, (gpu, metric, samples, drawn)
            assert "over the last" in label and "min " in label and "max " in label
    assert view.card_value("interactive", "succeeded") == "8"
    assert view.card_value("interactive", "failed") == "1"
    assert view.card_value("interactive", "p50") not in ("", NO_VALUE)
    view.wait(lambda: view.card_value("batch", "rejected") != "0", "the refusals counted")
    assert "queue full" in view.text("article.card:nth-child(2) .note")
    assert "live" in view.text("#conn")

    ARTIFACTS.mkdir(exist_ok=True)
    view.page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    if os.environ.get("GPULANE_UPDATE_DOCS") == "1":  # `make screenshot`: the README's image
        shutil.copyfile(ARTIFACTS / "dashboard.png", REPO / "docs" / "dashboard.png")

    view.page.set_viewport_size({"width": 390, "height": 844})
    view.wait(
        lambda: view.page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"),
        "the phone layout to fit the width",
    )
    view.page.screenshot(path=str(ARTIFACTS / "dashboard-phone.png"), full_page=True)
    assert view.errors == [] and view.foreign == []  # offline-safe: nothing but this API


def test_dashboard_asks_for_a_key_and_draws_gpu_bars(
    redis_url: str,
    api_factory: Callable[[Settings], ApiServer],
    r: redis.Redis,
    browser: Browser,
) -> None:
    settings = make_settings(redis_url, tenants=[tenant("ops", "ops-key", admin=True)])
    api = api_factory(settings)
    fake_gpu_worker(r, "gpu-sim", utilization=0.42, used_bytes=12 * GiB, total_bytes=80 * GiB)

    view = Watched(browser, api.url, 1280, 800, dark=True)
    view.page.locator("#key-form").wait_for(state="visible")
    view.page.fill("#key-input", "ops-key")
    view.page.click("#key-form button")
    view.wait(lambda: "gpu-sim" in view.text("#worker-rows"), "the GPU worker listed")
    meters = view.page.locator("#worker-rows [role=meter]")
    assert meters.count() == 2
    assert meters.nth(0).get_attribute("aria-valuenow") == "42"
    assert meters.nth(1).get_attribute("aria-valuenow") == "15"  # 12 of 80 GiB
    row = view.text("#worker-rows")
    assert "gpu0 · NVIDIA H100 80GB HBM3" in row and "12.0 / 80.0 GiB" in row and "42%" in row
    assert view.page.locator("#key-form").is_hidden()

    # The history under each bar keeps the samples the page saw, not only the latest.
    view.wait(lambda: _spark(view, "gpu-sim", "util")[0] >= 2, "two utilization samples")
    for util, used in ((0.9, 60 * GiB), (0.1, 8 * GiB)):
        fake_gpu_worker(r, "gpu-sim", utilization=util, used_bytes=used, total_bytes=80 * GiB)
        view.wait(
            lambda u=util: f"now {round(u * 100)}%" in _spark(view, "gpu-sim", "util")[1],
            f"the {util:.0%} sample in the history",
        )
    samples, label, drawn = _spark(view, "gpu-sim", "util")
    assert samples >= 4 and drawn == samples
    assert "min 10%" in label and "max 90%" in label and label.endswith("now 10%")
    samples, label, drawn = _spark(view, "gpu-sim", "mem")
    assert samples >= 4 and drawn == samples
    assert "min 10%" in label and "max 75%" in label  # 8 and 60 of 80 GiB
    assert view.errors == []
    ARTIFACTS.mkdir(exist_ok=True)
    view.page.screenshot(path=str(ARTIFACTS / "dashboard-gpu-dark.png"), full_page=True)


def test_stats_route(http: httpx.Client, start_worker: WorkerFactory) -> None:
    start_worker()
    first = http.get("/stats").json()  # the baseline of this replica's latency window
    assert [c["name"] for c in first["classes"]] == ["interactive", "batch"]
    assert first["classes"][0] == {
        "name": "interactive",
        "submitted": 0,
        "rejected": {},
        "finished": {"succeeded": 0, "failed": 0, "canceled": 0},
        "requeued": 0,
        "latency_s": {"p50": None, "p95": None, "p99": None, "count": 0, "window_s": None},
    }
    ids = [submit(http, "echo", cls="interactive")["id"] for _ in range(4)]
    for task_id in ids:
        wait_status(http, task_id, {"succeeded"})

    def counted() -> dict | None:
        entry = http.get("/stats").json()["classes"][0]
        # Workers and the API flush their counts on their own heartbeats: wait for both.
        done = entry["latency_s"]["count"] == 4 and entry["submitted"] == 4
        return entry if done else None

    entry = wait_for(counted, 10, interval_s=0.1, what="the tasks in /stats")
    assert entry["submitted"] == 4 and entry["finished"]["succeeded"] == 4
    latency = entry["latency_s"]
    assert latency["window_s"] is not None and latency["window_s"] > 0  # recent tasks only
    assert 0 < latency["p50"] <= latency["p95"] <= latency["p99"]
    schema = http.get("/openapi.json").json()["paths"]["/stats"]["get"]
    assert "percentiles" in schema["summary"] and "window_s" in schema["description"]


def test_page_and_assets_are_served(http: httpx.Client) -> None:
    page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    for asset, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        response = http.get(f"/static/{asset}")
        assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
        again = http.get(f"/static/{asset}", headers={"If-None-Match": response.headers["etag"]})
        assert again.status_code == 304
    missing = http.get("/static/app.py")
    assert missing.status_code == 404 and missing.json()["error"] == "not_found"
    assert "://" not in page.text  # no CDN: nothing but this origin


def test_swagger_ui_renders_offline(browser: Browser, http: httpx.Client) -> None:
    """/docs draws the API from this origin alone (no CDN): air-gapped hosts get it."""
    base = str(http.base_url).rstrip("/")
    page = browser.new_page()
    foreign: list[str] = []
    errors: list[str] = []
    page.on("request", lambda req: None if req.url.startswith(base) else foreign.append(req.url))
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto(f"{base}/docs")
        page.locator(".swagger-ui .opblock-summary-path", has_text="/tasks").first.wait_for(
            timeout=20_000
        )
        assert "gpulane" in page.locator(".swagger-ui .info .title").inner_text()
    finally:
        page.close()
    assert foreign == [] and errors == []
