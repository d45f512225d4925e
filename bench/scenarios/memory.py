"""Scenario 5, resident memory: an idle worker (no model loaded) and the API after load.

RSS is ``VmRSS`` from ``/proc/<pid>/status`` in MB (10^6 bytes), with its anonymous
part (``RssAnon``: the process's own heap, not shared libraries). The worker is a plain
``gpulane worker --gpu none`` with the built-in tasks only, measured after start and
again after it ran no-op tasks; plain RQ's ``SimpleWorker`` is measured alongside as a
reference. The API is ``gpulane api`` measured idle and after a burst of submits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import loadgen
from bench.glside import Submitter, gl_done
from bench.harness import Stack, rss_mb
from bench.report import Report, Table, axes, figure, judged, save
from bench.scenarios.api import BODY, CLASSES
from testkit import publish_catalog, wait_for


@dataclass(frozen=True)
class Size:
    settle_s: float
    tasks: int
    load_s: float


SIZES = {
    "smoke": Size(settle_s=0.5, tasks=20, load_s=0.5),
    "quick": Size(settle_s=2.0, tasks=300, load_s=4.0),
    "full": Size(settle_s=5.0, tasks=3000, load_s=20.0),
}


def measure(size: Size) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    with Stack() as stack:
        worker = stack.gpulane_worker("mem0", tasks="worker.tasks.builtin")
        rq = stack.rq_worker("rqmem", "plain")
        time.sleep(size.settle_s)
        out["gpulane worker, idle after start"] = rss_mb(worker.pid)
        out["plain RQ SimpleWorker, idle after start"] = rss_mb(rq.pid)
        client = stack.client()
        ids = Submitter(client, CLASSES).fill(size.tasks, "echo", {"x": 1}, "batch")
        wait_for(lambda: gl_done(client, ids), 60, "the echo tasks", interval_s=0.05)
        time.sleep(size.settle_s)
        out[f"gpulane worker, idle after {size.tasks} tasks"] = rss_mb(worker.pid)
        publish_catalog(client)
        api, url = stack.gpulane_api(CLASSES)
        time.sleep(size.settle_s)
        out["gpulane api, idle"] = rss_mb(api.pid)
        result = loadgen.run(url, loadgen.post_json(url, "/tasks", BODY), 64, size.load_s, 0.0)
        time.sleep(size.settle_s)
        key = f"gpulane api, after {result.statuses[202]:,} submits from 64 clients"
        out[key] = rss_mb(api.pid)
    return out


def run(size: str, outdir: Path) -> Report:
    data = measure(SIZES[size])
    report = Report("memory", size)
    report.tables.append(
        Table(
            "Resident memory (MB = 10^6 bytes)",
            "process | RSS | of which anonymous | of which file-backed",
            [[name, m["VmRSS"], m["RssAnon"], m["RssFile"]] for name, m in data.items()],
        )
    )
    worker = max(m["VmRSS"] for n, m in data.items() if n.startswith("gpulane worker"))
    api = max(m["VmRSS"] for n, m in data.items() if n.startswith("gpulane api"))
    report.targets += [
        judged("resident memory, idle worker (no model)", "-", worker, "<= 80 MB", digits=1),
        judged("resident memory, API after load", "-", api, "<= 120 MB", digits=1),
    ]
    report.charts.append(_chart(data, outdir))
    report.write(outdir)
    return report


def _chart(data: dict[str, Any], outdir: Path) -> str:
    fig, ax = figure(8.0, 3.0)
    names = list(data)
    ax.barh(names, [data[n]["VmRSS"] for n in names], label="RSS")
    ax.barh(names, [data[n]["RssAnon"] for n in names], label="anonymous part")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=8)
    axes(ax, "Resident memory", "MB", legend=8)
    return save(fig, outdir, "memory.png")
