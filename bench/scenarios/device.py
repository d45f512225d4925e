"""Scenario device: fair share counted in tasks (the workers'
``GPULANE_FAIR_SHARE_BY=tasks``) against in device time (the default), two tenants of
equal weight, one of 10 ms tasks and one of 500 ms tasks, both backlogs queued through
``POST /tasks`` before 2 workers start. The method, step by step: bench/README.md,
"device"."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.glside import gl_done, records
from bench.harness import BENCH_TASKS, Stack, bench_key, tenants_json
from bench.report import Report, Table, axes, cdf, figure, grouped_bars, judged, p50_p99, save
from testkit import publish_catalog, wait_for

CLASSES = ["interactive", "batch"]
MODES = {"count-based (tasks)": "tasks", "device time": "device_time"}
TENANTS = {"short": ("bench.sleep", 0.01), "long": ("bench.long", 0.5)}
ADMIN = "ops"


@dataclass(frozen=True)
class Size:
    short: int  # short's backlog (10 ms tasks)
    long: int  # long's backlog (500 ms tasks)
    window_s: float  # device seconds used when the split is read
    workers: int = 2


SIZES = {
    "smoke": Size(short=150, long=8, window_s=1.5),
    "quick": Size(short=1500, long=60, window_s=16.0),
    "full": Size(short=6000, long=480, window_s=60.0, workers=4),
}


def _client(url: str, name: str) -> httpx.Client:
    return httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {bench_key(name)}"}, timeout=60
    )


def _submit(url: str, size: Size) -> dict[str, list[str]]:
    ids = {}
    for name, (task_type, seconds) in TENANTS.items():
        n = size.short if name == "short" else size.long
        with _client(url, name) as http:
            reply = http.post(
                "/tasks", json=[{"type": task_type, "args": {"seconds": seconds}}] * n
            )
            if reply.status_code != 202:
                raise RuntimeError(f"submit refused: {reply.status_code} {reply.text}")
            ids[name] = reply.json()["ids"]
    return ids


def _mode(by: str, size: Size) -> dict[str, Any]:
    with Stack() as stack:
        publish_catalog(stack.client(), BENCH_TASKS)  # the types, before any worker runs
        _, url = stack.gpulane_api(
            CLASSES, tenants=tenants_json(dict.fromkeys((*TENANTS, ADMIN), 1.0), (ADMIN,))
        )
        ids = _submit(url, size)  # both backlogs queued before any worker runs
        for i in range(size.workers):
            stack.gpulane_worker(f"device-{i}", fair_share_by=by)
        with _client(url, ADMIN) as ops:

            def used() -> dict[str, Any] | None:
                body: dict[str, Any] = ops.get("/usage").json()
                return body if body["device_seconds"] >= size.window_s else None

            split = wait_for(
                used, 10 * size.window_s + 60, "the window's device time", interval_s=0.1
            )
            client = stack.client()
            everything = [i for group in ids.values() for i in group]
            limit = 120 + 2 * (size.short * 0.01 + size.long * 0.5) / size.workers
            wait_for(
                lambda: gl_done(client, everything), limit, "the tasks to drain", interval_s=0.1
            )
            recs = dict(zip(everything, records(client, everything), strict=True))
            # Every task sleeps its nominal time at least: the usage is all in once it
            # reaches their sum.
            nominal = size.short * TENANTS["short"][1] + size.long * TENANTS["long"][1]
            total = wait_for(
                lambda: (u := ops.get("/usage").json())["device_seconds"] >= nominal and u,
                10,
                "the last usage to be folded in",
            )
    busy = {
        name: sum(recs[i]["ended_ms"] - recs[i]["started_ms"] for i in group) / 1000
        for name, group in ids.items()
    }
    waits = {
        name: sorted(float(recs[i]["started_ms"] - recs[i]["created_ms"]) for i in group)
        for name, group in ids.items()
    }
    return {
        "split": split["tenants"],
        "waits": waits,
        "usage": total["tenants"],
        "busy": busy,
    }


def run(size_name: str, outdir: Path) -> Report:
    size = SIZES[size_name]
    started = time.monotonic()
    rows = {label: _mode(by, size) for label, by in MODES.items()}
    report = Report("device", size_name)
    table = []
    for label, r in rows.items():
        share = {t: r["split"].get(t, 0.0) for t in TENANTS}
        for name in TENANTS:
            part = share[name] / max(sum(share.values()), 1e-9)
            table.append([label, name, share[name], part, *p50_p99(r["waits"][name])])
    report.tables.append(
        Table(
            f"Equal weights, {size.workers} workers: {size.short} tasks of 10 ms (short) and "
            f"{size.long} of 500 ms (long), both queued first",
            f"mode | tenant | device s at {size.window_s:g} s used | share | wait p50 ms | "
            "wait p99 ms",
            table,
            note="Device seconds from GET /usage while both tenants still had work queued; "
            "waits over every task once all drained. Ran "
            f"{time.monotonic() - started:.0f} s.",
        )
    )
    report.tables.append(
        Table(
            "Usage read after the drain against the tasks' start-to-end times (records)",
            "mode | tenant | usage s | start-to-end s | ratio",
            [
                [label, name, r["usage"][name], r["busy"][name], r["usage"][name] / r["busy"][name]]
                for label, r in rows.items()
                for name in TENANTS
            ],
            note="Device time is the handler's time; a task's start-to-end also holds its "
            "claim and report (about a millisecond), which weighs on 10 ms tasks.",
        )
    )
    count, timed = rows["count-based (tasks)"], rows["device time"]
    ratio = timed["split"].get("short", 0.0) / max(timed["split"].get("long", 0.0), 1e-9)
    baseline = count["split"].get("short", 0.0) / max(count["split"].get("long", 0.0), 1e-9)
    adds_up = timed["usage"]["long"] / max(timed["busy"]["long"], 1e-9)
    report.targets += [
        judged("device time split short : long, equal weights, both saturated",
               f"count-based: {baseline:.2f} : 1", ratio, "1 : 1 +- 15 %"),
        judged("usage read over the start-to-end times of the 500 ms tasks", "-", adds_up,
               "1 +- 2 %", digits=3),
    ]  # fmt: skip
    report.charts.append(_chart(rows, outdir))
    report.write(outdir)
    return report


def _chart(rows: dict[str, dict[str, Any]], outdir: Path) -> str:
    fig, (left, right) = figure(11.0, 3.8, ncols=2)
    labels = list(rows)
    split = {name: [rows[label]["split"].get(name, 0.0) for label in labels] for name in TENANTS}
    grouped_bars(left, split, labels)
    for name in TENANTS:
        for label, style in zip(labels, ("--", "-"), strict=True):
            cdf(right, rows[label]["waits"][name], style, label=f"{name}, {label}")
    axes(left, "Device time per tenant, equal weights", y="device seconds in the window", legend=8)
    axes(right, x="queue wait (ms)", y="fraction of tasks", legend=8, xscale="symlog")
    return save(fig, outdir, "device.png")
