"""Scenario 4, API: accepted ``POST /tasks`` per second and submit latency under load.

``gpulane api`` runs as its own process (uvicorn, one worker process, uvloop and
httptools) against a private ``redis-server``, with the built-in task catalog
published (as workers publish it) and class limits raised so nothing is refused. A
closed-loop generator (:mod:`bench.loadgen`) keeps 16, then 64, keep-alive
connections busy with JSON submits of ``sleep``.

The API runs twice: as one process (the default) and as two (``gpulane api --workers 2``,
``GPULANE_API_WORKERS``). To tell where the time goes, the same load at the highest
concurrency then runs, in the same run, against reference servers under the same
uvicorn settings: a bare FastAPI route and the same plus one ``submit.lua`` call
(:mod:`bench.floor_app`).
:mod:`bench.asgi_costs` measures CPU per request inside the process with and without
the Redis call.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvloop

from bench import asgi_costs, loadgen
from bench.harness import Proc, Stack, classes_json, cpu_s, rss_mb
from bench.report import Report, Table, axes, cdf, figure, info, judged, p50_p99, save
from testkit import free_port, publish_catalog, wait_for

CLASSES = ["interactive", "batch"]
BODY = {"type": "sleep", "class": "batch", "args": {"seconds": 1}}
# Servers run side by side with gpulane at the highest concurrency: label -> uvicorn args.
BARE = "reference: bare FastAPI route (no Redis)"
ONE_CALL = "reference: FastAPI + one submit.lua call"
REFERENCES = {
    BARE: ["bench.floor_app:fastapi_app"],
    ONE_CALL: ["bench.floor_app:redis_app"],
}
SHORT = {BARE: "bare\nFastAPI", ONE_CALL: "+ one\nsubmit"}
PROCESSES = (1, 2)  # gpulane API processes measured


@dataclass(frozen=True)
class Size:
    seconds: float
    warmup_s: float
    concurrency: tuple[int, ...] = (16, 64)
    asgi_requests: int = 2000
    references: tuple[str, ...] = tuple(REFERENCES)  # labels of the reference servers to run


SIZES = {
    "smoke": Size(seconds=0.5, warmup_s=0.2, asgi_requests=50, references=(BARE,)),
    "quick": Size(seconds=3.0, warmup_s=0.5, asgi_requests=1000),
    "full": Size(seconds=20.0, warmup_s=2.0, asgi_requests=10_000),
}


def load(server: Proc, url: str, clients: int, size: Size, procs: int = 1) -> dict[str, Any]:
    """Closed-loop load on ``url``; accepted/s, latency and the server's CPU use."""
    request = loadgen.post_json(url, "/tasks", BODY)
    before = cpu_s(server.pid)
    t0 = time.monotonic()
    result = loadgen.run(url, request, clients, size.seconds, size.warmup_s)
    cpu = cpu_s(server.pid) - before
    requests = sum(result.statuses.values()) * (size.seconds + size.warmup_s) / size.seconds
    lat_ms = [x * 1000 for x in result.latencies_s]
    p50, p99 = p50_p99(lat_ms)
    return {
        "clients": clients,
        "procs": procs,
        "accepted_per_s": result.accepted_per_s,
        "p50_ms": p50,
        "p99_ms": p99,
        "refused": sum(n for s, n in result.statuses.items() if s != 202),
        "server_cpu": cpu / (time.monotonic() - t0),
        "cpu_us_per_request": cpu / max(requests, 1) * 1e6,
        "client_cpu": result.client_cpu_s / (size.seconds + size.warmup_s),
        "latencies": lat_ms,
    }


def _reference(stack: Stack, label: str, args: list[str], size: Size) -> dict[str, Any]:
    port = free_port()
    argv = [sys.executable, "-m", "uvicorn", *args, "--port", str(port), "--loop", "uvloop"]
    argv += ["--http", "httptools", "--no-access-log", "--log-level", "warning"]
    proc = stack.spawn(args[0].rsplit(":", 1)[1], argv, stack.env(classes=classes_json(CLASSES)))
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        proc.check()
        try:
            return httpx.post(f"{url}/tasks", json=BODY, timeout=1).status_code == 202
        except httpx.HTTPError:
            return False

    wait_for(up, 30, label)
    result = load(proc, url, max(size.concurrency), size)
    proc.stop()
    return result


def measure(size: Size) -> dict[str, Any]:
    with Stack() as stack:
        publish_catalog(stack.client())
        data: dict[str, Any] = {"levels": []}
        for procs in PROCESSES:
            api, url = stack.gpulane_api(CLASSES, api_workers=procs)
            data["levels"] += [load(api, url, c, size, procs) for c in size.concurrency]
            if procs == 1:
                data["rss"] = rss_mb(api.pid)
            api.stop()
        chosen = [(label, REFERENCES[label]) for label in size.references]
        data["refs"] = {label: _reference(stack, label, args, size) for label, args in chosen}
        data["asgi"] = uvloop.run(asgi_costs.measure(stack.url, CLASSES, BODY, size.asgi_requests))
    return data


def run(size: str, outdir: Path) -> Report:
    data = measure(SIZES[size])
    report = Report("api", size)
    _load_tables(report, data)
    _cost_tables(report, data)
    top = data["levels"][-1]  # the highest concurrency on the most processes
    one = [lv for lv in data["levels"] if lv["procs"] == 1][-1]
    at_top = f"{top['clients']} clients, {top['procs']} API processes"
    report.targets += [
        info(
            f"accepted submits/s, {one['clients']} clients, 1 API process",
            "-",
            f"{one['accepted_per_s']:,.0f}/s, p99 {one['p99_ms']:.1f} ms",
            "(>= 1,500/s)",
        ),
        judged(f"accepted submits/s, {at_top}", "-", top["accepted_per_s"], ">= 1,500/s", digits=0),
        judged(f"submit p99, {at_top}", "-", top["p99_ms"], "<= 50 ms", digits=1),
    ]
    report.charts.append(_chart(data, outdir))
    report.write(outdir)
    return report


def _row(label: str, lv: dict[str, Any]) -> list[Any]:
    cells = [lv[k] for k in ("clients", "accepted_per_s", "p50_ms", "p99_ms", "refused")]
    return [label, *cells, lv["server_cpu"] * 100, lv["cpu_us_per_request"]]


def _load_tables(report: Report, data: dict[str, Any]) -> None:
    rows = [_row(f"gpulane api, {lv['procs']} process(es)", lv) for lv in data["levels"]]
    rows += [_row(label, lv) for label, lv in data["refs"].items()]
    report.tables.append(
        Table(
            "Accepted HTTP submits (202) per second, closed loop",
            "server | clients | accepted /s | p50 ms | p99 ms | not 202 | server CPU % of a core | "
            "server CPU us / request",
            rows,
            f"gpulane API RSS after the load: {data['rss']['VmRSS']:.1f} MB. Load generator "
            f"CPU: {max(lv['client_cpu'] for lv in data['levels']) * 100:.0f}% of a core. "
            "Each row is one run, one after another: on a shared machine rows of one run "
            "compare, but expect about 20% between runs; CPU of a 2-process server is the sum "
            "of both.",
        )
    )


def _cost_tables(report: Report, data: dict[str, Any]) -> None:
    a, refs = data["asgi"], data["refs"]
    rows: list[list[Any]] = []
    if BARE in refs and ONE_CALL in refs:
        single = [lv for lv in data["levels"] if lv["procs"] == 1][-1]
        cpu = [lv["cpu_us_per_request"] for lv in (refs[BARE], refs[ONE_CALL], single)]
        # Absolute figures only: under load the servers differ in more than the parts
        # (batching, GC), so differences between them are not a part's cost.
        rows += [
            ["over HTTP, under load: bare FastAPI route (uvicorn + framework floor)", cpu[0]],
            ["over HTTP, under load: the same + one submit.lua call", cpu[1]],
            ["over HTTP, under load: gpulane api (1 process)", cpu[2]],
        ]
    rows += [
        ["in process, one request at a time: real app, real Redis", a["real"]],
        ["  redis-py submit.lua call (real minus Redis stubbed)", a["real"] - a["stub"]],
        ["  gpulane request logic (stubbed minus bare FastAPI)", a["stub"] - a["bare"]],
        ["  FastAPI/Starlette floor (bare route)", a["bare"]],
    ]
    report.tables.append(
        Table(
            "Where a submit's CPU goes (us per request)",
            "part | CPU us",
            rows,
            "Over HTTP: server CPU per request of the side-by-side runs above (64 clients). "
            "In process: the ASGI app driven directly, without uvicorn or concurrency.",
        )
    )
    report.tables.append(
        Table(
            "gpulane request-path functions (cProfile, Redis stubbed; inflated by the "
            "profiler, compare relatively)",
            "function | cumulative us / request",
            [[label, us] for label, us in a["steps"]],
        )
    )


def _chart(data: dict[str, Any], outdir: Path) -> str:
    fig, (left, right) = figure(10.0, 3.6, ncols=2)
    bars = [
        (f"gpulane {lv['procs']}p\n{lv['clients']} cl.", lv["accepted_per_s"])
        for lv in data["levels"]
    ]
    bars += [(SHORT[label], lv["accepted_per_s"]) for label, lv in data["refs"].items()]
    left.bar([b[0] for b in bars], [b[1] for b in bars])
    left.axhline(1500, color="grey", linestyle=":", label="target 1,500/s")
    left.tick_params(axis="x", labelsize=7)
    axes(left, "Submit throughput", y="accepted submits / s", legend=8)
    for lv in data["levels"]:
        cdf(right, lv["latencies"], label=f"gpulane, {lv['procs']} proc., {lv['clients']} clients")
    right.axvline(50, color="grey", linestyle=":")
    axes(right, "Submit latency CDF", "submit latency (ms), log scale", "fraction of submits",
         legend=8, xscale="log")  # fmt: skip
    return save(fig, outdir, "api.png")
