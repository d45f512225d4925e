"""Scenario fair: tenants sharing one class, FIFO (``GPULANE_FAIR_SHARE=false``) against
weighted fair share, every task through ``POST /tasks`` with its tenant's key: a small
tenant's waits behind another's backlog, and the completion split of two saturating
tenants of weights 3 and 1. The method, step by step: bench/README.md, "fair"."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.glside import gl_done, records
from bench.harness import Stack, bench_key, tenants_json
from bench.report import Report, Table, axes, cdf, figure, judged, p50_p99, pct, save
from testkit import wait_for

CLASSES = ["interactive", "batch"]
CLASS = "batch"
MODES = {"FIFO": False, "fair share": True}  # label -> GPULANE_FAIR_SHARE
WEIGHTS = {"bulk": 1.0, "small": 1.0, "gold": 3.0, "bronze": 1.0}
COLORS = {"bulk": "tab:blue", "small": "tab:red", "gold": "tab:orange", "bronze": "tab:green"}
WAVE = 5  # small's tasks per wave
CONCURRENCY = 8  # HTTP submits in flight at once
BACKLOG_CELLS = ("tasks", "p50_ms", "p99_ms", "max_ms", "position_p50", "span_s")


@dataclass(frozen=True)
class Size:
    bulk: int  # bulk's backlog
    waves: int  # waves of WAVE small tasks
    wave_every_s: float
    weighted: int  # tasks of each of gold and bronze
    task_s: float = 0.02
    workers: int = 2


SIZES = {
    "smoke": Size(bulk=60, waves=1, wave_every_s=0.1, weighted=40),
    "quick": Size(bulk=300, waves=3, wave_every_s=0.4, weighted=300),
    "full": Size(bulk=2000, waves=10, wave_every_s=0.5, weighted=2000, workers=4),
}


@dataclass
class Submitted:
    tenant: str
    id: str
    position: int | None


async def _post_all(url: str, tenants: list[str], task_s: float) -> list[Submitted]:
    """One ``POST /tasks`` per entry of ``tenants`` (with that tenant's key), in order,
    :data:`CONCURRENCY` at a time; returns what the API answered, in the same order."""
    body = {"type": "sleep", "class": CLASS, "args": {"seconds": task_s}}
    out: list[Submitted | None] = [None] * len(tenants)
    cursor = iter(range(len(tenants)))

    async def sender(http: httpx.AsyncClient) -> None:
        for i in cursor:
            headers = {"Authorization": f"Bearer {bench_key(tenants[i])}"}
            response = await http.post("/tasks", json=body, headers=headers)
            if response.status_code != 202:
                raise RuntimeError(f"submit refused: {response.status_code} {response.text}")
            reply = response.json()
            out[i] = Submitted(tenants[i], reply["id"], reply["position"])

    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as http:
        await asyncio.gather(*(sender(http) for _ in range(min(CONCURRENCY, len(tenants)))))
    return [s for s in out if s is not None]


def _post(url: str, tenants: list[str], task_s: float) -> list[Submitted]:
    return asyncio.run(_post_all(url, tenants, task_s))


def _waits(recs: list[dict[str, Any]]) -> list[float]:
    return sorted(float(r["started_ms"] - r["created_ms"]) for r in recs)


def _drain(client: redis.Redis, ids: list[str], limit_s: float) -> dict[str, dict[str, Any]]:
    """Wait until every task ended; their records by id (all must have finished)."""
    wait_for(lambda: gl_done(client, ids), limit_s, "the tasks to finish", interval_s=0.05)
    recs = dict(zip(ids, records(client, ids), strict=True))
    failed = [task_id for task_id, r in recs.items() if r["status"] != "finished"]
    if failed:
        raise RuntimeError(f"{len(failed)} tasks did not finish, e.g. {failed[0]}")
    return recs


def _backlog(stack: Stack, url: str, size: Size) -> tuple[dict[str, Any], float]:
    """Per tenant: waits, positions, first created -> last ended; and that span for
    all the part's tasks (s)."""
    client = stack.client()
    bulk = _post(url, ["bulk"] * size.bulk, size.task_s)
    small: list[Submitted] = []
    for wave in range(size.waves):
        if wave:
            time.sleep(size.wave_every_s)
        small += _post(url, ["small"] * WAVE, size.task_s)
    ids = [s.id for s in bulk + small]
    by_id = _drain(client, ids, 60 + 3 * len(ids) * size.task_s / size.workers)
    rows: dict[str, dict[str, Any]] = {}
    for tenant, subs in (("bulk", bulk), ("small", small)):
        recs = [by_id[s.id] for s in subs]
        waits = _waits(recs)
        positions = [float(s.position) for s in subs if s.position is not None]
        rows[tenant] = {"tasks": len(recs), **_wait_pcts(waits), "max_ms": max(waits)}
        rows[tenant] |= {"position_p50": pct(positions, 50), "span_s": _span(recs)}
        rows[tenant]["waits"] = waits
    return rows, _span(list(by_id.values()))


def _span(recs: list[dict[str, Any]]) -> float:
    """First created -> last ended, seconds."""
    return float(max(r["ended_ms"] for r in recs) - min(r["created_ms"] for r in recs)) / 1000


def _wait_pcts(waits: list[float]) -> dict[str, float]:
    p50, p99 = p50_p99(waits)
    return {"p50_ms": p50, "p99_ms": p99}


def _weights(stack: Stack, url: str, size: Size) -> dict[str, Any]:
    client = stack.client()
    subs = _post(url, ["gold", "bronze"] * size.weighted, size.task_s)
    ids = [s.id for s in subs]
    recs = _drain(client, ids, 60 + 3 * len(ids) * size.task_s / size.workers)
    by: dict[str, list[dict[str, Any]]] = {"gold": [], "bronze": []}
    for s in subs:
        by[s.tenant].append(recs[s.id])
    start = max(min(r["created_ms"] for r in rs) for rs in by.values())
    end = min(max(r["started_ms"] for r in rs) for rs in by.values())
    t0 = min(r["created_ms"] for r in recs.values())
    out: dict[str, Any] = {"window_s": (end - start) / 1000}
    for tenant, rs in by.items():
        waits = _waits(rs)
        out[tenant] = {
            "tasks": len(rs),
            "in_window": sum(start <= r["ended_ms"] <= end for r in rs),
            **_wait_pcts(waits),
            "ended_s": sorted((r["ended_ms"] - t0) / 1000 for r in rs),  # for the chart
        }
    out["split"] = out["gold"]["in_window"] / max(1, out["bronze"]["in_window"])
    return out


def _mode(label: str, fair: bool, size: Size) -> dict[str, Any]:
    with Stack() as stack:
        workers = [stack.gpulane_worker(f"fair-{i}", wait=False) for i in range(size.workers)]
        for proc in workers:
            stack.wait_registered(proc)
        _, url = stack.gpulane_api(
            CLASSES, tenants=tenants_json(WEIGHTS), fair_share="true" if fair else "false"
        )
        backlog, total_s = _backlog(stack, url, size)
        weights = _weights(stack, url, size)
    return {"mode": label, "backlog": backlog, "backlog_s": total_s, "weights": weights}


def run(size: str, outdir: Path) -> Report:
    cfg = SIZES[size]
    started = time.monotonic()
    rows = [_mode(label, fair, cfg) for label, fair in MODES.items()]
    task_ms = cfg.task_s * 1000
    report = Report("fair", size)
    report.tables.append(
        Table(
            f"Backlog: {cfg.bulk} bulk tasks, then {cfg.waves} wave(s) of {WAVE} small ones "
            f"({task_ms:.0f} ms each, {cfg.workers} workers)",
            "mode | tenant | tasks | wait p50 ms | wait p99 ms | wait max ms | position at "
            "submit, p50 | first created -> last ended s",
            [
                [r["mode"], tenant, *(t[k] for k in BACKLOG_CELLS)]
                for r in rows
                for tenant, t in r["backlog"].items()
            ],
            f"bulk submits its backlog through the API ({CONCURRENCY} requests in flight), "
            f"then small submits {WAVE} tasks every {cfg.wave_every_s:.1f} s. Both weight 1. "
            "Wait = started - created on the Redis clock; position is what POST /tasks "
            "answered (tasks ahead in the order claims will serve). For small, first "
            "created -> last ended is when its last task finished after its first submit; "
            "bulk's span holds small's tasks under fair share (served in between) but not "
            "under FIFO (served after the backlog). All tasks of the part, first created -> "
            "last ended: " + ", ".join(f"{r['mode']} {r['backlog_s']:.2f} s" for r in rows) + ".",
        )
    )
    report.tables.append(
        Table(
            f"Weights: gold (weight 3) and bronze (weight 1), {cfg.weighted} tasks each, "
            "submitted interleaved",
            "mode | saturated window s | gold ended in window | bronze ended in window | split "
            "gold : bronze | gold wait p50 / p99 ms | bronze wait p50 / p99 ms",
            [[r["mode"], *_weights_cells(r["weights"])] for r in rows],
            "Saturated window: from the later of the two tenants' first submit to the "
            "earlier of their last starts (both had tasks queued throughout). Arrivals are "
            "1 : 1, so FIFO serves about 1 : 1; fair share should serve about 3 : 1. "
            f"Ran {time.monotonic() - started:.0f} s (both modes, both parts).",
        )
    )
    _targets(report, rows, cfg)
    report.charts.append(_chart(rows, outdir))
    report.write(outdir)
    return report


def _weights_cells(w: dict[str, Any]) -> list[Any]:
    waits = [f"{w[t]['p50_ms']:.0f} / {w[t]['p99_ms']:.0f}" for t in ("gold", "bronze")]
    return [w["window_s"], w["gold"]["in_window"], w["bronze"]["in_window"],
            f"{w['split']:.2f} : 1", *waits]  # fmt: skip


def _targets(report: Report, rows: list[dict[str, Any]], cfg: Size) -> None:
    fifo, fair = rows[0], rows[1]
    # A task's slot as this run measured it (its sleep plus every overhead): the fair
    # run's span over the tasks each worker ran, not the configured sleep, so a loaded
    # machine moves the bound with the measurement.
    tasks = cfg.bulk + cfg.waves * WAVE
    task_ms = fair["backlog_s"] * 1000 * cfg.workers / tasks
    # Equal weights: small gets every other claim, so the last of a wave of WAVE tasks
    # starts after about 2 * WAVE - 1 claims, one every task slot / workers, plus the
    # task a worker is finishing when the wave arrives.
    bound_ms = ((2 * WAVE - 1) / cfg.workers + 1) * task_ms
    small = fair["backlog"]["small"]
    report.targets += [
        judged(
            f"small tenant's p99 wait behind a {cfg.bulk}-task backlog, fair share",
            f"FIFO: {fifo['backlog']['small']['p99_ms']:.0f} ms",
            small["p99_ms"] / bound_ms,
            f"<= 2 x {bound_ms:.0f} ms (alternating claims, {task_ms:.1f} ms task slots)",
            f"{small['p99_ms']:.0f} ms",
        ),
        judged(
            "completion split, weights 3 : 1, both saturated, fair share",
            f"FIFO: {fifo['weights']['split']:.2f} : 1 (arrivals 1 : 1)",
            fair["weights"]["split"],
            "3 : 1 +- 10 %",
        ),
    ]


def _chart(rows: list[dict[str, Any]], outdir: Path) -> str:
    fig, (left, right) = figure(11.0, 3.8, ncols=2)
    for r, style in zip(rows, ("--", "-"), strict=True):
        for tenant, t in r["backlog"].items():
            cdf(left, t["waits"], style, color=COLORS[tenant], label=f"{tenant}, {r['mode']}")
        for tenant in ("gold", "bronze"):
            ended = r["weights"][tenant]["ended_s"]
            label = f"{tenant}, {r['mode']}"
            right.plot(ended, range(1, len(ended) + 1), style, color=COLORS[tenant], label=label)
    axes(
        left,
        "Backlog: bulk and small tenants",
        "queue wait (ms)",
        "fraction of tasks",
        legend=8,
        xscale="symlog",
    )
    axes(
        right,
        "Weights 3 : 1 (gold : bronze)",
        "time since first submit (s)",
        "tasks ended",
        legend=8,
    )
    return save(fig, outdir, "fair.png")
